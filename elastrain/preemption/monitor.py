"""Watch every configured notice source in daemon threads and act on the first notice.

``--preemption-watchers`` chooses the sources: ``none`` (the default), ``auto`` (probe each cloud's
metadata endpoint once, with a short timeout, and watch the ones that answer), or a comma-separated
list such as ``azure,aws,gcp``. Probing and polling run in daemon threads with bounded timeouts, so a
missing or slow metadata service never delays or hangs the agent.

On the first notice the monitor logs one ``preemption_notice`` line (the notice time, the deadline and
the seconds left) and calls ``on_notice``: the agent's ``request_leave``, which checkpoints, leaves the
rendezvous and stops the node's workers. Once that returns, the notice is acknowledged where the
platform supports it (Azure's StartRequests), which lets the platform proceed early.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from elastrain.errors import PreemptionWatcherError, UsageError
from elastrain.log import lifecycle
from elastrain.preemption.aws import AwsSpotInstanceAction
from elastrain.preemption.azure import AzureScheduledEvents
from elastrain.preemption.gcp import GcpPreempted
from elastrain.preemption.notice import Notice, Watcher

CLOUD_WATCHERS = ("azure", "aws", "gcp")
FLAG = "--preemption-watchers"
GCP_LONG_POLL_S = 10
# A failing source is logged on its first failure, then once every this many polls.
_ERROR_LOG_EVERY = 60


def parse_watchers(spec: str | None) -> tuple[str, ...]:
    """``none`` → (), ``auto`` → ("auto",), ``azure,gcp`` → ("azure", "gcp"); anything else is a UsageError."""
    text = (spec or "none").strip().lower()
    if text in ("", "none", "off", "false", "0"):
        return ()
    if text == "auto":
        return ("auto",)
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in CLOUD_WATCHERS]
    if unknown or not names:
        raise UsageError(
            FLAG,
            f"unknown watcher {', '.join(unknown) or spec!r}; use none, auto, or a list of {','.join(CLOUD_WATCHERS)}",
        )
    return names


def build_watchers(names: Sequence[str], endpoint: str | None = None, timeout_s: float = 1.0) -> list[Watcher]:
    """Watchers by name; ``auto`` means all cloud watchers (to be probed by the monitor)."""
    wanted = CLOUD_WATCHERS if tuple(names) == ("auto",) else tuple(names)
    factories: dict[str, Callable[[], Watcher]] = {
        "azure": lambda: AzureScheduledEvents(endpoint, timeout_s=max(timeout_s, 2.0)),
        "aws": lambda: AwsSpotInstanceAction(endpoint, timeout_s=timeout_s),
        # GCP holds a wait_for_change request until the value flips: the notice arrives at once.
        "gcp": lambda: GcpPreempted(endpoint, timeout_s=timeout_s, long_poll_s=GCP_LONG_POLL_S),
    }
    return [factories[n]() for n in wanted]


def detect(watchers: Sequence[Watcher], timeout_s: float = 3.0) -> list[Watcher]:
    """The watchers whose source answers here; all probes run at once and the whole call is bounded."""
    found: dict[int, bool] = {}

    def _probe(i: int, w: Watcher) -> None:
        try:
            found[i] = w.probe()
        except Exception as exc:  # a probe must never take the agent down; a probe's answer is True or False
            lifecycle("preemption_probe_failed", level=logging.WARNING, watcher=w.name, error=repr(exc)[:200])
            found[i] = False

    threads = [threading.Thread(target=_probe, args=(i, w), daemon=True) for i, w in enumerate(watchers)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [w for i, w in enumerate(watchers) if found.get(i)]


class PreemptionMonitor:
    """Polls its watchers, one daemon thread each, and handles the first notice exactly once."""

    def __init__(
        self,
        watchers: Sequence[Watcher],
        on_notice: Callable[[Notice], None],
        interval_s: float = 1.0,
        auto_detect: bool = False,
        acknowledge: bool = True,
    ) -> None:
        self.watchers = list(watchers)
        self.on_notice = on_notice
        self.interval_s = interval_s
        self.auto_detect = auto_detect
        self.acknowledge = acknowledge
        self._stop = threading.Event()
        self._fired = threading.Event()
        self._handled = threading.Event()
        self._lock = threading.Lock()
        self._notice: Notice | None = None
        self._threads: list[threading.Thread] = []

    @property
    def notice(self) -> Notice | None:
        return self._notice

    def start(self) -> PreemptionMonitor:
        starter = threading.Thread(target=self._start_watchers, name="elastrain-preemption", daemon=True)
        self._threads.append(starter)
        starter.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def wait(self, timeout_s: float) -> Notice | None:
        """Block until a notice has been handled (``on_notice`` returned) or the timeout passes."""
        self._handled.wait(timeout_s)
        return self._notice

    def _start_watchers(self) -> None:
        watchers = detect(self.watchers) if self.auto_detect else self.watchers
        names = ",".join(w.name for w in watchers) or "none"
        lifecycle("preemption_watchers_started", watchers=names, detected=self.auto_detect or None)
        for w in watchers:
            if self._stop.is_set():
                return
            t = threading.Thread(target=self._watch, args=(w,), name=f"elastrain-preemption-{w.name}", daemon=True)
            self._threads.append(t)
            t.start()

    def _watch(self, watcher: Watcher) -> None:
        failures = 0
        while not self._stop.is_set() and not self._fired.is_set():
            try:
                notice = watcher.poll()
            except PreemptionWatcherError as exc:
                if failures % _ERROR_LOG_EVERY == 0:
                    lifecycle(
                        "preemption_watcher_error",
                        level=logging.WARNING,
                        watcher=watcher.name,
                        failures=failures + 1,
                        error=str(exc),
                    )
                failures += 1
                notice = None
            else:
                if failures:
                    lifecycle("preemption_watcher_recovered", watcher=watcher.name, failures=failures)
                failures = 0
            if notice is not None:
                self._fire(watcher, notice)
                return
            self._stop.wait(self.interval_s)

    def _fire(self, watcher: Watcher, notice: Notice) -> None:
        with self._lock:
            if self._fired.is_set():
                return
            self._notice = notice
            self._fired.set()
        lifecycle("preemption_notice", level=logging.WARNING, **notice.log_fields())
        try:
            self.on_notice(notice)
        except Exception as exc:  # the watcher thread must not die silently
            lifecycle("preemption_leave_failed", level=logging.ERROR, source=notice.source, error=repr(exc))
        finally:
            self._handled.set()
        if self.acknowledge:
            try:
                watcher.acknowledge(notice)
            except PreemptionWatcherError as exc:
                lifecycle("preemption_ack_failed", level=logging.WARNING, source=notice.source, error=str(exc))


def start_monitor(
    spec: str | None,
    request_leave: Callable[[str, float], None],
    endpoint: str | None = None,
    interval_s: float = 1.0,
) -> PreemptionMonitor | None:
    """Start watching as ``--preemption-watchers`` says; ``None`` when it says ``none``.

    ``request_leave(reason, deadline_s)`` is called once, from a daemon thread, with the seconds left.
    """
    names = parse_watchers(spec)
    if not names:
        return None

    def _leave(notice: Notice) -> None:
        request_leave(f"preemption:{notice.source}:{notice.kind}", notice.time_left())

    monitor = PreemptionMonitor(
        build_watchers(names, endpoint), on_notice=_leave, interval_s=interval_s, auto_detect=names == ("auto",)
    )
    return monitor.start()
