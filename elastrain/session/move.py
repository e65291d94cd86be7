"""A live worker's move to its agent's next round (``elastrain-run --live true``): the notice, leaving this
world, entering the next one, and the failures on the way.

When to move is :mod:`elastrain.session.regroup`'s (pure rules); what entering and leaving a world does
is :class:`~elastrain.session.world.World`'s. Here is the order: wait (bounded) for the agent's notice,
save a sharded model's step when every member stays, leave, join the notice's round, and, when a member
of that round fails too, wait for the round after it (up to ten in a row).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

import torch.distributed as dist

from elastrain.collective_failure import is_collective_failure, names_peer_failure
from elastrain.env import WorkerEnv
from elastrain.errors import CheckpointSaveError, StaleGenerationError
from elastrain.live.member import LiveMember
from elastrain.live.transfer import TransferFailedError
from elastrain.log import lifecycle
from elastrain.session.errors import SessionError
from elastrain.session.regroup import supersedes
from elastrain.session.runtime import Runtime
from elastrain.session.step import Step
from elastrain.session.world import World
from elastrain.train_state import TrainState

MAX_ROUNDS_IN_A_ROW = 10

EnterRound = Callable[[WorkerEnv, bool, float], None]
"""Enter the new round's world: ``(its WorkerEnv, whether this worker's state counts, when the move started)``."""


def move_to_next_round(
    live: LiveMember,
    world: World,
    env: WorkerEnv,
    step: int,
    cause: BaseException | None,
    wait: bool,
    enter: EnterRound,
) -> bool:
    """Move to the agent's next round (waiting, bounded, for its notice when ``cause`` broke a collective, or
    when ``wait``: a peer's agent announced it first). False when no notice came and nothing broke; ``cause``
    is raised when no notice came after it."""
    timeout = env.regroup_timeout_s if cause is not None or wait else 0.0
    notice = live.pending_notice()
    if notice is None and cause is not None:
        live.report_broken()  # the agent probes its peers at once
    if notice is None and timeout > 0:
        notice = live.wait_notice(live.round, timeout)
    if notice is None:
        lifecycle("regroup_notice_missing", level=logging.WARNING, waited_s=timeout, error=repr(cause)[:200])
        if cause is not None:
            raise cause
        return False
    started = time.monotonic()
    lifecycle(
        "regroup_started",
        round=f"{live.round}->{notice.round}",
        step=step,
        cause=type(cause).__name__ if cause is not None else "notice",
        state="dropped: the job trained on without this node" if notice.superseded else "kept",
    )
    if notice.no_departure and cause is None:
        world.save_shards(notice.generation)
    world.leave()
    dropped = False
    for attempt in range(1, MAX_ROUNDS_IN_A_ROW + 1):
        # Left behind (cut off while the job trained on): this state is a superseded world's; receive. Once
        # dropped, it stays dropped through the rounds tried after. A receiver whose transfer broke off holds no
        # whole state: it receives again.
        dropped = dropped or notice.superseded
        try:
            env = live.move_to(notice)
            enter(env, not dropped and world.handover.intact, started)
            return True
        except (RuntimeError, dist.DistError, TimeoutError) as exc:
            # A member of the announced round failed too: wait for the round after it.
            lifecycle(
                "regroup_failed", level=logging.WARNING, round=notice.round, attempt=attempt, error=repr(exc)[:200]
            )
            world.leave()
            nxt = live.wait_notice(notice.round, env.regroup_timeout_s)
            if nxt is None:
                raise
            notice = nxt
    raise SessionError(f"no regroup succeeded in {MAX_ROUNDS_IN_A_ROW} rounds in a row")


def superseded_by_own_round(live: LiveMember, env: WorkerEnv, step: int, exc: StaleGenerationError) -> bool:
    """Whether a save was refused because this node's agent formed the next round (its claim of a newer fencing
    generation came before the save's commit), not because another world took over: the agent's notice of
    that round says so (it follows the claim at once; bounded wait). The save is given up (the state is in
    memory and moves with the regroup); the next save is the new world's."""
    notice = live.pending_notice() or live.wait_notice(live.round, env.regroup_timeout_s)
    ours = env.generation
    if notice is None or not supersedes(notice, ours):
        return False
    lifecycle(
        "checkpoint_superseded",
        level=logging.WARNING,
        step=step,
        generation=f"{ours}->{notice.generation}",
        why="the save's commit came after this node's next round claimed the checkpoint root; given up",
        error=str(exc)[:200],
    )
    return True


