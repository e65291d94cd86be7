"""The rendezvous handler's settings: ``--rdzv-conf`` keys, read and checked once.

Options (``--rdzv-conf key=value``), in seconds:

* ``heartbeat_interval`` (0.25) and ``heartbeat_timeout`` (5): a node whose heartbeat did not move
  for the timeout is dead (a node whose agent process is gone is dead at once: its probe port refuses,
  so the timeout only decides for frozen or unreachable nodes; a short one evicts live nodes that are
  merely CPU-starved, as seen with 1.25 s on a loaded 2-core machine);
* ``last_call_timeout`` (30, as torch): how long a job's *first* round waits for more than
  ``min_nodes``; later rounds never wait for it, nor does the first round of a job that a node started over
  (refound, revived), that lost every member while a node was on its way in, or whose nodes were all launched again
  after every one died (its claim in the checkpoint root), which waits ``scale_up_window``;
* ``join_timeout`` (600): how long a node waits for a round while no round of the job is running
  (a spare waits as long as the job runs);
* ``store_lost_timeout`` (3): how long the store may fail before giving up;
* ``scale_up_window`` (1): a running round waits this long after it first sees a newcomer before it
  re-forms, so that nodes arriving together join in one round;
* ``claim_grace`` (2 x heartbeat_timeout): how long a round that holds no majority of the previous
  round's voters waits before it claims the next generation (a majority side claims first);
* ``read_timeout`` (5): how long one blocking read of the agents' store waits (the c10d TCPStore or the etcd
  store): torch's agent waits that long for a member's worker information after a round forms, so a member
  frozen or killed right then costs this much, not the store's default of minutes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastrain import binding
from elastrain.errors import UsageError

DEFAULT_READ_TIMEOUT_S = 5.0
"""A blocking read of the agents' store gives up after this long (a store's own default, 60-300 s, would stall
every node of a round behind one member that froze as the round formed)."""


def seconds(params: RendezvousParameters, key: str) -> float | None:
    """``--rdzv-conf KEY``: a finite number of seconds, or None when not given (UsageError naming the key)."""
    raw = params.get(key, None)
    if raw is None:
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise UsageError(f"--rdzv-conf {key}", f"expected seconds, got {raw!r}") from None
    if not math.isfinite(value):
        raise UsageError(f"--rdzv-conf {key}", f"expected a finite number of seconds, got {raw!r}")
    return value


def read_timeout(params: RendezvousParameters) -> timedelta:
    """``--rdzv-conf read_timeout``: how long one blocking read of the agents' store may wait (seconds, > 0)."""
    value = seconds(params, "read_timeout")
    if value is None:
        return timedelta(seconds=DEFAULT_READ_TIMEOUT_S)
    if not value > 0:
        raise UsageError("--rdzv-conf read_timeout", f"must be > 0 seconds, got {value}")
    return timedelta(seconds=value)


@dataclass(frozen=True)
class HandlerSettings:
    heartbeat_interval_s: float = 0.25
    heartbeat_timeout_s: float = 5.0
    last_call_s: float = 30.0
    join_timeout_s: float = 600.0
    store_lost_timeout_s: float = 3.0
    scale_up_window_s: float = 1.0
    claim_grace_s: float | None = None
    poll_min_s: float = 0.02
    poll_max_s: float = 0.25
    poll_forming_s: float = 0.05
    """How often, at most, a node waits between reads while a round it belongs to is forming (a member departed
    or re-joined): the round completes within moments, and every waiter should see it at once."""
    suspect_after: float = 0.9
    """Heartbeat intervals without a move after which the judge probes a node (a refused probe evicts it)."""
    leave_timeout_s: float = 5.0
    store_op_timeout_s: float = 10.0
    """A store call that has not returned by then is abandoned: a TCPStore client whose packets are silently
    dropped (a network cut) blocks in its receive forever, whatever its own timeout."""
    refound_after_s: float = 60.0
    """A node that never joined a round and found no live store of its job for this long (the published store
    silent: every member died with its host) starts the job over at ``--rdzv-endpoint`` (c10d): a first start
    from the newest checkpoint, under the next fencing generation (a world that was only slow is then fenced);
    at once when the world's last node recorded beside the claims that it left (see ``fence.Vacated``).
    A node whose world lost the fencing claim to a world that then died whole (nothing has listened at the
    winner's store for this long: every connection refused) starts its own lineage over in the same way."""

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0:
            raise UsageError("--rdzv-conf heartbeat_interval", f"must be > 0, got {self.heartbeat_interval_s}")
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s + 0.2:
            raise UsageError(
                "--rdzv-conf heartbeat_timeout",
                f"must be at least 2 x heartbeat_interval + 0.2 s ({2 * self.heartbeat_interval_s + 0.2:.2f}), "
                f"got {self.heartbeat_timeout_s}: a shorter one evicts live but busy nodes",
            )
        for key, value in (
            ("join_timeout", self.join_timeout_s),
            ("store_lost_timeout", self.store_lost_timeout_s),
            ("store_op_timeout", self.store_op_timeout_s),
        ):
            if value <= 0:
                raise UsageError(f"--rdzv-conf {key}", f"must be > 0 seconds, got {value}")
        if self.last_call_s < 0:
            raise UsageError("--rdzv-conf last_call_timeout", f"must be >= 0, got {self.last_call_s}")
        if self.scale_up_window_s < 0:
            raise UsageError("--rdzv-conf scale_up_window", f"must be >= 0, got {self.scale_up_window_s}")
        if self.claim_grace_s is not None and self.claim_grace_s < 0:
            raise UsageError("--rdzv-conf claim_grace", f"must be >= 0, got {self.claim_grace_s}")
        if self.refound_after_s <= self.store_lost_timeout_s:
            raise UsageError(
                "--rdzv-conf refound_after",
                f"must be > store_lost_timeout ({self.store_lost_timeout_s} s), got {self.refound_after_s}",
            )

    @property
    def stall_s(self) -> float:
        """A heartbeat tick this late (or a store read this slow) means this node itself stalled."""
        return max(self.heartbeat_timeout_s / 2, 0.5)

    @property
    def departure_grace_s(self) -> float:
        """How long after a worker failure a peer's departure (its cause) can take to show up in the state."""
        return self.heartbeat_timeout_s + 2 * self.heartbeat_interval_s

    @property
    def grace_s(self) -> float:
        return 2 * self.heartbeat_timeout_s if self.claim_grace_s is None else self.claim_grace_s

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> HandlerSettings:
        d = cls()

        def req(key: str, default: float) -> float:
            value = seconds(params, key)
            return default if value is None else value

        return cls(
            heartbeat_interval_s=req("heartbeat_interval", d.heartbeat_interval_s),
            heartbeat_timeout_s=req("heartbeat_timeout", d.heartbeat_timeout_s),
            last_call_s=req("last_call_timeout", d.last_call_s),
            join_timeout_s=req("join_timeout", d.join_timeout_s),
            store_lost_timeout_s=req("store_lost_timeout", d.store_lost_timeout_s),
            scale_up_window_s=req("scale_up_window", d.scale_up_window_s),
            store_op_timeout_s=req("store_op_timeout", d.store_op_timeout_s),
            claim_grace_s=seconds(params, "claim_grace"),
            refound_after_s=req("refound_after", d.refound_after_s),
        )


def node_address(params: RendezvousParameters) -> str:
    """What peers and workers use to reach this node: ``--local-addr``, else loopback for a loopback endpoint, else
    the FQDN (as torch's handler); every port it listens on is bound to this address's interface (binding.py)."""
    return binding.advertised_address(params.local_addr, str(params.endpoint))
