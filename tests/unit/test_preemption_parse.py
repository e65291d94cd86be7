"""The documented notice formats, parsed as data (no network)."""

from __future__ import annotations

import json
import signal
from email.utils import formatdate

import pytest

from elastrain.errors import PreemptionWatcherError, UsageError
from elastrain.preemption.aws import parse_instance_action
from elastrain.preemption.azure import parse_not_before, parse_scheduled_events
from elastrain.preemption.gcp import parse_preempted
from elastrain.preemption.monitor import parse_watchers, start_monitor
from elastrain.preemption.notice import Notice, iso_utc
from elastrain.preemption.sigterm import SigtermWatcher

NOW = 1_700_000_000.0


def _event(kind: str = "Preempt", not_before: float | None = NOW + 30, **extra: object) -> dict[str, object]:
    ev: dict[str, object] = {
        "EventId": "602d9444-d2cd-49c7-8624-8643e7171297",
        "EventType": kind,
        "ResourceType": "VirtualMachine",
        "Resources": ["node-0"],
        "EventStatus": "Scheduled",
        "NotBefore": formatdate(not_before, usegmt=True) if not_before is not None else "",
        "Description": "",
        "EventSource": "Platform",
        "DurationInSeconds": -1,
    }
    ev.update(extra)
    return ev


def _doc(*events: dict[str, object]) -> str:
    return json.dumps({"DocumentIncarnation": 2, "Events": list(events)})


def test_azure_no_events_is_no_notice() -> None:
    assert parse_scheduled_events(_doc(), NOW) is None


def test_azure_preempt_gives_not_before_as_deadline() -> None:
    notice = parse_scheduled_events(_doc(_event()), NOW, vm_name="node-0")
    assert notice is not None
    assert (notice.source, notice.kind, notice.event_id) == ("azure", "Preempt", "602d9444-d2cd-49c7-8624-8643e7171297")
    assert notice.noticed_at == NOW
    assert notice.time_left(NOW) == pytest.approx(30, abs=1)


@pytest.mark.parametrize("kind", ["Terminate", "Reboot", "Redeploy"])
def test_azure_other_leave_events_count(kind: str) -> None:
    notice = parse_scheduled_events(_doc(_event(kind)), NOW)
    assert notice is not None and notice.kind == kind


def test_azure_freeze_is_not_a_leave() -> None:
    assert parse_scheduled_events(_doc(_event("Freeze")), NOW) is None


def test_azure_started_event_means_now() -> None:
    notice = parse_scheduled_events(_doc(_event(EventStatus="Started", NotBefore="")), NOW)
    assert notice is not None and notice.deadline == NOW and notice.time_left(NOW) == 0


def test_azure_event_for_another_vm_is_ignored_when_our_name_is_known() -> None:
    doc = _doc(_event(Resources=["node-7"]))
    assert parse_scheduled_events(doc, NOW, vm_name="node-0") is None
    assert parse_scheduled_events(doc, NOW, vm_name=None) is not None


def test_azure_most_urgent_event_wins() -> None:
    doc = _doc(_event("Reboot", NOW + 600, EventId="late"), _event("Preempt", NOW + 30, EventId="soon"))
    notice = parse_scheduled_events(doc, NOW)
    assert notice is not None and notice.event_id == "soon"


def test_azure_past_not_before_is_clamped_to_now() -> None:
    notice = parse_scheduled_events(_doc(_event(not_before=NOW - 100)), NOW)
    assert notice is not None and notice.deadline == NOW


@pytest.mark.parametrize(
    "body",
    ["not json", "[]", '{"DocumentIncarnation": 1}', '{"Events": [{"EventId": "x"}]}', '{"Events": "none"}'],
)
def test_azure_malformed_documents_raise(body: str) -> None:
    with pytest.raises(PreemptionWatcherError, match="Azure"):
        parse_scheduled_events(body, NOW)


def test_azure_not_before_formats() -> None:
    assert parse_not_before("Mon, 19 Sep 2016 18:29:47 GMT") == 1474309787.0
    assert parse_not_before("") is None
    with pytest.raises(PreemptionWatcherError, match="RFC 1123"):
        parse_not_before("tomorrow")


