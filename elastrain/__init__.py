"""elastrain: elastic training for PyTorch on nodes that come and go.

Launch with ``elastrain-run`` (a drop-in for ``torchrun``); inside the training script, read
:class:`WorkerEnv` and use the library's checkpoints, elastic data and scaling policies.
"""

from elastrain.env import StartReason, WorkerEnv
from elastrain.errors import ElastrainError

__version__ = "0.1.0"

__all__ = ["ElastrainError", "StartReason", "WorkerEnv", "__version__"]
