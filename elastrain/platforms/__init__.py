"""Launch elastrain on a platform: Kubernetes (Kubeflow PyTorchJob) and AzureML command jobs.

Specs are built by pure functions from a few parameters, rendered to YAML, and checked as data.
"""
