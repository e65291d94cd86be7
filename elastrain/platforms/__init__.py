"""Run elastrain where spot and preemptible capacity is: one subpackage per platform.

- ``kubernetes``: Kubeflow Trainer v2 ``TrainJob`` + ``ClusterTrainingRuntime`` (``kubeflow_trainer``), the v1
  ``PyTorchJob`` (``spec``), an etcd for the etcd-v3 rendezvous;
- ``azureml``: a low-priority compute cluster and command job;
- ``skypilot``: a managed spot job across clouds;
- ``slurm``: an sbatch script that requeues itself at its time limit, and on preemption where the site's
  ``PreemptMode=REQUEUE`` or ``send_user_signal`` allows.

Specs are built by pure functions from a few frozen, validated parameters, rendered to YAML (or a
script), checked as data against kept schemas, and rendered as examples into ``launch/<platform>/``.
What they run on comes from one place: :mod:`~elastrain.platforms.image` names the image the repository's
``Dockerfile`` builds (Kubernetes, AzureML), :mod:`~elastrain.platforms.install` writes the
``tools/install.sh`` command that installs the same list on a platform's own nodes (SkyPilot, Slurm), and
:mod:`~elastrain.platforms.needs` checks that a training script's imports and flags are met there.
Platforms that start one process per node share :mod:`elastrain.platforms.entrypoint`. The name is
``platforms``, not ``launch``: ``elastrain.launcher`` is the torchrun drop-in that runs on each node.
"""
