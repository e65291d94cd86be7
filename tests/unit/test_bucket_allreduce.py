"""How a gradient bucket is cut for its all-reduce: whole up to the split size, else pieces covering it exactly."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastrain.bucket_allreduce import PIECE_BYTES, SPLIT_ABOVE_BYTES, piece_sizes


@pytest.mark.parametrize(
    ("numel", "element_size", "expected"),
    [
        (0, 4, [0]),
        (10, 4, [10]),
        (SPLIT_ABOVE_BYTES // 4, 4, [SPLIT_ABOVE_BYTES // 4]),  # DDP's usual 25 MiB buckets go whole
        (SPLIT_ABOVE_BYTES // 4 + 1, 4, [PIECE_BYTES // 4, PIECE_BYTES // 4, 1]),
        (100_700_000, 4, [PIECE_BYTES // 4] * 24 + [100_700_000 - 24 * (PIECE_BYTES // 4)]),  # a first iteration
        (SPLIT_ABOVE_BYTES, 2, [PIECE_BYTES // 2] * 4),
    ],
)
def test_pieces_by_table(numel: int, element_size: int, expected: list[int]) -> None:
    assert piece_sizes(numel, element_size) == expected


@given(st.integers(0, 1 << 28), st.sampled_from([1, 2, 4, 8]))
def test_pieces_cover_the_bucket_and_none_is_over_the_piece_size(numel: int, element_size: int) -> None:
    sizes = piece_sizes(numel, element_size)
    assert sum(sizes) == numel
    if numel * element_size > SPLIT_ABOVE_BYTES:
        assert all(0 < s * element_size <= PIECE_BYTES for s in sizes)
    else:
        assert sizes == [numel]
