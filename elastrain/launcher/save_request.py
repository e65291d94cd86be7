"""The agent's checkpoint request before a membership change: ask the local workers, wait (bounded) for the ack.

Asked before this node leaves (SIGTERM, a preemption notice) and before a restart for a node that waits to
join, through the control channel (:class:`~elastrain.control.ControlChannel`); only with
``--checkpoint-dir`` and ``--save-on-change``, and for at most ``--save-timeout``.
"""

from __future__ import annotations

import logging

from elastrain.control import ControlChannel, SaveCause
from elastrain.launcher.options import ElastrainOptions
from elastrain.log import lifecycle


def checkpoint_before_change(
    control: ControlChannel, options: ElastrainOptions, cause: SaveCause, detail: str, timeout_s: float
) -> None:
    """Ask local workers for a checkpoint and wait (bounded) for the ack; only with --checkpoint-dir."""
    if not options.save_on_change or not options.checkpoint_dir or timeout_s <= 0:
        return
    try:
        req = control.request_save(cause, detail)
    except OSError as exc:  # the control directory is gone or unwritable: the job's last checkpoint stands
        lifecycle(
            "checkpoint_request_failed",
            level=logging.ERROR,
            cause=cause.value,
            error=repr(exc)[:300],
            control_dir=str(control.directory),
            why="going on without this checkpoint",
        )
        return
    lifecycle("checkpoint_requested", request_id=req.request_id, reason=req.reason, timeout_s=timeout_s)
    wait_s = min(options.save_timeout_s, timeout_s)
    ack = control.wait_ack(req.request_id, wait_s)
    if ack is None:
        lifecycle("checkpoint_timeout", level=logging.WARNING, request_id=req.request_id, waited_s=wait_s)
    else:
        lifecycle("checkpoint_acked", request_id=req.request_id, step=ack.step, checkpoint=ack.checkpoint)
