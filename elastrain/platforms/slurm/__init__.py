"""Slurm: an sbatch script running one elastrain-run per node (``python -m elastrain.platforms.slurm``)."""
