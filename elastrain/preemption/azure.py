"""Azure Scheduled Events: ``Preempt`` (Spot VMs, low-priority nodes) and other events that take the VM away.

Documented protocol (Azure Instance Metadata Service, api-version 2020-07-01):

- ``GET /metadata/scheduledevents?api-version=2020-07-01`` with header ``Metadata: true`` answers
  ``{"DocumentIncarnation": n, "Events": [...]}``; each event has ``EventId``, ``EventType``
  (``Freeze``, ``Reboot``, ``Redeploy``, ``Preempt``, ``Terminate``), ``ResourceType``, ``Resources``
  (the VM names it affects), ``EventStatus`` (``Scheduled`` or ``Started``) and ``NotBefore`` (an
  RFC 1123 time such as ``Mon, 19 Sep 2016 18:29:47 GMT``; empty once started). ``Preempt`` gives at
  least 30 s.
- ``POST`` to the same URL with ``{"StartRequests": [{"EventId": "..."}]}`` approves an event early.
- The first request may be slow (the service is enabled on first use); later ones are fast.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from email.utils import parsedate_to_datetime

from elastrain.errors import PreemptionWatcherError
from elastrain.log import lifecycle
from elastrain.preemption.metadata_http import base_url, request
from elastrain.preemption.notice import Notice, Watcher, notice_with_deadline

API_VERSION = "2020-07-01"
EVENTS_PATH = "/metadata/scheduledevents"
VM_NAME_PATH = "/metadata/instance/compute/name"
VM_NAME_API_VERSION = "2021-02-01"
HEADERS = {"Metadata": "true"}
# Events after which this VM is gone or restarted; Freeze (a pause of a few seconds) is not one.
LEAVE_EVENT_TYPES = frozenset({"Preempt", "Terminate", "Reboot", "Redeploy"})


def parse_not_before(text: str) -> float | None:
    """Unix time of an RFC 1123 ``NotBefore``; ``None`` when empty (the event has started)."""
    if not text.strip():
        return None
    try:
        return parsedate_to_datetime(text).timestamp()
    except (TypeError, ValueError) as exc:
        raise PreemptionWatcherError(f"Azure Scheduled Events: NotBefore {text!r} is not an RFC 1123 time") from exc


def parse_scheduled_events(body: str, now: float, vm_name: str | None = None) -> Notice | None:
    """The most urgent leave event for this VM in a Scheduled Events document, or ``None``.

    Events whose ``Resources`` list other VMs only are ignored when ``vm_name`` is known (every VM of
    an availability set or scale-set placement group sees the events of the others).
    """
    try:
        doc = json.loads(body)
    except json.JSONDecodeError as exc:
        raise PreemptionWatcherError(f"Azure Scheduled Events: reply is not JSON: {body[:80]!r}") from exc
    events = doc.get("Events") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        raise PreemptionWatcherError(f"Azure Scheduled Events: reply has no Events list: {body[:80]!r}")
    best: Notice | None = None
    for event in events:
        if not isinstance(event, dict) or not isinstance(event.get("EventType"), str):
            raise PreemptionWatcherError(f"Azure Scheduled Events: malformed event {event!r}")
        if event["EventType"] not in LEAVE_EVENT_TYPES:
            continue
        resources = event.get("Resources") or []
        if vm_name and resources and vm_name not in resources:
            continue
        started = event.get("EventStatus") == "Started"
        deadline = None if started else parse_not_before(str(event.get("NotBefore") or ""))
        notice = notice_with_deadline(
            source="azure",
            kind=event["EventType"],
            noticed_at=now,
            deadline=deadline,
            event_id=str(event["EventId"]) if event.get("EventId") is not None else None,
            detail=str(event.get("Description") or ""),
        )
        if best is None or notice.deadline < best.deadline:
            best = notice
    return best


class AzureScheduledEvents(Watcher):
    name = "azure"

    def __init__(
        self,
        endpoint: str | None = None,
        timeout_s: float = 2.0,
        vm_name: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.base = base_url(endpoint)
        self.timeout_s = timeout_s
        self.clock = clock
        self._vm_name = vm_name
        self._vm_name_tried = vm_name is not None

    @property
    def events_url(self) -> str:
        return f"{self.base}{EVENTS_PATH}?api-version={API_VERSION}"

    def vm_name(self) -> str | None:
        """This VM's name from IMDS, asked once; ``None`` if IMDS does not say (then every event counts)."""
        if not self._vm_name_tried:
            self._vm_name_tried = True
            url = f"{self.base}{VM_NAME_PATH}?api-version={VM_NAME_API_VERSION}&format=text"
            try:
                resp = request(url, headers=HEADERS, timeout_s=self.timeout_s)
            except PreemptionWatcherError as exc:
                lifecycle("azure_vm_name_unknown", level=logging.WARNING, error=str(exc), action="every event counts")
                return None
            name = resp.body.strip()
            self._vm_name = name if resp.status == 200 and name and len(name) < 256 else None
        return self._vm_name

    def poll(self) -> Notice | None:
        resp = request(self.events_url, headers=HEADERS, timeout_s=self.timeout_s)
        if resp.status != 200:
            raise PreemptionWatcherError(f"GET {self.events_url}: HTTP {resp.status}")
        return parse_scheduled_events(resp.body, self.clock(), self.vm_name())

    def probe(self) -> bool:
        try:
            resp = request(self.events_url, headers=HEADERS, timeout_s=self.timeout_s)
            return resp.status == 200 and isinstance(json.loads(resp.body).get("Events"), list)
        except (PreemptionWatcherError, ValueError, AttributeError):
            return False

    def acknowledge(self, notice: Notice) -> None:
        if not notice.event_id:
            return
        payload = json.dumps({"StartRequests": [{"EventId": notice.event_id}]}).encode()
        resp = request(
            self.events_url,
            method="POST",
            headers={**HEADERS, "Content-Type": "application/json"},
            body=payload,
            timeout_s=self.timeout_s,
        )
        if resp.status not in (200, 204):
            raise PreemptionWatcherError(
                f"POST {self.events_url} (StartRequests {notice.event_id}): HTTP {resp.status}"
            )
