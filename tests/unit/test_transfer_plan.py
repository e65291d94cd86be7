"""The pieces a state transfer is cut into (pure), and the placeholders a peer sends (parsed, checked)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastrain.errors import WireFormatError
from elastrain.live.pieces import Piece, TensorSlot, assign_senders, pieces_of, plan_pieces

MIB = 1 << 20


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ([], []),
        ([0, 0], []),
        ([10, 20, 30], [Piece(None, packed=(0, 1, 2))]),
        ([3 * MIB], [Piece(0, 0, 2 * MIB), Piece(0, 2 * MIB, 3 * MIB)]),
        ([100, 3 * MIB, 100], [Piece(1, 0, 2 * MIB), Piece(1, 2 * MIB, 3 * MIB), Piece(None, packed=(0, 2))]),
        ([600 << 10, 600 << 10, 900 << 10], [Piece(None, packed=(0, 1)), Piece(None, packed=(2,))]),
        ([MIB], [Piece(0, 0, MIB)]),
    ],
)
def test_pieces_by_table(sizes: list[int], expected: list[Piece]) -> None:
    assert plan_pieces(sizes, piece_bytes=2 * MIB, own_bytes=MIB) == expected


@given(
    st.lists(st.integers(min_value=0, max_value=5 * MIB), max_size=40),
    st.integers(min_value=64 << 10, max_value=4 * MIB),
)
def test_every_byte_travels_once_in_pieces_no_larger_than_the_limit(sizes: list[int], piece: int) -> None:
    own = min(MIB, piece)
    pieces = plan_pieces(sizes, piece_bytes=piece, own_bytes=own)
    covered: dict[int, list[tuple[int, int]]] = {}
    for p in pieces:
        if p.own is not None:
            assert 0 < p.stop - p.start <= piece
            covered.setdefault(p.own, []).append((p.start, p.stop))
        else:
            assert p.packed and sum(sizes[i] for i in p.packed) <= piece
            for i in p.packed:
                assert sizes[i] < own
                covered.setdefault(i, []).append((0, sizes[i]))
    for i, size in enumerate(sizes):
        spans = covered.get(i, [])
        if size == 0:
            assert not spans
            continue
        assert spans[0][0] == 0 and spans[-1][1] == size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # contiguous, in order
    # Small tensors keep their order (the receiver unpacks them in the order sent).
    packed = [i for i in pieces_of(pieces) if sizes[i] < own]
    assert packed == sorted(packed)


@pytest.mark.parametrize(
    "payload",
    [
        "x",
        [0, [1], "float32"],
        ["0", [1], "float32", "a"],
        [0, [-1], "float32", "a"],
        [0, "12", "float32", "a"],
        [0, [1], "float32", 7],
        [0, [1], "torch.nn.Module", "a"],
        [0, [1], "os.system", "a"],
    ],
)
def test_a_malformed_placeholder_from_a_peer_is_refused(payload: object) -> None:
    with pytest.raises(WireFormatError):
        TensorSlot.parse(payload)


def test_a_placeholder_is_parsed() -> None:
    slot = TensorSlot.parse([3, [2, 5], "bfloat16", "model/w"])
    assert (slot.index, slot.shape, slot.path, slot.nbytes) == (3, (2, 5), "model/w", 20)


@pytest.mark.parametrize(
    ("pieces", "shared", "senders", "expected"),
    [
        ([Piece(0, 0, 4), Piece(0, 4, 8), Piece(1, 0, 4)], [True, True], (0,), [0, 0, 0]),
        ([Piece(0, 0, 4), Piece(0, 4, 8), Piece(1, 0, 4)], [True, True], (2, 0), [2, 0, 2]),
        # A rank's own object (not shared) comes from the source; the turn goes on with the next shared piece.
        ([Piece(0, 0, 4), Piece(None, packed=(1, 2)), Piece(0, 4, 8)], [True, True, False], (1, 3), [1, 1, 3]),
        (
            [Piece(None, packed=(0, 1)), Piece(2, 0, 4), Piece(2, 4, 8), Piece(2, 8, 9)],
            [True] * 3,
            (0, 1, 2),
            [0, 1, 2, 0],
        ),
    ],
)
def test_senders_by_table(
    pieces: list[Piece], shared: list[bool], senders: tuple[int, ...], expected: list[int]
) -> None:
    assert assign_senders(pieces, shared, senders) == expected


@given(
    st.lists(st.integers(0, 5000), min_size=1, max_size=30),
    st.lists(st.booleans(), min_size=30, max_size=30),
    st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True),
)
def test_shared_pieces_are_spread_evenly_and_the_others_come_from_the_source(
    sizes: list[int], shared: list[bool], senders: list[int]
) -> None:
    pieces = plan_pieces(sizes, piece_bytes=1024, own_bytes=300)
    got = assign_senders(pieces, shared, tuple(senders))
    assert len(got) == len(pieces) and set(got) <= set(senders)
    turns = []
    for piece, sender in zip(pieces, got, strict=True):
        indices = [piece.own] if piece.own is not None else list(piece.packed)
        if all(shared[i] for i in indices):
            turns.append(sender)
        else:
            assert sender == senders[0]
    counts = [turns.count(s) for s in senders]
    assert max(counts) - min(counts) <= 1
