"""The agent's checkpoint request before a membership change: ask the local workers, wait (bounded) for the ack.

Asked before this node leaves (SIGTERM, a preemption notice) and before a restart for a node that waits to
join, through the control channel (:class:`~elastrain.control.ControlChannel`); only with
``--checkpoint-dir`` and ``--save-on-change``, and for at most ``--save-timeout``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from elastrain.control import ControlChannel, SaveCause
from elastrain.launcher.options import ElastrainOptions
from elastrain.log import lifecycle


def checkpoint_before_change(
    control: ControlChannel,
    options: ElastrainOptions,
    cause: SaveCause,
    detail: str,
    timeout_s: float,
    *,
    workers_exited: Callable[[], bool] | None = None,
    workers_finishing: Callable[[], bool] | None = None,
) -> None:
    """Ask local workers for a checkpoint and wait (bounded) for the ack; only with --checkpoint-dir. The wait ends
    early when ``workers_exited()``: workers that got the same signal as the agent (a signal to every process of
    the node: a VM's shutdown, Slurm's) died at once and answer nothing, and the node's peers wait for its leave.

    ``workers_finishing()``: every local worker said its training is over (its final save, then its exit). Such
    workers answer no request made after that save; the wait then lets them close, bounded as any, and their exit
    without an answer loses nothing (``event=checkpoint_not_needed``)."""
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
    started = time.monotonic()
    ack = control.wait_ack(req.request_id, wait_s, stop=workers_exited)
    finished = ack is None and workers_finishing is not None and workers_finishing()
    if finished and workers_exited is not None and workers_exited():
        lifecycle(
            "checkpoint_not_needed",
            request_id=req.request_id,
            waited_s=round(time.monotonic() - started, 3),
            why="this node's workers had finished training and exited: their final save is their newest state",
        )
    elif finished:
        lifecycle(
            "checkpoint_timeout",
            level=logging.WARNING,
            request_id=req.request_id,
            waited_s=wait_s,
            why="this node's workers finished training and are still closing (their final save, the script's end)",
        )
    elif ack is None and workers_exited is not None and workers_exited():
        lifecycle(
            "checkpoint_unanswered",
            level=logging.ERROR,
            request_id=req.request_id,
            waited_s=round(time.monotonic() - started, 3),
            why="this node's workers exited before they saved: the change goes on from the job's last checkpoint",
        )
    elif ack is None:
        lifecycle("checkpoint_timeout", level=logging.WARNING, request_id=req.request_id, waited_s=wait_s)
    else:
        lifecycle("checkpoint_acked", request_id=req.request_id, step=ack.step, checkpoint=ack.checkpoint)
