"""Each watcher against a local metadata server on 127.0.0.1 serving the documented replies."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
from support.fake_metadata import FakeMetadata, aws_action, azure_preempt_event, fake_metadata_server
from support.processes import free_port

from elastrain.errors import PreemptionWatcherError
from elastrain.preemption import (
    AwsSpotInstanceAction,
    AzureScheduledEvents,
    GcpPreempted,
    Notice,
    PreemptionMonitor,
    build_watchers,
    detect,
    start_monitor,
)

# Short timeouts keep the hang cases fast; the fake server holds a "hang" for 5 s.
T = 0.3


@pytest.fixture
def meta() -> Iterator[FakeMetadata]:
    with fake_metadata_server() as m:
        yield m


# -- Azure ---------------------------------------------------------------------------------------


def test_azure_no_event_then_preempt_then_acknowledge(meta: FakeMetadata) -> None:
    w = AzureScheduledEvents(meta.endpoint, timeout_s=T)
    assert w.poll() is None
    meta.state.azure_events = [azure_preempt_event(time.time() + 30, event_id="EV-1")]
    notice = w.poll()
    assert notice is not None and (notice.source, notice.kind, notice.event_id) == ("azure", "Preempt", "EV-1")
    assert 25 < notice.time_left() <= 31
    w.acknowledge(notice)
    assert meta.state.azure_acks == ["EV-1"]
    assert ("GET", "/metadata/scheduledevents?api-version=2020-07-01") in meta.state.requests


def test_azure_ignores_events_for_other_vms(meta: FakeMetadata) -> None:
    meta.state.azure_events = [azure_preempt_event(time.time() + 30, resources=["node-9"])]
    assert AzureScheduledEvents(meta.endpoint, timeout_s=T).poll() is None
    meta.state.azure_events.append(azure_preempt_event(time.time() + 30, resources=["node-0"]))
    assert AzureScheduledEvents(meta.endpoint, timeout_s=T).poll() is not None


@pytest.mark.parametrize("mode", ["malformed", "error", "hang"])
def test_azure_bad_replies_raise_within_the_timeout(meta: FakeMetadata, mode: str) -> None:
    w = AzureScheduledEvents(meta.endpoint, timeout_s=T, vm_name="node-0")
    meta.state.azure_mode = mode
    start = time.monotonic()
    with pytest.raises(PreemptionWatcherError):
        w.poll()
    assert time.monotonic() - start < 3  # bounded by the timeout, not by the server's 5 s hang


# -- AWS -----------------------------------------------------------------------------------------


def test_aws_404_is_no_notice_then_instance_action(meta: FakeMetadata) -> None:
    w = AwsSpotInstanceAction(meta.endpoint, timeout_s=T)
    assert w.poll() is None
    assert w.poll() is None
    assert sum(1 for m, p in meta.state.requests if p == "/latest/api/token") == 1  # the token is reused
    meta.state.aws_action = aws_action("terminate", time.time() + 120)
    notice = w.poll()
    assert notice is not None and (notice.source, notice.kind) == ("aws", "terminate")
    assert 110 < notice.time_left() <= 121


def test_aws_fetches_a_new_token_when_the_old_one_is_rejected(meta: FakeMetadata) -> None:
    w = AwsSpotInstanceAction(meta.endpoint, timeout_s=T)
    assert w.poll() is None
    meta.state.aws_tokens.clear()  # the token expired
    meta.state.aws_action = aws_action("stop", time.time() + 120)
    assert w.poll() is not None
    assert sum(1 for m, p in meta.state.requests if p == "/latest/api/token") == 2


@pytest.mark.parametrize("mode", ["malformed", "error", "hang"])
def test_aws_bad_replies_raise_within_the_timeout(meta: FakeMetadata, mode: str) -> None:
    meta.state.aws_mode = mode
    meta.state.aws_action = aws_action("terminate", time.time() + 120)
    start = time.monotonic()
    with pytest.raises(PreemptionWatcherError):
        AwsSpotInstanceAction(meta.endpoint, timeout_s=T).poll()
    assert time.monotonic() - start < 3


# -- GCP -----------------------------------------------------------------------------------------


def test_gcp_false_then_true(meta: FakeMetadata) -> None:
    w = GcpPreempted(meta.endpoint, timeout_s=T)
    assert w.poll() is None
    meta.state.gcp_preempted = True
    notice = w.poll()
    assert notice is not None and (notice.source, notice.kind) == ("gcp", "preempted")
    assert notice.deadline - notice.noticed_at == 30


def test_gcp_wait_for_change_returns_as_soon_as_the_value_changes(meta: FakeMetadata) -> None:
    w = GcpPreempted(meta.endpoint, timeout_s=T, long_poll_s=10)
    assert w.poll() is None  # the first, plain request learns the ETag
    threading.Timer(0.3, lambda: setattr(meta.state, "gcp_preempted", True)).start()
    start = time.monotonic()
    notice = w.poll()  # held by the server until the value changes
    assert notice is not None
    assert time.monotonic() - start < 5
    assert any("wait_for_change=true" in p and "last_etag=etag-false" in p for _, p in meta.state.requests)


@pytest.mark.parametrize("mode", ["malformed", "error", "hang"])
def test_gcp_bad_replies_raise_within_the_timeout(meta: FakeMetadata, mode: str) -> None:
    meta.state.gcp_mode = mode
    start = time.monotonic()
    with pytest.raises(PreemptionWatcherError):
        GcpPreempted(meta.endpoint, timeout_s=T).poll()
    assert time.monotonic() - start < 3


# -- detection and unreachable endpoints ---------------------------------------------------------


def test_detect_finds_every_cloud_the_server_answers_for(meta: FakeMetadata) -> None:
    found = detect(build_watchers(("auto",), meta.endpoint, timeout_s=T))
    assert sorted(w.name for w in found) == ["aws", "azure", "gcp"]


def test_nothing_listening_is_an_error_and_detects_nothing() -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    for w in build_watchers(("azure", "aws", "gcp"), endpoint, timeout_s=T):
        with pytest.raises(PreemptionWatcherError, match=r"127\.0\.0\.1"):
            w.poll()
    start = time.monotonic()
    assert detect(build_watchers(("auto",), endpoint, timeout_s=T)) == []
    assert time.monotonic() - start < 5


# -- the monitor ---------------------------------------------------------------------------------


class _Leaves:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    def __call__(self, reason: str, deadline_s: float) -> None:
        self.calls.append((reason, deadline_s))


def test_monitor_calls_request_leave_once_logs_and_acknowledges(meta: FakeMetadata) -> None:
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("elastrain").addHandler(handler)
    leaves = _Leaves()
    try:
        monitor = start_monitor("azure,aws", leaves, endpoint=meta.endpoint, interval_s=0.05)
        assert monitor is not None
        time.sleep(0.3)
        assert leaves.calls == []
        meta.state.azure_events = [azure_preempt_event(time.time() + 30, event_id="EV-2")]
        meta.state.aws_action = aws_action("terminate", time.time() + 120)
        notice = monitor.wait(10)
        time.sleep(0.3)
        monitor.stop()
    finally:
        logging.getLogger("elastrain").removeHandler(handler)
    assert notice is not None
    assert len(leaves.calls) == 1  # two sources noticed, one leave
    reason, deadline_s = leaves.calls[0]
    assert reason.startswith("preemption:")
    assert 0 < deadline_s <= 121
    if notice.source == "azure":
        assert meta.state.azure_acks == ["EV-2"]
    notice_lines = [line for line in lines if "event=preemption_notice" in line]
    assert len(notice_lines) == 1
    assert "notice_time=" in notice_lines[0] and "time_left_s=" in notice_lines[0]


def test_monitor_survives_a_hanging_source_and_fires_from_another(meta: FakeMetadata) -> None:
    meta.state.azure_mode = "hang"
    got: list[Notice] = []
    monitor = PreemptionMonitor(
        [AzureScheduledEvents(meta.endpoint, timeout_s=T, vm_name="node-0"), GcpPreempted(meta.endpoint, timeout_s=T)],
        on_notice=got.append,
        interval_s=0.05,
    ).start()
    meta.state.gcp_preempted = True
    assert monitor.wait(10) is not None
    monitor.stop()
    assert [n.source for n in got] == ["gcp"]


def test_monitor_auto_with_nothing_there_starts_no_watcher() -> None:
    monitor = start_monitor("auto", _Leaves(), endpoint=f"http://127.0.0.1:{free_port()}", interval_s=0.05)
    assert monitor is not None
    assert monitor.wait(1.0) is None
    monitor.stop()


def test_monitor_sees_a_gcp_preemption_through_the_long_poll(meta: FakeMetadata) -> None:
    leaves = _Leaves()
    monitor = start_monitor("gcp", leaves, endpoint=meta.endpoint, interval_s=0.05)
    assert monitor is not None
    time.sleep(0.5)  # the watcher is now held in wait_for_change
    meta.state.gcp_preempted = True
    notice = monitor.wait(8)
    monitor.stop()
    assert notice is not None and notice.source == "gcp"
    assert leaves.calls and leaves.calls[0][0] == "preemption:gcp:preempted"
    assert any("wait_for_change=true" in p for _, p in meta.state.requests)
