"""The agent ↔ worker control channel on one node: files in a per-node directory (``ELASTRAIN_CONTROL_DIR``).

- :mod:`~elastrain.control.files`: one control file, written atomically and read through a checked decode;
- :mod:`~elastrain.control.save`: "save a checkpoint now, and tell me when it is committed" (:class:`ControlChannel`);
- :mod:`~elastrain.control.regroup`: with ``--live``, "a new round formed: regroup in place" (:class:`RegroupChannel`).

Nothing here depends on torch: the agent and the workers both use it. What a worker does with a request
(agree on the step, save, hold for the restart) is :mod:`elastrain.checkpoint.schedule`'s.
"""

from elastrain.control.regroup import RegroupChannel, RegroupNotice, announce_training
from elastrain.control.save import ControlChannel, SaveAck, SaveCause, SaveRequest

__all__ = [
    "ControlChannel",
    "RegroupChannel",
    "RegroupNotice",
    "SaveAck",
    "SaveCause",
    "SaveRequest",
    "announce_training",
]
