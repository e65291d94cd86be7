"""AWS EC2 Spot interruption notices through the instance metadata service, IMDSv2.

Documented protocol:

- ``PUT /latest/api/token`` with header ``X-aws-ec2-metadata-token-ttl-seconds: <1..21600>`` answers
  a session token; every later request carries it in ``X-aws-ec2-metadata-token`` (401 once it expired).
- ``GET /latest/meta-data/spot/instance-action`` answers 404 while there is no notice, then
  ``{"action": "terminate" | "stop" | "hibernate", "time": "2017-09-18T08:22:00Z"}`` about two minutes
  before the action (hibernation starts at once). AWS suggests polling every 5 seconds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime, timezone

from elastrain.errors import PreemptionWatcherError
from elastrain.preemption.metadata_http import base_url, request
from elastrain.preemption.notice import Notice, Watcher, notice_with_deadline

TOKEN_PATH = "/latest/api/token"
ACTION_PATH = "/latest/meta-data/spot/instance-action"
TOKEN_TTL_S = 21600
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
ACTIONS = frozenset({"terminate", "stop", "hibernate"})


def parse_aws_time(text: str) -> float:
    try:
        dt = datetime.strptime(text.strip(), "%Y-%m-%dT%H:%M:%SZ")
    except ValueError as exc:
        raise PreemptionWatcherError(f"AWS instance-action: time {text!r} is not YYYY-MM-DDTHH:MM:SSZ") from exc
    return dt.replace(tzinfo=timezone.utc).timestamp()


def parse_instance_action(body: str, now: float) -> Notice:
    """The notice in a ``spot/instance-action`` document."""
    try:
        doc = json.loads(body)
    except json.JSONDecodeError as exc:
        raise PreemptionWatcherError(f"AWS instance-action: reply is not JSON: {body[:80]!r}") from exc
    if not isinstance(doc, dict) or doc.get("action") not in ACTIONS or not isinstance(doc.get("time"), str):
        raise PreemptionWatcherError(
            f"AWS instance-action: expected {{'action': one of {sorted(ACTIONS)}, 'time': ...}}, got {body[:80]!r}"
        )
    action = str(doc["action"])
    deadline = now if action == "hibernate" else parse_aws_time(doc["time"])
    return notice_with_deadline(source="aws", kind=action, noticed_at=now, deadline=deadline)


class AwsSpotInstanceAction(Watcher):
    name = "aws"

    def __init__(
        self, endpoint: str | None = None, timeout_s: float = 1.0, clock: Callable[[], float] = time.time
    ) -> None:
        self.base = base_url(endpoint)
        self.timeout_s = timeout_s
        self.clock = clock
        self._token: str | None = None
        self._token_expires = 0.0

    def _fetch_token(self) -> str:
        resp = request(
            self.base + TOKEN_PATH,
            method="PUT",
            headers={TOKEN_TTL_HEADER: str(TOKEN_TTL_S)},
            timeout_s=self.timeout_s,
        )
        token = resp.body.strip()
        if resp.status != 200 or not token or len(token) > 4096:
            raise PreemptionWatcherError(f"PUT {self.base}{TOKEN_PATH}: HTTP {resp.status}, no IMDSv2 token")
        self._token = token
        # Renew well before it expires.
        self._token_expires = time.monotonic() + TOKEN_TTL_S / 2
        return token

    def _token_now(self) -> str:
        if self._token is None or time.monotonic() >= self._token_expires:
            return self._fetch_token()
        return self._token

    def poll(self) -> Notice | None:
        url = self.base + ACTION_PATH
        for attempt in range(2):
            resp = request(url, headers={TOKEN_HEADER: self._token_now()}, timeout_s=self.timeout_s)
            if resp.status == 401 and attempt == 0:
                self._token = None  # expired or revoked: fetch a new one and retry once
                continue
            if resp.status == 404:
                return None
            if resp.status != 200:
                raise PreemptionWatcherError(f"GET {url}: HTTP {resp.status}")
            return parse_instance_action(resp.body, self.clock())
        raise PreemptionWatcherError(f"GET {url}: HTTP 401 with a fresh IMDSv2 token")

    def probe(self) -> bool:
        try:
            self._fetch_token()
            return True
        except PreemptionWatcherError:
            return False
