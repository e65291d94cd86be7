"""Preemption traces: parsing, validation and the seeded random trace (pure, no processes)."""

from __future__ import annotations

import json

import pytest
import yaml

from elastrain.chaos.churn import ChurnConfig, churn_trace, coverage
from elastrain.chaos.cli import main as chaos_main
from elastrain.chaos.trace import Action, Trace, TraceEvent, load_trace, random_trace, trace_from_dict
from elastrain.errors import TraceError

YAML_TRACE = """
nodes: 3
events:
  - {at: 20, action: kill, node: 1}
  - {at: 45, action: start, node: 1}
  - {at: 60, action: term, node: 2, notice: 10}
  - {at: 70, action: term, node: 0, whole: true}
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
    assert a.events[3] == TraceEvent(70.0, Action.TERM, 0, whole=True)
    assert trace_from_dict(a.to_dict()) == a
    assert a.min_alive() == 1
    assert a.duration_s == 70.0


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
        ({"nodes": 2, "start": [0], "events": [{"at": 1, "action": "crash", "node": 1}]}, "has workers to crash"),
        ({"nodes": 2, "events": [{"at": -1, "action": "kill", "node": 1}]}, ">= 0"),
        ({"nodes": 2, "events": [{"at": 1, "action": "kill", "node": 1, "whole": True}]}, "term events only"),
        ({"nodes": 2, "events": [{"at": 1, "action": "term", "node": 1, "whole": "yes"}]}, "true or false"),
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


CHURN_YAML = """
nodes: 5
max_nodes: 3
events:
  - {after_step: 10, gap: 2, action: stop, node: 0}
  - {gap: 4, action: kill, node: 0}
  - {after_step: 20, action: start, node: 3}
  - {after_step: 30, action: stop, node: 1}
  - {gap: 3, action: cont, node: 1}
  - {after_step: 40, action: kill_all}
  - {gap: 2, action: restart_all, nodes: [1, 2, 3]}
