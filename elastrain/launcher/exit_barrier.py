"""The wait at the end of a node's successful run for the other nodes of its round: torch's exit barrier, elastic.

torch's agent, once its workers succeeded, keeps the node (and the rendezvous store it may host) up until every node
of the round finished, so that a node still finishing (rank 0 saving the final model, a last evaluation) keeps its
store. Its barrier is one blocking ``store.wait`` with the store client's timeout raised to ``exit_barrier_timeout``
(300 s). elastrain's liveness threads share that client: their heartbeats then stalled behind the wait, so a node
that finished a few seconds before a peer was declared dead by it (``node_dead how=heartbeat_timeout``), and the
peer, mid-save, began a new round; a node whose round lost a member (a joiner that formed the next round alone once
this node's workers had ended) waited out the whole timeout for it.

Here a node counts itself in, then reads the count with short calls (the heartbeat goes on between them), and stops
waiting once every node of the round has counted itself in, the round is over for another reason (a member departed
or failed, a newer round formed, this node was fenced or evicted: :meth:`Membership.membership_change`, a node that
merely waits to join excepted), the store is gone, or this node leaves; bounded by the timeout in any case. The count
lives under the round's own prefix (the store torch's agent is given is the round's), so each round has its own.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

from torch._C._distributed_c10d import Store

from elastrain.errors import RendezvousError
from elastrain.log import lifecycle
from elastrain.rendezvous.api import Membership
from elastrain.rendezvous.connection import STORE_ERRORS
from elastrain.rendezvous.state import ChangeKind

KEY = "elastrain/exit_barrier/arrived"
POLL_S = 0.25
"""How often the count is read (one small store call)."""


class Outcome(str, enum.Enum):
    PASSED = "passed"  # every node of the round counted itself in
    RELEASED = "released"  # the round is over for another reason: nobody else will come
    LEFT = "left"  # this node leaves (SIGTERM, a preemption notice)
    STORE_FAILED = "store_failed"  # the store is gone: nothing is held for anyone
    TIMED_OUT = "timed_out"
    SKIPPED = "skipped"  # this node's workers ended before they joined the round: it never trained


def wait(
    store: Store,
    nodes: int,
    membership: Membership,
    timeout_s: float,
    leaving: Callable[[], bool] = lambda: False,
    unjoined: bool = False,
    poll_s: float = POLL_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Outcome:
    """Count this node in at ``store`` (the round's) and wait, bounded by ``timeout_s``, for its ``nodes`` nodes; one
    log line says how the wait ended. ``unjoined``: this node's workers ended before they joined this round (they
    finished training as it formed, a joiner in it): nothing is waited for. The round never trained, its joiners'
    workers wait in it for ours until this node's close reaches them (they then find the job finished), and the
    other nodes that finished with ours are in the same case."""
    started = clock()

    def ended(outcome: Outcome, level: int = logging.INFO, **fields: object) -> Outcome:
        lifecycle(
            f"exit_barrier_{outcome.value}", level=level, nodes=nodes, waited_s=round(clock() - started, 3), **fields
        )
        return outcome

    if unjoined:
        return ended(Outcome.SKIPPED, why="its workers finished training before they joined this round")
    try:
        arrived = int(store.add(KEY, 1))
        if arrived < nodes:
            lifecycle("exit_barrier_waiting", nodes=nodes, arrived=arrived, up_to_s=timeout_s)
        while True:
            if arrived >= nodes:
                return ended(Outcome.PASSED)
            if leaving():
                return ended(Outcome.LEFT, arrived=arrived)
            if membership.fatal_error is not None:
                return ended(Outcome.STORE_FAILED, logging.WARNING, arrived=arrived, error=str(membership.fatal_error))
            change = membership.membership_change()
            if change is not None and change.kind is not ChangeKind.SCALE_UP:
                return ended(Outcome.RELEASED, arrived=arrived, cause=str(change))
            if clock() - started >= timeout_s:
                return ended(Outcome.TIMED_OUT, logging.WARNING, arrived=arrived, timeout_s=timeout_s)
            sleep(poll_s)
            arrived = int(store.add(KEY, 0))
    except (*STORE_ERRORS, RendezvousError) as exc:  # the workers succeeded: the wait ends, never the node's success
        return ended(Outcome.STORE_FAILED, logging.WARNING, error=repr(exc)[:200])
