"""Preemption traces: parsing, validation and the seeded random trace (pure, no processes)."""

from __future__ import annotations

import json

import pytest
import yaml

from elastrain.chaos.cli import main as chaos_main
from elastrain.chaos.trace import Action, Trace, TraceEvent, load_trace, random_trace, trace_from_dict
from elastrain.errors import TraceError

YAML_TRACE = """
nodes: 3
events:
  - {at: 20, action: kill, node: 1}
  - {at: 45, action: start, node: 1}
  - {at: 60, action: term, node: 2, notice: 10}
"""


def test_yaml_and_json_traces_read_the_same(tmp_path):
    y = tmp_path / "t.yaml"
    y.write_text(YAML_TRACE)
    j = tmp_path / "t.json"
    j.write_text(json.dumps(yaml.safe_load(YAML_TRACE)))
    a, b = load_trace(y), load_trace(j)
    assert a == b
    assert a.start == (0, 1, 2)
    assert a.events[2] == TraceEvent(60.0, Action.TERM, 2, 10.0)
    assert a.min_alive() == 2
    assert a.duration_s == 60.0


def test_events_are_sorted_by_time():
    t = trace_from_dict(
        {"nodes": 2, "events": [{"at": 9, "action": "start", "node": 1}, {"at": 3, "action": "kill", "node": 1}]}
    )
    assert [e.action for e in t.events] == [Action.KILL, Action.START]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"events": []}, "needs 'nodes'"),
        ({"nodes": 0}, "at least 1"),
        ({"nodes": 2, "events": [{"at": 1, "action": "kill", "node": 2}]}, "outside 0..1"),
        ({"nodes": 2, "events": [{"at": 1, "action": "start", "node": 1}]}, "already up"),
        ({"nodes": 2, "events": [{"at": 1, "action": "explode", "node": 1}]}, "kill, term, start"),
        ({"nodes": 2, "events": [{"at": 1, "node": 1}]}, "missing key 'action'"),
        ({"nodes": 2, "start": [0], "events": [{"at": 1, "action": "kill", "node": 1}]}, "not up"),
        ({"nodes": 2, "events": [{"at": -1, "action": "kill", "node": 1}]}, ">= 0"),
    ],
)
def test_bad_traces_name_the_problem(data, message):
    with pytest.raises(TraceError, match=message):
        trace_from_dict(data)


def test_unreadable_trace_file(tmp_path):
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.json"
    bad.write_text("{nodes: ")
    with pytest.raises(TraceError, match="not valid JSON"):
        load_trace(bad)


@pytest.mark.parametrize("seed", range(8))
def test_random_trace_is_seeded_valid_and_keeps_a_node_up(seed):
    a = random_trace(seed, nodes=3, duration_s=300, mean_up_s=40, mean_down_s=20)
    assert a == random_trace(seed, nodes=3, duration_s=300, mean_up_s=40, mean_down_s=20)
    assert a.events, "a 300 s trace with 40 s mean uptime preempts something"
    assert a.min_alive() >= 1
    assert all(e.at <= 300 for e in a.events)
    assert trace_from_dict(a.to_dict()) == a  # round trip through the file format


def test_random_trace_honours_protect_min_alive_and_notice():
    t = random_trace(3, nodes=3, duration_s=600, mean_up_s=30, mean_down_s=30, min_alive=2, protect=[0], notice_s=5)
    assert all(e.node != 0 for e in t.events)
    assert t.min_alive() >= 2
    assert {e.action for e in t.events} <= {Action.TERM, Action.START}
    assert all(e.notice_s == 5 for e in t.events if e.action is Action.TERM)
    with pytest.raises(TraceError, match="min_alive"):
        random_trace(0, nodes=2, min_alive=3)


def test_cli_prints_a_random_trace(capsys):
    assert chaos_main(["--nodes", "3", "--random-trace", "5", "--duration", "120", "--print-trace"]) == 0
    printed = trace_from_dict(yaml.safe_load(capsys.readouterr().out))
    assert printed == random_trace(5, nodes=3, duration_s=120, protect=[0])  # node 0 hosts the c10d store


def test_cli_rejects_nodes_that_disagree_with_the_trace(tmp_path, capsys):
    path = tmp_path / "t.yaml"
    path.write_text(YAML_TRACE)
    assert chaos_main(["--nodes", "2", "--trace", str(path), "--", "x.py"]) == 2
    assert "--nodes" in capsys.readouterr().err


def test_trace_defaults_to_all_nodes_up():
    assert Trace(nodes=2).start == (0, 1)
