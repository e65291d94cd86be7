"""What the tests share: the process helpers (``processes``), the local servers they start (``s3_server``,
``azurite_server``, ``fake_metadata``), the network namespaces of the partition tests (``netns``), the crafted
pickles of the checkpoint safety tests (``crafted_pickle``), the launch specs' checks (``launch_checks``), and the
runs the e2e tests share (``ledger_chain``, ``trainer_trace``). Imported as ``support.<module>``: tests/conftest.py
puts tests/ on ``sys.path``. What the benchmarks use too lives in bench/support/ (the etcd server, the Trainer
ledger and workload): bench/ imports nothing from tests/."""
