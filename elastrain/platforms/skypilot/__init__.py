"""SkyPilot: a managed spot job running one elastrain-run per node (``python -m elastrain.platforms.skypilot``)."""
