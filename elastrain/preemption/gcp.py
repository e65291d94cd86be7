"""GCP Spot and preemptible VMs: the ``instance/preempted`` metadata value.

Documented protocol:

- ``GET /computeMetadata/v1/instance/preempted`` with header ``Metadata-Flavor: Google`` answers
  ``TRUE`` or ``FALSE``; the server's replies carry ``Metadata-Flavor: Google`` and an ``ETag``.
- ``?wait_for_change=true&last_etag=<etag>&timeout_sec=<n>`` holds the request until the value
  changes (or ``n`` seconds pass), so a watcher sees the change at once without polling fast.
- A preempted VM gets an ACPI soft-off about 30 seconds after the notice; then it stops.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Callable

from elastrain.errors import PreemptionWatcherError
from elastrain.preemption.metadata_http import base_url, request
from elastrain.preemption.notice import Notice, Watcher, notice_with_deadline

PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
HEADERS = {"Metadata-Flavor": "Google"}
NOTICE_S = 30.0


def parse_preempted(body: str) -> bool:
    value = body.strip().upper()
    if value not in ("TRUE", "FALSE"):
        raise PreemptionWatcherError(f"GCP instance/preempted: expected TRUE or FALSE, got {body[:80]!r}")
    return value == "TRUE"


class GcpPreempted(Watcher):
    name = "gcp"

    def __init__(
        self,
        endpoint: str | None = None,
        timeout_s: float = 1.0,
        long_poll_s: int = 0,
        notice_s: float = NOTICE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``long_poll_s > 0`` uses ``wait_for_change`` (each request is held up to that many seconds)."""
        self.base = base_url(endpoint)
        self.timeout_s = timeout_s
        self.long_poll_s = int(long_poll_s)
        self.notice_s = notice_s
        self.clock = clock
        self._etag: str | None = None

    def _url(self) -> str:
        url = self.base + PREEMPTED_PATH
        if self.long_poll_s > 0 and self._etag is not None:
            query = {"wait_for_change": "true", "last_etag": self._etag, "timeout_sec": str(self.long_poll_s)}
            url += "?" + urllib.parse.urlencode(query)
        return url

    def poll(self) -> Notice | None:
        url = self._url()
        held = self.long_poll_s if "wait_for_change" in url else 0
        resp = request(url, headers=HEADERS, timeout_s=self.timeout_s + held)
        if resp.status != 200:
            raise PreemptionWatcherError(f"GET {url}: HTTP {resp.status}")
        preempted = parse_preempted(resp.body)
        self._etag = resp.headers.get("etag", self._etag)
        if not preempted:
            return None
        now = self.clock()
        return notice_with_deadline(source="gcp", kind="preempted", noticed_at=now, deadline=now + self.notice_s)

    def probe(self) -> bool:
        try:
            resp = request(self.base + PREEMPTED_PATH, headers=HEADERS, timeout_s=self.timeout_s)
        except PreemptionWatcherError:
            return False
        return resp.status == 200 and resp.headers.get("metadata-flavor", "").lower() == "google"
