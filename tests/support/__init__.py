"""What the tests share: the process helpers (``processes``), the local servers they start (``etcd_server``,
``s3_server``, ``azurite_server``, ``fake_metadata``), the network namespaces of the partition tests (``netns``),
the crafted pickles of the checkpoint safety tests (``crafted_pickle``) and the launch specs' checks
(``launch_checks``). Imported as ``support.<module>``: tests/conftest.py puts tests/ on ``sys.path``."""
