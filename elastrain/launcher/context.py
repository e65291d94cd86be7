"""The agent's one builder of :class:`~elastrain.env.LaunchContext`: what its workers are told at each start.

Two kinds of start: a round's (after a rendezvous: the round, its start reason, the fencing generation)
and a warm one (``--live``: workers started before this node has a round, told everything but their
place in one). Both carry the node's settings the same way, from :class:`ContextBuilder`.
"""

from __future__ import annotations

from elastrain.env import LaunchContext, StartReason
from elastrain.launcher.options import ElastrainOptions
from elastrain.launcher.regroup import regroup_timeout_s


class ContextBuilder:
    """Builds the launch context of each start of this node's workers, from the node's settings."""

    def __init__(self, options: ElastrainOptions, run_id: str, control_dir: str) -> None:
        self._options = options
        self._run_id = run_id
        self._control_dir = control_dir

    def for_round(
        self,
        round_: int,
        failure_count: int,
        start_reason: StartReason,
        previous_world_size: int | None,
        generation: int | None,
        first_round: bool,
    ) -> LaunchContext:
        """The context of a start into round ``round_`` (its restart count is the round: the same on every node);
        ``first_round``: it is the job's first (known job-wide), whose every member starts from the top."""
        live = self._options.live
        return self._build(
            round_, round_, failure_count, start_reason, previous_world_size, generation, live, first_round
        )

    def warm(self) -> LaunchContext:
        """What a warm worker is told before it has a round: everything but its place in one (whether it may found
        the job comes through its control folder: :meth:`~elastrain.control.regroup.RegroupChannel.job_forming`)."""
        return self._build(-1, 0, 0, StartReason.FIRST_START, None, None, live=True, first_round=False)

    def _build(
        self,
        round_: int,
        restart_count: int,
        failure_count: int,
        start_reason: StartReason,
        previous_world_size: int | None,
        generation: int | None,
        live: bool,
        first_round: bool,
    ) -> LaunchContext:
        opts = self._options
        return LaunchContext(
            run_id=self._run_id,
            restart_count=restart_count,
            failure_count=failure_count,
            start_reason=start_reason,
            previous_world_size=previous_world_size,
            round=round_,
            checkpoint_dir=opts.checkpoint_dir,
            control_dir=self._control_dir,
            collective_timeout_s=opts.collective_timeout_s,
            first_step_timeout_s=opts.first_step_timeout_s if live else None,
            io_timeout_s=opts.io_timeout_s,
            generation=generation,
            live=live,
            regroup_timeout_s=regroup_timeout_s(opts) if live else None,
            first_round=live and first_round,
        )