def test_aws_terminate_deadline_is_the_action_time() -> None:
    body = json.dumps({"action": "terminate", "time": "2023-11-14T22:15:20Z"})
    notice = parse_instance_action(body, NOW)
    assert (notice.source, notice.kind) == ("aws", "terminate")
    assert notice.deadline == NOW + 120  # NOW is 2023-11-14T22:13:20Z
    assert notice.time_left(NOW) == 120


def test_aws_hibernate_starts_at_once() -> None:
    notice = parse_instance_action(json.dumps({"action": "hibernate", "time": "2030-01-01T00:00:00Z"}), NOW)
    assert notice.deadline == NOW


@pytest.mark.parametrize(
    "body",
    [
        "<html>",
        '{"action": "explode", "time": "2023-11-14T22:15:20Z"}',
        '{"action": "stop"}',
        '{"action": "stop", "time": "soon"}',
    ],
)
def test_aws_malformed_replies_raise(body: str) -> None:
    with pytest.raises(PreemptionWatcherError, match="AWS"):
        parse_instance_action(body, NOW)


@pytest.mark.parametrize(("body", "expected"), [("TRUE", True), ("FALSE", False), ("TRUE\n", True), (" false ", False)])
def test_gcp_preempted_values(body: str, expected: bool) -> None:
    assert parse_preempted(body) is expected


@pytest.mark.parametrize("body", ["", "MAYBE", "{}"])
def test_gcp_malformed_raises(body: str) -> None:
    with pytest.raises(PreemptionWatcherError, match="GCP"):
        parse_preempted(body)


def test_notice_log_fields_have_notice_time_and_time_left() -> None:
    notice = Notice(source="gcp", kind="preempted", noticed_at=NOW, deadline=NOW + 30)
    fields = notice.log_fields(now=NOW + 10)
    assert fields["notice_time"] == iso_utc(NOW) == "2023-11-14T22:13:20.000Z"
    assert fields["time_left_s"] == 20
    assert notice.time_left(NOW + 100) == 0


def test_sigterm_watcher_records_the_first_signal_with_the_grace_period() -> None:
    clock = iter([NOW, NOW + 5])
    watcher = SigtermWatcher(grace_s=30, clock=lambda: next(clock))
    assert watcher.poll() is None
    first = watcher.notify(signal.SIGTERM)
    assert watcher.notify(signal.SIGTERM) is first
    assert watcher.poll() == first
    assert (first.kind, first.deadline) == ("SIGTERM", NOW + 30)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [(None, ()), ("none", ()), ("", ()), ("auto", ("auto",)), ("azure", ("azure",)), ("aws, gcp,aws", ("aws", "gcp"))],
)
def test_parse_watchers(spec: str | None, expected: tuple[str, ...]) -> None:
    assert parse_watchers(spec) == expected


@pytest.mark.parametrize("spec", ["azure,oracle", ",", "auto,aws"])
def test_parse_watchers_rejects_unknown_names(spec: str) -> None:
    with pytest.raises(UsageError, match="--preemption-watchers"):
        parse_watchers(spec)


def test_launcher_options_read_flags_and_pet_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    from elastrain.launcher.options import ElastrainOptions, build_parser, options_from_args

    args = build_parser().parse_args(
        ["--preemption-watchers", "aws,gcp", "--metadata-endpoint", "127.0.0.1:8080", "t.py"]
    )
    opts = options_from_args(args)
    assert (opts.preemption_watchers, opts.metadata_endpoint) == ("aws,gcp", "127.0.0.1:8080")
    monkeypatch.setenv("PET_PREEMPTION_WATCHERS", "auto")
    monkeypatch.setenv("PET_METADATA_ENDPOINT", "http://127.0.0.1:9")
    opts = options_from_args(build_parser().parse_args(["t.py"]))
    assert (opts.preemption_watchers, opts.metadata_endpoint) == ("auto", "http://127.0.0.1:9")
    monkeypatch.delenv("PET_PREEMPTION_WATCHERS")
    assert options_from_args(build_parser().parse_args(["t.py"])).preemption_watchers == "none"
    with pytest.raises(UsageError, match="--preemption-watchers"):
        ElastrainOptions(preemption_watchers="azure,oracle")


def test_start_monitor_none_starts_nothing() -> None:
    assert start_monitor("none", lambda reason, deadline_s: None) is None
