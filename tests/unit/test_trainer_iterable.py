"""An iterable training set read as elastrain's stream (elastrain.integrations.trainer.iterable): positions of its
passes, read forward, the same whoever reads them and from wherever a reader starts."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastrain.errors import DataStateError
from elastrain.integrations.trainer.iterable import IterableStream
from elastrain.integrations.trainer.stream import StreamBatches
from elastrain.scaling import ScalingConfig, plan


class Passes:
    """A set of ``n`` samples whose order depends on the pass (as ``datasets``' seeded shuffle with set_epoch):
    pass ``e`` yields ``(e, i)`` for ``i`` rotated by ``e``. Counts how often it is iterated."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch, self.iterations = n, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[int, int]]:
        self.iterations += 1
        e = self.epoch
        return iter([(e, (i + e) % self.n) for i in range(self.n)])


def stream_of(n: int, length: int) -> list[tuple[int, int]]:
    """The stream a set of ``n`` samples makes: its passes one after the other."""
    return [(p // n, (p % n + p // n) % n) for p in range(length)]


def test_positions_run_through_the_passes_with_set_epoch_before_each() -> None:
    source = Passes(5)
    s = IterableStream(source, lookback=4)
    assert [s[p] for p in range(13)] == stream_of(5, 13)
    assert source.iterations == 3 and source.epoch == 2


def test_a_plain_iterable_with_no_set_epoch_is_read_again_pass_after_pass() -> None:
    s = IterableStream(range(3), lookback=2)
    assert [s[p] for p in range(7)] == [0, 1, 2, 0, 1, 2, 0]


@pytest.mark.parametrize(
    ("read_to", "seek", "rereads"),
    [
        (10, 12, False),  # forward: skip the samples in between
        (10, 8, False),  # back within the kept samples (read ahead before a regroup)
        (10, 6, False),  # back to the first kept one
        (10, 5, True),  # further back: read the stream again from its start
        (0, 9, False),  # a fresh reader (a joiner) skips to the position
    ],
)
def test_seek_reads_forward_keeps_the_last_samples_and_reads_again_only_behind_them(
    read_to: int, seek: int, rereads: bool, caplog: pytest.LogCaptureFixture
) -> None:
    source = Passes(4)
    s = IterableStream(source, lookback=4)
    for p in range(read_to):
        s[p]
    with caplog.at_level(logging.INFO, logger="elastrain"):
        s.seek(seek)
    assert ("event=trainer_stream_reread" in caplog.text) == rereads
    assert [s[p] for p in range(seek, seek + 6)] == stream_of(4, seek + 6)[seek:]


def test_a_skip_is_said_in_one_line_with_its_size(caplog: pytest.LogCaptureFixture) -> None:
    s = IterableStream(Passes(4), lookback=2)
    with caplog.at_level(logging.INFO, logger="elastrain"):
        s.seek(7)
        s.seek(7)
    assert s.position == 7
    assert caplog.text.count("event=trainer_stream_skipped samples=7 to=7") == 1


def test_an_empty_set_is_refused_in_one_clear_line() -> None:
    s = IterableStream([], lookback=2)
    with pytest.raises(DataStateError, match="yielded no sample in its pass 0"):
        s[0]


def test_a_set_that_yields_nothing_when_read_again_is_refused() -> None:
    once = iter([1, 2, 3])  # an iterator: exhausted after its first pass

    class Once:
        def __iter__(self) -> Iterator[int]:
            return once

    s = IterableStream(Once(), lookback=2)
    assert [s[p] for p in range(3)] == [1, 2, 3]
    with pytest.raises(DataStateError, match="yielded no sample in its pass 1"):
        s[3]


def test_a_negative_position_is_refused() -> None:
    with pytest.raises(DataStateError, match="negative"):
        IterableStream(Passes(3), lookback=2).seek(-1)


def test_the_lookback_only_grows() -> None:
    s = IterableStream(Passes(10), lookback=2)
    for p in range(6):
        s[p]
    s.set_lookback(5)
    s.set_lookback(1)
    assert s.lookback == 5
    assert s[5] == stream_of(10, 6)[5]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 7),
    lookback=st.integers(1, 6),
    reads=st.lists(st.integers(0, 30), min_size=1, max_size=25),
)
def test_any_order_of_reads_gives_the_streams_samples(n: int, lookback: int, reads: list[int]) -> None:
    s = IterableStream(Passes(n), lookback=lookback)
    want = stream_of(n, 31)
    assert [s[p] for p in reads] == [want[p] for p in reads]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_with_no_length_the_batches_are_stream_positions_the_same_at_every_world_size(world: int) -> None:
    p = plan(ScalingConfig(global_batch=12, micro_batch=3), world)
    ranks = [StreamBatches(None, p, r, start=30, steps=4, seed=0) for r in range(world)]
    steps = [sorted(i for s in ranks for mb in s.step_micro_batches(k) for i in mb) for k in range(4)]
    assert steps == [list(range(30 + 12 * k, 42 + 12 * k)) for k in range(4)]
    assert all(len(s) == 4 * p.accumulation for s in ranks)


def test_every_rank_reading_its_own_stream_takes_its_share_of_each_global_batch() -> None:
    """Two ranks, each with its own reader of the same set, together train each position once."""
    p = plan(ScalingConfig(global_batch=6, micro_batch=3), 2)
    got: list[tuple[int, int]] = []
    for rank in range(2):
        reader = IterableStream(Passes(5), lookback=12)
        batches = StreamBatches(None, p, rank, start=4, steps=3, seed=0)
        reader.seek(4)
        got.extend(reader[i] for mb in batches for i in mb)
    assert sorted(got) == sorted(stream_of(5, 22)[4:22])


class ResumablePasses(Passes):
    """:class:`Passes` that keeps its place as ``datasets.IterableDataset`` does: ``state_dict()`` is the current
    iteration's place, ``load_state_dict()`` the place the next iteration starts from. Counts samples yielded."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.state: dict[str, int] = {"epoch": 0, "offset": 0}
        self.start: dict[str, int] | None = None
        self.yielded = 0

    def state_dict(self) -> dict[str, int]:
        return dict(self.state)

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.start = dict(state_dict) or None  # an empty state: no place to start from

    def __iter__(self) -> Iterator[tuple[int, int]]:
        start, self.start = self.start or {"epoch": self.epoch, "offset": 0}, None
        e = start["epoch"]
        self.state = {"epoch": e, "offset": start["offset"]}
        for i in range(start["offset"], self.n):
            self.state["offset"] = i + 1
            self.yielded += 1
            yield (e, (i + e) % self.n)


@pytest.mark.parametrize("at", [4, 8, 12, 16])  # 8 and 16: the end of a pass of 8
def test_a_reader_resumes_the_set_from_a_peers_mark_without_reading_what_is_before_it(at: int) -> None:
    ahead = IterableStream(ResumablePasses(8), lookback=8, mark_every=4)
    for p in range(at + 2):
        ahead[p]
    mark = ahead.mark(at)
    assert mark is not None and mark["position"] == at
    source = ResumablePasses(8)
    joiner = IterableStream(source, lookback=8, mark_every=4)
    assert joiner.resume(mark)
    assert [joiner[p] for p in range(at, at + 10)] == stream_of(8, at + 10)[at:]
    assert source.yielded == 10


@pytest.mark.parametrize(
    ("read_to", "position", "near"),
    [(0, 0, True), (0, 4, True), (0, 5, False), (10, 6, True), (10, 5, False), (10, 14, True), (10, 15, False)],
)
def test_near_is_kept_or_a_lookback_ahead(read_to: int, position: int, near: bool) -> None:
    reader = IterableStream(Passes(50), lookback=4)
    for p in range(read_to):
        reader[p]
    assert reader.near(position) == near


class Reshuffled(ResumablePasses):
    """Resumes at its place but yields other samples from there (a ``datasets`` shuffle buffer, lost on resume)."""

    def __iter__(self) -> Iterator[tuple[int, int]]:
        resumed = self.start is not None
        for e, i in super().__iter__():
            yield (e, (i + 3) % self.n) if resumed else (e, i)


@pytest.mark.parametrize("mark_fault", ["other-samples", "no-state-taken"])
def test_a_resume_that_does_not_yield_the_marked_sample_is_said_and_read_again_from_the_start(
    mark_fault: str, caplog: pytest.LogCaptureFixture
) -> None:
    kind = Reshuffled if mark_fault == "other-samples" else ResumablePasses
    ahead = IterableStream(kind(8), lookback=8, mark_every=4)
    for p in range(14):
        ahead[p]
    mark = ahead.mark(12)
    assert mark is not None
    if mark_fault == "no-state-taken":
        mark = {**mark, "pass": "one"}
    source = kind(8)
    joiner = IterableStream(source, lookback=8, mark_every=4)
    with caplog.at_level(logging.INFO, logger="elastrain"):
        assert not joiner.resume(mark)
        joiner.seek(12)
    assert "event=trainer_stream_unresumed" in caplog.text and "event=trainer_stream_resumed" not in caplog.text
    assert [joiner[p] for p in range(12, 20)] == stream_of(8, 20)[12:]


def test_a_mark_a_little_ahead_is_read_up_to_and_one_left_behind_is_gone() -> None:
    reader = IterableStream(ResumablePasses(50), lookback=4, mark_every=4)
    for p in range(10):
        reader[p]
    assert reader.mark(12) is not None and reader.position == 13  # read up to it (and its sample): read next anyway
    assert reader.mark(100) is None  # beyond what it would read ahead
    for p in range(12, 30):
        reader[p]
    assert reader.mark(8) is None  # left behind


def test_no_mark_at_the_start_or_for_a_set_that_cannot_resume_itself() -> None:
    reader = IterableStream(ResumablePasses(8), lookback=4, mark_every=4)
    reader[5]
    assert reader.mark(0) is None and reader.mark(4) is not None
    plain = IterableStream(Passes(8), lookback=4, mark_every=4)
    plain[5]
    assert plain.mark(4) is None


def test_a_place_that_is_not_plain_values_is_said_once_and_not_marked(caplog: pytest.LogCaptureFixture) -> None:
    class Opaque(ResumablePasses):
        def state_dict(self) -> dict[str, int]:
            return {"epoch": 0, "offset": object()}  # type: ignore[dict-item]

    reader = IterableStream(Opaque(8), lookback=4, mark_every=2)
    with caplog.at_level(logging.INFO, logger="elastrain"):
        assert [reader[p] for p in range(9)] == stream_of(8, 9)
    assert caplog.text.count("event=trainer_stream_unmarked") == 1
    assert reader.mark(4) is None


def test_the_place_sent_at_a_regroup_is_the_readers_mark_at_the_agreed_position_and_is_taken_once() -> None:
    from elastrain.integrations.trainer.memory import StreamPlace

    place = StreamPlace()
    assert place.state_dict() == {} and place.mark_at(8) is None  # a map-style set: nothing to send
    reader = IterableStream(ResumablePasses(20), lookback=8, mark_every=4)
    for p in range(10):
        reader[p]
    agreed = [8]
    place.attach(reader.mark, lambda: agreed[0])
    sent = place.state_dict()
    assert sent["position"] == 8 and sent == place.mark_at(8)
    receiver = StreamPlace()
    receiver.load_state_dict(sent)
    assert receiver.take() == sent and receiver.take() is None
    receiver.load_state_dict({})
    assert receiver.take() is None
