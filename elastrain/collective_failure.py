"""A worker whose collective broke under it: most often the echo of a peer's failure, not a failure of its own.

When one rank dies, its peers' next collective fails a moment later (gloo: "Connection reset by peer";
NCCL: a ``DistBackendError``). Every agent then sees its workers fail, and must tell the cause (whose
failure counts against its ``--max-restarts``) from the echoes (which re-form without counting one).
The order in which agents report is not enough: a loaded machine's agent reports late. So a worker whose
exception is a collective failure says so on its node's control channel before it exits
(:func:`note_if_collective_failure`: ``Session`` does, and the zygote does for any script it forks), and
its agent reports an echo (see :func:`elastrain.rendezvous.state.report_failure`); a script decorated
with torch's ``@record`` says it through its error file. gloo's errors are plain ``RuntimeError``s, recognised
by the transport's words; torch's typed ``DistError``s are recognised by type.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from elastrain.control import RegroupChannel
from elastrain.env import WorkerEnv
from elastrain.errors import CheckpointSaveError
from elastrain.log import lifecycle

# Words of gloo's transport errors (gloo/transport/tcp/pair.cc, unbound_buffer.cc: resets, closes, timeouts).
_GLOO_WORDS = ("gloo/transport", "Connection reset by peer", "Connection closed by peer")


def names_collective_failure(text: str) -> bool:
    """Whether an error's text (a worker's torch error file, see ``@record``) is a gloo transport failure."""
    return any(w in text for w in _GLOO_WORDS)


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is a collective that failed for want of a peer."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, dist.DistError):
            return True
        if isinstance(cur, RuntimeError) and names_collective_failure(str(cur)):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def names_peer_failure(exc: CheckpointSaveError) -> bool:
    """Whether a failed save names a peer's failure: a collective of the save broke (in its chain, or in the
    outcome a peer broadcast, which carries that rank's error as text). Otherwise every rank agreed on the
    storage's error, and no regroup can help."""
    return is_collective_failure(exc) or names_collective_failure(str(exc))


def note_if_collective_failure(env: WorkerEnv, exc: BaseException) -> bool:
    """Under elastrain-run, tell the agent that this worker ends because a collective broke; True if so."""
    if not (env.under_elastrain and env.control_dir) or not is_collective_failure(exc):
        return False
    try:
        RegroupChannel(env.control_dir).report_broken(env.local_rank, env.round)
    except OSError as err:
        lifecycle("collective_failure_unreported", level=logging.WARNING, error=repr(err)[:200])
        return False
    lifecycle("collective_failed", level=logging.WARNING, round=env.round, error=repr(exc)[:200])
    return True