class LiveMoves:
    """A live session's moves to the next round: after a collective broke, or at an agreed step boundary.

    ``enter`` enters the new round's world (the session's, which takes the round's WorkerEnv as its own)."""

    def __init__(self, runtime: Runtime, world: World, state: TrainState, enter: EnterRound) -> None:
        self.runtime = runtime
        self.world = world
        self.state = state
        self.enter = enter
        self.moved = False
        """A move since the last :meth:`collect_garbage` (the next step's start): the replaced DDP wrapper may still
        be referenced, and the last step's agreed flags were agreed by the world left (its regroup is made)."""

    def collective_broke(self, env: WorkerEnv, exc: BaseException, step: Step | None, group_error: bool) -> None:
        """A collective failed: in live mode, regroup (giving ``step`` up), else raise ``exc``.

        ``group_error``: the error came from the training group, so it is known to be a broken group; any
        other error is taken for one only if the agent announces a regroup within the regroup timeout, save a save
        that every rank agreed failed for want of storage (raised at once: :func:`names_peer_failure`).
        """
        live = self.runtime.live
        if live is None:
            raise exc
        if group_error and not live.group.broken.is_set() and not is_collective_failure(exc):
            raise exc  # not a collective that broke (the script's own error): no regroup can help
        if isinstance(exc, CheckpointSaveError) and not names_peer_failure(exc):
            # Every rank agreed the save failed (the commit broadcasts its outcome): the storage's error, named
            # with its path, and no peer's. Waiting for a regroup notice that never comes helps nobody.
            raise exc
        self.regroup(env, exc)
        if step is not None:
            step.abandoned = True

    def land_state(self, env: WorkerEnv) -> bool:
        """At the loop's end, on every rank: what a catch-up's transfer still had to send in phases, sent now
        (:meth:`~elastrain.session.handover.Handover.flush`); False when it broke off and the world regrouped (the
        loop goes on in the new world)."""
        try:
            self.world.handover.flush()
        except TransferFailedError as exc:
            self.collective_broke(env, exc, None, group_error=True)
            return False
        return True

    def regroup(self, env: WorkerEnv, cause: BaseException | None, wait: bool = False) -> None:
        """Move to the agent's next round (:func:`move_to_next_round`)."""
        live = self.runtime.live
        if live is None:
            raise SessionError("internal: regroup outside live mode")
        if move_to_next_round(live, self.world, env, self.state.step, cause, wait, self.enter):
            self.moved = True

    def superseded(self, env: WorkerEnv, exc: StaleGenerationError) -> bool:
        """Live mode: whether a save was refused because this node's own next round claimed the checkpoint root."""
        live = self.runtime.live
        return live is not None and superseded_by_own_round(live, env, self.state.step, exc)

    def collect_garbage(self) -> None:
        """After a move: the replaced DDP wrapper's reducer must be gone (its autograd hooks with it) before a
        backward. A full collection only when something still refers to it (it costs 0.2-0.3 s with torch loaded,
        on the running workers' path after a join, where the wrapper is usually freed the moment it is dropped)."""
        if self.moved:
            self.moved = False
            if self.runtime.replaced_alive():
                started = time.monotonic()
                gc.collect()
                lifecycle(
                    "garbage_collected",
                    took_s=round(time.monotonic() - started, 3),
                    why="the replaced DDP wrapper was still referenced",
                )
