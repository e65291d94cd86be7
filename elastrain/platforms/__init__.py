"""Run elastrain where spot and preemptible capacity is: one subpackage per platform.

- ``kubernetes``: Kubeflow Trainer v2 ``TrainJob`` + ``ClusterTrainingRuntime`` (``kubeflow_trainer``), the v1
  ``PyTorchJob`` (``spec``), an etcd for the etcd-v3 rendezvous;
- ``azureml``: a low-priority compute cluster and command job;
- ``skypilot``: a managed spot job across clouds;
- ``slurm``: an sbatch script that requeues on preemption.

Specs are built by pure functions from a few frozen, validated parameters, rendered to YAML (or a
script), checked as data against kept schemas, and rendered as examples into ``launch/<platform>/``.
Platforms that start one process per node share :mod:`elastrain.platforms.entrypoint`. The name is
``platforms``, not ``launch``: ``elastrain.launcher`` is the torchrun drop-in that runs on each node.
"""