"""


def test_stop_cont_kill_all_restart_all_and_spares_round_trip():
    t = trace_from_dict(yaml.safe_load(CHURN_YAML))
    assert t.start == (0, 1, 2), "slots beyond max_nodes are spares, down at the start"
    assert t.launcher_max == 3 and t.nodes == 5
    assert [e.action for e in t.events] == [Action.STOP, Action.KILL, Action.START, Action.STOP, Action.CONT,
                                            Action.KILL_ALL, Action.RESTART_ALL]  # fmt: skip
    assert t.events[1] == TraceEvent(0.0, Action.KILL, 0, gap_s=4.0)
    assert t.events[-1].nodes == (1, 2, 3)
    assert trace_from_dict(t.to_dict()) == t
    assert "node" not in t.to_dict()["events"][5]
    assert t.min_alive() == 0  # between kill_all and restart_all


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([{"at": 1, "action": "cont", "node": 1}], "is up, not stopped"),
        ([{"at": 1, "action": "stop", "node": 1}, {"at": 2, "action": "term", "node": 1}], "kill a stopped node"),
        ([{"at": 1, "action": "stop", "node": 1}, {"at": 2, "action": "start", "node": 1}], "is stopped, not down"),
        ([{"at": 1, "action": "kill_all"}, {"at": 2, "action": "kill_all"}], "every node is down already"),
        ([{"at": 1, "action": "kill_all"}, {"at": 2, "action": "restart_all"}], "needs 'nodes'"),
        ([{"at": 1, "action": "restart_all", "nodes": [1]}], "lists node 1, which is up"),
        ([{"at": 1, "action": "kill_all"}, {"at": 2, "action": "restart_all", "nodes": [0, 0]}], "twice"),
        ([{"at": 1, "action": "kill_all"}, {"at": 2, "action": "restart_all", "nodes": [7]}], "outside 0..1"),
        ([{"at": 1, "gap": -1, "action": "kill", "node": 1}], "'gap' must be >= 0"),
    ],
)
def test_bad_churn_events_name_the_problem(events, message):
    with pytest.raises(TraceError, match=message):
        trace_from_dict({"nodes": 2, "events": events})


def test_max_nodes_must_fit_the_slots():
    with pytest.raises(TraceError, match="max_nodes"):
        trace_from_dict({"nodes": 2, "max_nodes": 3})


@pytest.mark.parametrize("seed", range(20))
def test_churn_trace_is_seeded_exact_and_never_strands_the_job(seed):
    cfg = ChurnConfig(events=30, max_nodes=3, spares=2, first_step=5, last_step=95)
    t = churn_trace(seed, cfg)
    assert t == churn_trace(seed, cfg) and trace_from_dict(t.to_dict()) == t
    assert len(t.events) == 30 and t.nodes == 5 and t.launcher_max == 3 and t.start == (0, 1, 2)
    milestones = [e.after_step for e in t.events if e.after_step is not None]
    assert milestones == sorted(milestones) and milestones[0] == 5 and milestones[-1] <= 95
    ups = []
    up, stopped = set(t.start), set()
    for i, e in enumerate(t.events):
        # Follow-ups wait only a gap: nothing may train while the job is down or a member is frozen.
        follow_up = i > 0 and t.events[i - 1].action in (Action.STOP, Action.KILL_ALL)
        assert (e.after_step is None) == follow_up, (i, e)
        if e.action is Action.KILL_ALL:
            up, stopped = set(), set()
        elif e.action is Action.RESTART_ALL:
            up |= set(e.nodes)
        elif e.action is Action.START or e.action is Action.CONT:
            up.add(e.node)
            stopped.discard(e.node)
        elif e.action is Action.STOP:
            up.discard(e.node)
            stopped.add(e.node)
        elif e.action is Action.CRASH:
            assert e.node in up, (i, e)  # one worker of a node that is up; the node stays up
        else:
            up.discard(e.node)
            stopped.discard(e.node)
        if e.action is not Action.KILL_ALL and not stopped:
            ups.append(len(up))
    assert min(ups) >= 1, "only a kill_all (with its restart_all next) takes every node down"
    assert not stopped, "no node is left frozen at the end"


def test_ci_churn_seed_covers_every_kind_of_event():
    """The seed tests/e2e/test_soak.py runs: every action, a spare, the store host down, a return."""
    c = coverage(churn_trace(311, ChurnConfig(events=10)))
    needed = {"kill", "crash", "term", "stop", "cont", "start", "kill_all", "restart_all", "spare", "store_host_down"}
    needed.add("return")
    assert needed <= set(c), c
    assert 0 < c["term_whole"] < c["term"], c  # SIGTERMs to the agent alone, and to every process of a node


def test_churn_config_is_checked():
    with pytest.raises(TraceError, match="events"):
        ChurnConfig(events=0)
    with pytest.raises(TraceError, match="2 node slots"):
        ChurnConfig(max_nodes=1, spares=0)
    with pytest.raises(TraceError, match="first_step"):
        ChurnConfig(first_step=10, last_step=5)


def test_events_timed_by_a_gap_or_a_step_stay_after_the_one_before():
    t = trace_from_dict(
        {
            "nodes": 2,
            "events": [
                {"at": 5, "action": "stop", "node": 1},
                {"gap": 2, "action": "cont", "node": 1},
                {"at": 1, "action": "kill", "node": 0},
                {"after_step": 9, "action": "start", "node": 0},
            ],
        }
    )
    assert [e.action for e in t.events] == [Action.KILL, Action.START, Action.STOP, Action.CONT]


def test_a_crash_leaves_its_node_up_and_round_trips():
    t = trace_from_dict(
        {"nodes": 2, "events": [{"at": 1, "action": "crash", "node": 1}, {"gap": 1, "action": "kill", "node": 1}]}
    )
    assert [e.action for e in t.events] == [Action.CRASH, Action.KILL] and t.min_alive() == 1
    assert trace_from_dict(t.to_dict()) == t and coverage(t)["crash"] == 1
