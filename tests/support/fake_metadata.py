"""A fake cloud instance-metadata server on 127.0.0.1 for the preemption watchers' tests.

One HTTP server serves the three documented APIs (Azure Scheduled Events, AWS IMDSv2
spot/instance-action, GCP instance/preempted) from mutable state that a test changes while it runs,
and records every request. ``mode`` per cloud makes it misbehave: ``ok``, ``malformed`` (a reply the
watcher cannot parse), ``error`` (HTTP 500) or ``hang`` (no reply until ``hang_s`` passes).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class MetadataState:
    # Azure
    azure_mode: str = "ok"
    azure_events: list[dict[str, Any]] = field(default_factory=list)
    azure_incarnation: int = 1
    azure_acks: list[str] = field(default_factory=list)
    vm_name: str | None = "node-0"
    # AWS
    aws_mode: str = "ok"
    aws_action: dict[str, str] | None = None
    aws_tokens: set[str] = field(default_factory=set)
    # GCP
    gcp_mode: str = "ok"
    gcp_preempted: bool = False
    # All
    hang_s: float = 5.0
    requests: list[tuple[str, str]] = field(default_factory=list)


def azure_preempt_event(
    not_before: float, event_id: str | None = None, resources: list[str] | None = None
) -> dict[str, Any]:
    """A Scheduled Events ``Preempt`` entry as Azure documents it (NotBefore in RFC 1123)."""
    return {
        "EventId": event_id or str(uuid.uuid4()).upper(),
        "EventType": "Preempt",
        "ResourceType": "VirtualMachine",
        "Resources": resources if resources is not None else ["node-0"],
        "EventStatus": "Scheduled",
        "NotBefore": formatdate(not_before, usegmt=True),
        "Description": "Spot eviction",
        "EventSource": "Platform",
        "DurationInSeconds": -1,
    }


def aws_action(action: str, at: float) -> dict[str, str]:
    return {"action": action, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))}


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        pass

    def _send(self, status: int, body: str = "", headers: dict[str, str] | None = None) -> None:
        data = body.encode()
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _misbehave(self, mode: str, malformed: str) -> bool:
        if mode == "hang":
            self.server.stopping.wait(self.server.state.hang_s)
            self._send(200, malformed)
            return True
        if mode == "error":
            self._send(500, "internal error")
            return True
        if mode == "malformed":
            self._send(200, malformed)
            return True
        return False

    def _route(self, method: str) -> None:
        st = self.server.state
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        st.requests.append((method, self.path))
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode() if length else ""

        if url.path == "/metadata/scheduledevents":
            if self.headers.get("Metadata") != "true" or query.get("api-version") is None:
                return self._send(400, '{"error": "Bad request. Required metadata header not specified"}')
            if self._misbehave(st.azure_mode, "{'Events': nope"):
                return None
            if method == "POST":
                for req in json.loads(body).get("StartRequests", []):
                    st.azure_acks.append(req["EventId"])
                return self._send(200, "")
            doc = {"DocumentIncarnation": st.azure_incarnation, "Events": st.azure_events}
            return self._send(200, json.dumps(doc), {"Content-Type": "application/json"})
        if url.path == "/metadata/instance/compute/name":
            if self.headers.get("Metadata") != "true" or st.vm_name is None:
                return self._send(404, "")
            return self._send(200, st.vm_name)

        if url.path == "/latest/api/token":
            if method != "PUT" or not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                return self._send(400, "")
            if st.aws_mode == "hang":
                self.server.stopping.wait(st.hang_s)
            token = uuid.uuid4().hex
            st.aws_tokens.add(token)
            return self._send(200, token)
        if url.path == "/latest/meta-data/spot/instance-action":
            if self.headers.get("X-aws-ec2-metadata-token") not in st.aws_tokens:
                return self._send(401, "")
            if self._misbehave(st.aws_mode, '{"action": "explode"}'):
                return None
            if st.aws_action is None:
                return self._send(404, "<html>404 - Not Found</html>")
            return self._send(200, json.dumps(st.aws_action))

        if url.path == "/computeMetadata/v1/instance/preempted":
            if self.headers.get("Metadata-Flavor") != "Google":
                return self._send(403, "Missing Metadata-Flavor:Google header.")
            if self._misbehave(st.gcp_mode, "MAYBE"):
                return None
            if query.get("wait_for_change") == "true":
                etag = query.get("last_etag")
                deadline = time.monotonic() + float(query.get("timeout_sec", "60"))
                while self._gcp_etag() == etag and time.monotonic() < deadline:
                    if self.server.stopping.wait(0.02):
                        break
            value = "TRUE" if st.gcp_preempted else "FALSE"
            return self._send(200, value, {"Metadata-Flavor": "Google", "ETag": self._gcp_etag()})

        return self._send(404, "not found")

    def _gcp_etag(self) -> str:
        return "etag-true" if self.server.state.gcp_preempted else "etag-false"

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PUT(self) -> None:
        self._route("PUT")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, state: MetadataState) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.state = state
        self.stopping = threading.Event()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A watcher that timed out closes its socket before a "hang" reply: expected, not an error.
        pass


@dataclass
class FakeMetadata:
    state: MetadataState
    endpoint: str


@contextmanager
def fake_metadata_server(state: MetadataState | None = None) -> Iterator[FakeMetadata]:
    st = state or MetadataState()
    server = _Server(st)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield FakeMetadata(st, f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.stopping.set()
        server.shutdown()
        server.server_close()
        thread.join(5)
