"""An iterable training set (no length: ``datasets.IterableDataset``, ``--streaming``) read as elastrain's stream.

An iterable set has no index to resume from, so elastrain reads it as one stream of positions: pass 0 of the
set, then pass 1 (``set_epoch(1)`` first, as the Trainer does between its epochs), and so on without a gap.
Position ``p`` is the ``p``-th sample that stream yields, whoever reads it. Every rank reads the stream front to
back and keeps its own share of each step's global batch (:class:`~elastrain.integrations.trainer.stream.
StreamBatches` with no length: its indices are positions). So the data position is again one number, the samples
consumed, and a job that resumes at any world size reads exactly the next unseen sample.

What that asks of the set: it yields the same samples in the same order in every process, for a given pass (a
file, a generator, ``datasets``' own seeded ``shuffle`` with ``set_epoch``). What it costs: each rank reads (and
maps) every sample, not only its own; a process that starts at position ``p`` reads the ``p`` samples before it
again (``event=trainer_stream_skipped``), as transformers' own resume of an iterable set does, unless the set can
resume itself: a ``datasets.IterableDataset`` keeps its place as a ``state_dict``, and a reader notes it at every
global batch's start (:meth:`IterableStream.mark`). A member that has the mark of its start position (a joiner at a
live regroup, from its peers; a restart, from the checkpoint) resumes the set there (``event=trainer_stream_resumed``)
instead.

:class:`IterableStream` is the map-style view the DataLoader reads: ``stream[p]`` is position ``p``. Reads go
forward; the last samples read are kept (``lookback``) for a DataLoader built again at a position it has already
read past (read ahead before a regroup); a position further back is read again from the stream's start.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

from elastrain.errors import DataStateError
from elastrain.log import lifecycle

_END = object()  # an exhausted pass's next()


def fingerprint(sample: Any) -> int:
    """A check that two readers saw the same sample (its printed form: plain values, arrays and tensors alike)."""
    return zlib.crc32(repr(sample).encode())


@runtime_checkable
class Epochal(Protocol):
    """A set whose order depends on the pass (``datasets.IterableDataset``: its seeded shuffle)."""

    def set_epoch(self, epoch: int) -> None: ...


@runtime_checkable
class Resumable(Protocol):
    """A set that keeps its place in the current pass as plain values (``datasets.IterableDataset``)."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class IterableStream:
    """Positions of the stream of an iterable set, read forward (a map-style dataset for the DataLoader)."""

    def __init__(self, source: Iterable[Any], lookback: int, mark_every: int = 0) -> None:
        self.source = source
        self.mark_every = mark_every if isinstance(source, Resumable) else 0
        """Note the set's own place at every multiple of this position (0: it cannot resume itself)."""
        self._marks: dict[int, dict[str, Any]] = {}
        self.lookback = max(1, lookback)
        self._recent: deque[Any] = deque(maxlen=self.lookback)
        self._next = 0
        """The position the stream yields next (``_recent`` ends at ``_next - 1``)."""
        self._pass = 0
        self._in_pass = 0
        self._it: Iterator[Any] | None = None

    @property
    def position(self) -> int:
        """The next position the stream yields."""
        return self._next

    @property
    def _kept_from(self) -> int:
        """The oldest position still kept (``_recent`` holds it up to :attr:`position`)."""
        return self._next - len(self._recent)

    def set_lookback(self, lookback: int) -> None:
        """Keep at least ``lookback`` of the last samples read (a world's global batch and what it reads ahead)."""
        if lookback > self.lookback:
            self.lookback = lookback
            self._recent = deque(self._recent, maxlen=lookback)

    def _open(self, n: int) -> None:
        if isinstance(self.source, Epochal):
            self.source.set_epoch(n)
        self._it, self._pass, self._in_pass = iter(self.source), n, 0

    def _read(self) -> Any:
        """The next sample of the stream: the next pass begins where one ends."""
        if self._it is None:
            self._open(0)
        assert self._it is not None
        sample = next(self._it, _END)
        if sample is _END and self._in_pass > 0:
            lifecycle("trainer_stream_pass_ended", level=logging.DEBUG, passes=self._pass + 1, at=self._next)
            self._open(self._pass + 1)
            sample = next(self._it, _END)
        if sample is _END:
            raise DataStateError(
                f"the training set yielded no sample in its pass {self._pass}: an iterable training set "
                "must yield its samples again each time it is iterated"
            )
        self._in_pass += 1
        self._recent.append(sample)
        self._next += 1
        if self.mark_every:
            read = self._marks.get(self._next - 1)
            if read is not None and "first" not in read:
                read["first"] = fingerprint(sample)  # what a resume there must yield first
            if self._next % self.mark_every == 0:
                self._note_mark()
        return sample

    def _note_mark(self) -> None:
        """The set's own place now (the next position is :attr:`position`), as plain values; older marks beyond
        what is kept are dropped."""
        assert isinstance(self.source, Resumable)
        try:
            state = json.loads(json.dumps(self.source.state_dict()))
        except (TypeError, ValueError) as exc:
            lifecycle("trainer_stream_unmarked", level=logging.WARNING, error=repr(exc)[:200])
            self.mark_every = 0
            return
        self._marks[self._next] = {"position": self._next, "pass": self._pass, "in_pass": self._in_pass, "set": state}
        oldest = self._next - self.lookback - self.mark_every
        for p in [p for p in self._marks if p < oldest]:
            del self._marks[p]

    def mark(self, position: int) -> dict[str, Any] | None:
        """The set's own place at ``position`` and a fingerprint of the sample there, or None (the start, a set that
        cannot resume itself, a position this reader has left behind). A position a little ahead is read up to
        first: this reader reads it next."""
        if position == 0 or not self.mark_every:
            return None
        while self._next <= position < self._next + self.lookback:
            self._read()
        mark = self._marks.get(position)
        return mark if mark is not None and "first" in mark else None

    def near(self, position: int) -> bool:
        """Whether ``position`` is kept, or at most :attr:`lookback` positions ahead (reached by reading a little)."""
        return self._kept_from <= position <= self._next + self.lookback

    def resume(self, mark: dict[str, Any]) -> bool:
        """Go on from a peer's or a checkpoint's :meth:`mark`: the set resumes itself at that place (no sample
        before it is read). Whether it did: the sample it yields first must be the one the mark saw there (a
        ``datasets`` shuffle buffer is not kept in its state, and a set resumed from it yields other samples);
        if not, the set's place is dropped and this reader starts again from the stream's start."""
        assert isinstance(self.source, Resumable)
        started = time.monotonic()
        position, n = mark.get("position"), mark.get("pass")
        why: str | None
        try:
            position, n, in_pass = int(mark["position"]), int(mark["pass"]), int(mark["in_pass"])
            if isinstance(self.source, Epochal):
                self.source.set_epoch(n)
            self.source.load_state_dict(mark["set"])
            self._restart()
            self._it, self._pass, self._in_pass, self._next = iter(self.source), n, in_pass, position
            same = fingerprint(self._read()) == mark.get("first")
            why = (
                None
                if same
                else "the set resumed from its state yields other samples than it did there (a "
                "shuffle buffer is not kept in a datasets state)"
            )
        except (KeyError, TypeError, ValueError) as exc:
            why = f"the set did not take its state: {exc!r}"[:300]
        if why is None:
            lifecycle("trainer_stream_resumed", to=position, passes=n, took_s=round(time.monotonic() - started, 3))
            return True
        lifecycle("trainer_stream_unresumed", level=logging.WARNING, to=position, why=why, instead="read again")
        self.source.load_state_dict({})  # no place to start from (datasets: an empty state is none)
        self._restart()
        return False

    def _restart(self) -> None:
        self._recent.clear()
        self._marks.clear()
        self._it, self._next = None, 0

    def seek(self, position: int) -> None:
        """Make ``position`` the next one read: skip forward to it (reading the samples before it), or, when it
        lies behind what is kept, read the stream again from its start."""
        if position < 0:
            raise DataStateError(f"stream position {position} is negative")
        if position < self._kept_from:
            lifecycle(
                "trainer_stream_reread", level=logging.WARNING, at=position, read=self._next, kept_from=self._kept_from
            )
            self._restart()
        skip = position - self._next
        if skip <= 0:
            return
        started = time.monotonic()
        for _ in range(skip):
            self._read()
        lifecycle("trainer_stream_skipped", samples=skip, to=position, took_s=round(time.monotonic() - started, 3))

    def __getitem__(self, position: int) -> Any:
        if position < self._kept_from:
            self.seek(position)
        while self._next <= position:
            self._read()
        return self._recent[position - self._kept_from]
