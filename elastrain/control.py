"""The agent ↔ worker control channel on one node: "save a checkpoint now, and tell me when it is committed".

The agent asks before an announced membership change (SIGTERM, a preemption notice, a node waiting
to join) so that the change costs no steps. It is a pair of small files in a per-node directory
(``ELASTRAIN_CONTROL_DIR``), written atomically, so a worker pays one ``stat`` per poll and nothing
here depends on torch. Workers must agree among themselves on *when* to honour a request (any rank
that saw it makes all ranks save at the same step boundary); that agreement lives in the checkpoint
module, not here.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_REQUEST = "save-request.json"
_ACK = "save-ack-{request_id}.json"


@dataclass(frozen=True)
class SaveRequest:
    request_id: int
    reason: str
    requested_at: float


@dataclass(frozen=True)
class SaveAck:
    request_id: int
    step: int
    checkpoint: str


def _write_atomic(path: Path, payload: dict[str, object]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


class ControlChannel:
    """One node's channel; the agent and every local worker open the same directory."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._handled = -1
        self._last_mtime: int | None = None

    # -- agent side -------------------------------------------------------------------------------
    def request_save(self, reason: str) -> SaveRequest:
        previous = self.current_request()
        req = SaveRequest(
            request_id=(previous.request_id + 1) if previous else 1, reason=reason, requested_at=time.time()
        )
        _write_atomic(self.directory / _REQUEST, req.__dict__)
        return req

    def ack_for(self, request_id: int) -> SaveAck | None:
        path = self.directory / _ACK.format(request_id=request_id)
        try:
            data = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return SaveAck(request_id=int(data["request_id"]), step=int(data["step"]), checkpoint=str(data["checkpoint"]))

    def wait_ack(self, request_id: int, timeout_s: float, poll_s: float = 0.05) -> SaveAck | None:
        deadline = time.monotonic() + timeout_s
        while True:
            ack = self.ack_for(request_id)
            if ack is not None or time.monotonic() >= deadline:
                return ack
            time.sleep(poll_s)

    # -- worker side ------------------------------------------------------------------------------
    def current_request(self) -> SaveRequest | None:
        try:
            data = json.loads((self.directory / _REQUEST).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return SaveRequest(int(data["request_id"]), str(data["reason"]), float(data["requested_at"]))

    def pending(self) -> SaveRequest | None:
        """The newest request this process has not yet marked handled; cheap when nothing changed."""
        try:
            mtime = (self.directory / _REQUEST).stat().st_mtime_ns
        except FileNotFoundError:
            return None
        if mtime == self._last_mtime:
            return None
        req = self.current_request()
        if req is None or req.request_id <= self._handled:
            self._last_mtime = mtime
            return None
        return req

    def mark_handled(self, request_id: int) -> None:
        self._handled = max(self._handled, request_id)

    def ack(self, request_id: int, step: int, checkpoint: str) -> None:
        self.mark_handled(request_id)
        _write_atomic(
            self.directory / _ACK.format(request_id=request_id),
            {"request_id": request_id, "step": step, "checkpoint": checkpoint},
        )


def hold_for_restart(seconds: float, step: int, log: Callable[..., None]) -> None:
    """Worker side, after the save that answered a request: wait (bounded) to be restarted.

    The launcher asked because a membership change is coming; a step run now would be redone after
    the restart. If no restart comes within ``seconds`` (the change was called off), training goes on
    from the checkpoint. ``log(event, level, **fields)`` is the caller's lifecycle logger.
    """
    if seconds <= 0:
        return
    log("checkpoint_hold", logging.INFO, step=step, up_to_s=seconds)
    time.sleep(seconds)
    log("checkpoint_hold_over", logging.WARNING, step=step)
