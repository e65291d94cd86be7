"""The fencing generation in the checkpoint root: exclusive claims, superseded worlds, refused commits."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastrain import fence, fence_moves
from elastrain.errors import StaleGenerationError


def test_first_fresh_claim_is_generation_zero_and_check_passes(tmp_path: Path) -> None:
    c = fence.claim_fresh(str(tmp_path), "job", 0, "10.0.0.1:29400", ("a",))
    assert c.generation == 0
    assert fence.newest(str(tmp_path)) == c
    fence.check(str(tmp_path), 0)
    fence.check(str(tmp_path), None)


def test_two_worlds_descending_from_one_generation_get_it_once(tmp_path: Path) -> None:
    root = str(tmp_path)
    fence.claim_fresh(root, "job", 0, "s0", ())
    left = fence.claim_after(root, "job", 5, "left:1", ("a", "b"), parent=0)
    right = fence.claim_after(root, "job", 5, "right:1", ("c", "d"), parent=0)
    assert left is not None and right is None
    assert fence.newest(root).store == "left:1"  # type: ignore[union-attr]


def test_a_superseded_world_may_not_commit(tmp_path: Path) -> None:
    root = str(tmp_path)
    fence.claim_fresh(root, "job", 0, "s0", ())
    fence.claim_after(root, "job", 1, "s1", (), parent=0)
    with pytest.raises(StaleGenerationError, match="superseded by generation 1"):
        fence.check(root, 0)


def test_fresh_claims_follow_the_newest(tmp_path: Path) -> None:
    root = str(tmp_path)
    for _ in range(3):
        fence.claim_fresh(root, "job", 0, "s", ())
    assert fence.generations(root) == [0, 1, 2]


def test_old_claims_are_pruned(tmp_path: Path) -> None:
    root = str(tmp_path)
    for g in range(fence.KEEP_CLAIMS + 5):
        assert fence.claim(root, fence.Claim(g, "job", g, "s"))
    gens = fence.generations(root)
    assert len(gens) == fence.KEEP_CLAIMS and gens[-1] == fence.KEEP_CLAIMS + 4


def test_a_torn_claim_still_holds_its_number(tmp_path: Path) -> None:
    root = str(tmp_path)
    d = tmp_path / fence.FENCE_DIR
    d.mkdir()
    (d / "gen-000000000003.json").write_text("{not json")
    c = fence.newest(root)
    assert c is not None and c.generation == 3 and c.store == ""
    assert fence.claim_after(root, "job", 1, "s", (), parent=2) is None


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '"a string"', '{"generation": "x"}', "{}"])
def test_a_torn_or_malformed_claim_still_holds_its_number(tmp_path: Path, text: str) -> None:
    d = tmp_path / fence.FENCE_DIR
    d.mkdir()
    (d / "gen-000000000004.json").write_text(text)
    c = fence.newest(str(tmp_path))
    assert c is not None and c.generation == 4 and c.store == ""
    with pytest.raises(StaleGenerationError, match="superseded by generation 4"):
        fence.check(str(tmp_path), 3)


def test_the_end_of_a_job_is_recorded_once_beside_its_claims(tmp_path: Path) -> None:
    root = str(tmp_path)
    assert fence.newest_closed(root) is None
    fence.claim_fresh(root, "job", 0, "s0", ())
    first = fence.Closed(0, "job", 1.0, "mac")
    assert fence.mark_closed(root, first)
    assert not fence.mark_closed(root, fence.Closed(0, "job", 2.0, ""))  # a second member's mark: the first stays
    assert fence.newest_closed(root) == first
    assert fence.generations(root) == [0]  # a close is no claim: the next world still claims generation 1
    assert fence.claim_after(root, "job", 1, "s1", (), parent=0) is not None
    fence.mark_closed(root, fence.Closed(1, "job", 3.0))
    assert fence.newest_closed(root) == fence.Closed(1, "job", 3.0)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"generation": "x", "run_id": "job"}', "{}"])
def test_a_torn_close_is_no_end_of_the_job(tmp_path: Path, text: str) -> None:
    root = str(tmp_path)
    fence.mark_closed(root, fence.Closed(2, "job"))
    (tmp_path / fence.FENCE_DIR / "closed-000000000005.json").write_text(text)
    assert fence.newest_closed(root) == fence.Closed(2, "job")  # the newest readable one


@pytest.mark.parametrize(("mark", "prefix"), [(fence.Closed, "closed-"), (fence.Vacated, "vacated-")])
def test_old_marks_are_pruned_with_their_claims(tmp_path: Path, mark: type[fence.Closed], prefix: str) -> None:
    root = str(tmp_path)
    for g in range(fence.KEEP_CLAIMS + 3):
        assert fence.claim(root, fence.Claim(g, "job", g, "s"))
        fence.mark_closed(root, mark(g, "job"))
    oldest = fence.generations(root)[0]
    marks = sorted(p.name for p in (tmp_path / fence.FENCE_DIR).glob(f"{prefix}*"))
    assert marks[0] == f"{prefix}{oldest:012d}.json"  # pruned with the claims older than the oldest kept
    assert marks[-1] == f"{prefix}{fence.KEEP_CLAIMS + 2:012d}.json"


def test_the_last_node_leaving_a_world_is_recorded_apart_from_a_close(tmp_path: Path) -> None:
    root = str(tmp_path)
    fence.claim_fresh(root, "job", 0, "s0", ())
    assert fence.vacated(root, 0) is None
    first = fence.Vacated(0, "job", 1.0, "mac")
    assert fence.mark_closed(root, first)
    assert not fence.mark_closed(root, fence.Vacated(0, "job", 2.0, ""))  # the first mark stays
    got = fence.vacated(root, 0)
    assert got == first and isinstance(got, fence.Vacated)
    assert fence.newest_closed(root) is None  # the world was left, the job did not finish
    assert fence.vacated(root, 1) is None
    assert fence.mark_closed(root, fence.Closed(0, "job"))  # a close of the same generation is a mark of its own
    assert fence.vacated(root, 0) == first and fence.newest_closed(root) == fence.Closed(0, "job")
    assert fence.generations(root) == [0]  # neither is a claim


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "{}"])
def test_a_torn_vacating_mark_is_none(tmp_path: Path, text: str) -> None:
    (tmp_path / fence.FENCE_DIR).mkdir()
    (tmp_path / fence.FENCE_DIR / "vacated-000000000003.json").write_text(text)
    assert fence.vacated(str(tmp_path), 3) is None


def test_a_worlds_store_moves_are_read_newest_first_and_pruned_by_later_ones(tmp_path: Path) -> None:
    root = str(tmp_path)
    fence.claim_fresh(root, "job", 0, "a:1", ("a", "b"))
    for store in ("b:2", "c:3"):
        fence_moves.record(root, fence_moves.Moved(0, "job", store))
    assert [m.store for m in fence_moves.moves(root, 0)] == ["c:3", "b:2"]
    assert fence_moves.moves(root, 1) == []
    assert fence.newest(root).store == "a:1"  # type: ignore[union-attr]  # the claim itself is untouched
    for i in range(fence_moves.KEEP_MOVES + 2):
        fence_moves.record(root, fence_moves.Moved(0, "job", f"d:{i}"))
    kept = fence_moves.moves(root, 0)
    assert len(kept) == fence_moves.KEEP_MOVES and kept[0].store == f"d:{fence_moves.KEEP_MOVES + 1}"
    fence_moves.record(root, fence_moves.Moved(1, "job", "e:5"))  # a newer generation: the older moves go
    assert fence_moves.moves(root, 0) == [] and [m.store for m in fence_moves.moves(root, 1)] == ["e:5"]
    assert fence.generations(root) == [0]


@pytest.mark.parametrize("text", ["", "{", "[]", '{"generation": 0}', '{"generation": "x", "run_id": 1, "store": 2}'])
def test_a_torn_or_malformed_move_is_no_move(tmp_path: Path, text: str) -> None:
    root = str(tmp_path)
    fence_moves.record(root, fence_moves.Moved(0, "job", "b:2"))
    (tmp_path / fence.FENCE_DIR / f"moved-{0:012d}-{9 * 10**19:020d}.json").write_text(text)
    (tmp_path / fence.FENCE_DIR / "moved-x-1.json").write_text("{}")  # not a move's name: not read
    assert [m.store for m in fence_moves.moves(root, 0)] == ["b:2"]


def test_a_claims_world_runs_its_store_where_it_last_moved_else_where_it_claimed(tmp_path: Path) -> None:
    root = str(tmp_path)
    claim = fence.claim_fresh(root, "job", 0, "a:1", ("a", "b"), store_mac="m0")
    assert fence_moves.stores_of(root, claim) == [("a:1", "m0")]
    fence_moves.record(root, fence_moves.Moved(0, "other-job", "x:9"))  # another job's: never followed
    assert fence_moves.stores_of(root, claim) == [("a:1", "m0")]
    fence_moves.record(root, fence_moves.Moved(0, "job", "b:2", "m1"))
    fence_moves.record(root, fence_moves.Moved(0, "job", "c:3", "m2"))
    assert fence_moves.stores_of(root, claim) == [("c:3", "m2"), ("a:1", "m0")]


def test_a_root_that_cannot_be_read_leaves_the_claims_own_store(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    claim = fence.Claim(0, "job", 0, "a:1", store_mac="m0")
    (tmp_path / "a-file").write_text("")
    assert fence_moves.stores_of(str(tmp_path / "a-file"), claim) == [("a:1", "m0")]  # its fence folder: not a folder
    assert "event=fence_read_failed" in caplog.text
