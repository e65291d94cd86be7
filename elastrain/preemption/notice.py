"""A preemption notice, and the small interface every watcher implements.

A :class:`Notice` says who warned us (``source``), what is coming (``kind``), when we heard it
(``noticed_at``) and when the node is expected to go (``deadline``), both as Unix wall-clock seconds
so that a log line can be compared with the cloud's own timestamps.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from datetime import datetime, timezone


@dataclass(frozen=True)
class Notice:
    source: str
    """Which watcher saw it: ``azure``, ``aws``, ``gcp`` or ``sigterm``."""
    kind: str
    """What the platform announced, in its own words (``Preempt``, ``terminate``, ``preempted``, ``SIGTERM``)."""
    noticed_at: float
    """Unix time at which the watcher saw the notice."""
    deadline: float
    """Unix time by which the node is expected to be gone (never before ``noticed_at``)."""
    event_id: str | None = None
    """The platform's id for the event, where it has one (Azure's EventId, needed to acknowledge it)."""
    detail: str = ""

    def time_left(self, now: float | None = None) -> float:
        """Seconds until the deadline, never negative."""
        return max(0.0, self.deadline - (time.time() if now is None else now))

    def log_fields(self, now: float | None = None) -> dict[str, object]:
        """The fields of the lifecycle line logged for this notice."""
        return {
            "source": self.source,
            "kind": self.kind,
            "event_id": self.event_id,
            "notice_time": iso_utc(self.noticed_at),
            "deadline": iso_utc(self.deadline),
            "time_left_s": round(self.time_left(now), 3),
        }


def iso_utc(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def notice_with_deadline(
    source: str, kind: str, noticed_at: float, deadline: float | None, event_id: str | None = None, detail: str = ""
) -> Notice:
    """A notice whose deadline is clamped to ``noticed_at`` (a deadline in the past means "now")."""
    end = noticed_at if deadline is None else max(noticed_at, deadline)
    return Notice(source=source, kind=kind, noticed_at=noticed_at, deadline=end, event_id=event_id, detail=detail)


class Watcher(abc.ABC):
    """One source of preemption notices.

    ``poll`` makes one bounded check and returns a notice or ``None``; it raises
    :class:`~elastrain.errors.PreemptionWatcherError` when the source cannot be read (unreachable,
    timed out, malformed). It must never block longer than its own timeout.
    """

    name: str = "watcher"

    @abc.abstractmethod
    def poll(self) -> Notice | None: ...

    def probe(self) -> bool:
        """Whether this source exists here (one short request); used by ``--preemption-watchers auto``."""
        return False

    def acknowledge(self, notice: Notice) -> None:  # noqa: B027 - optional hook, a no-op for most sources
        """Tell the platform we are ready (Azure's StartRequests); called after the node has left."""
