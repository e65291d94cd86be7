"""What the agent asks of membership: one typed seam between the launcher and any rendezvous handler.

elastrain's own handler (:class:`~elastrain.rendezvous.handler.ElastrainRendezvousHandler`) implements
:class:`Membership`; torch's handlers (``torch-c10d``, ``static``, ``etcd``) do not, and
:func:`membership_of` wraps them in :class:`TorchMembership`, whose answers are neutral: no membership
changes beyond torch's own ``num_nodes_waiting``, no grace, no verdicts, no fencing generation. The
agent talks to membership through this Protocol only (never ``getattr`` on the handler).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from torch.distributed.elastic.rendezvous import RendezvousHandler

from elastrain.log import lifecycle
from elastrain.rendezvous.state import Change, Departure


@runtime_checkable
class Membership(Protocol):
    """A node's view of the job's membership, as the agent needs it."""

    @property
    def round(self) -> int | None:
        """The job-wide round of the last completed rendezvous, the same on every node (None: not known)."""
        ...

    @property
    def generation(self) -> int | None:
        """The fencing generation this node's world claimed in the checkpoint root (None: none claimed)."""
        ...

    @property
    def kept_every_member(self) -> bool:
        """Whether the round just formed holds every member of this node's previous round (nodes joined, none
        left): the same answer on every node of both rounds."""
        ...

    @property
    def left_behind(self) -> bool:
        """Whether this node was left behind by the round just formed (it skipped rounds, was redirected to a
        winning world's store, or was frozen for a heartbeat timeout and lost a member): the job may have trained on
        without it, and its workers' state in memory is a superseded world's."""
        ...

    @property
    def membership_grace_s(self) -> float:
        """How long after a worker failure a departed peer can take to show up (0: no grace)."""
        ...

    @property
    def verdict_pending(self) -> bool:
        """Whether a worker failure cannot be judged yet (the store fails, a member has not beaten since)."""
        ...

    @property
    def fatal_error(self) -> BaseException | None:
        """An error that ends this node (raised by the agent at its next tick), or None."""
        ...

    def job_formed(self) -> bool | None:
        """Whether the job has formed a round yet, read now from the shared state (None: it cannot say): before
        this node's first rendezvous, whether it is about to found the job or to join one that trains on."""
        ...

    def on_formed_without_this_node(self, callback: Callable[[], None]) -> None:
        """Have ``callback`` called once (on the thread that forms this node's round) when this node first waits for
        a round of a job that formed one without it: a spare, or a node that came as the job formed."""
        ...

    def membership_change(self) -> Change | None:
        """The change that ends this node's round (a member departed, a node waits, this node was evicted...)."""
        ...

    def report_worker_failure(self, echo: bool = False) -> None:
        """This node's workers failed (``echo``: because a collective broke under them, not of their own)."""
        ...

    def probe_peers(self) -> None:
        """Check the round's members now (a worker's collective broke): a dead peer is found at once."""
        ...

    def leave(self, reason: str, kind: Departure = Departure.LEFT) -> None:
        """Announce this node's departure (``kind``: left, failed, or a setting error)."""
        ...

    def stop_beating(self) -> None:
        """End this node's liveness threads (bounded) and leave the rendezvous as it is: the agent is about to exit
        without closing it (the job finished elsewhere, the node left or was signalled). A daemon thread still inside
        a store call when the interpreter finalises is ended by ``pthread_exit`` through C++ frames that may not
        unwind: the process aborts (``terminate called without an active exception``) after the job is done."""
        ...


class TorchMembership:
    """:class:`Membership` for torch's own handlers: neutral answers, and a log line where elastrain would act."""

    def __init__(self, handler: RendezvousHandler) -> None:
        self._handler = handler

    @property
    def round(self) -> int | None:
        return None

    @property
    def generation(self) -> int | None:
        return None

    @property
    def kept_every_member(self) -> bool:
        return False

    @property
    def left_behind(self) -> bool:
        return False  # torch's handlers number no rounds the agent can compare

    @property
    def membership_grace_s(self) -> float:
        return 0.0

    @property
    def verdict_pending(self) -> bool:
        return False

    @property
    def fatal_error(self) -> BaseException | None:
        return None

    def job_formed(self) -> bool | None:
        return None  # torch's handlers keep no job-wide rounds

    def on_formed_without_this_node(self, callback: Callable[[], None]) -> None:
        return None  # never called: job_formed() is None, so the agent asks for no such word

    def membership_change(self) -> Change | None:
        return None

    def report_worker_failure(self, echo: bool = False) -> None:
        return None

    def probe_peers(self) -> None:
        return None

    def leave(self, reason: str, kind: Departure = Departure.LEFT) -> None:
        lifecycle(
            "leave_unannounced",
            level=logging.WARNING,
            reason=reason,
            why=f"torch's {self._handler.get_backend()} rendezvous cannot announce a leave; the others find out later",
        )

    def stop_beating(self) -> None:
        return None  # torch's handlers stop their own keep-alive in shutdown()


def membership_of(handler: RendezvousHandler) -> Membership:
    """``handler`` itself when it is elastrain's, else :class:`TorchMembership` around it."""
    if isinstance(handler, Membership):
        return handler
    return TorchMembership(handler)
