"""Which environments leave a worker's allocator alone (elastrain/live/heap.py): the user's choice wins."""

from __future__ import annotations

import pytest

from elastrain.live.heap import user_chose_allocator


@pytest.mark.parametrize(
    ("environ", "chosen"),
    [
        ({}, None),
        ({"PATH": "/bin", "OMP_NUM_THREADS": "1"}, None),
        ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "LD_PRELOAD"),
        ({"LD_PRELOAD": "/opt/libtcmalloc_minimal.so.4:/x/libfoo.so"}, "LD_PRELOAD"),
        ({"LD_PRELOAD": "/x/libfoo.so"}, None),
        ({"MALLOC_ARENA_MAX": "2"}, "MALLOC_ARENA_MAX"),
        ({"MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_ARENA_MAX": "2"}, "MALLOC_ARENA_MAX"),
        ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, "GLIBC_TUNABLES"),
        ({"MALLOC_CONF": "background_thread:true"}, "MALLOC_CONF"),
        ({"ELASTRAIN_KEEP_HEAP": "0"}, "ELASTRAIN_KEEP_HEAP"),
        ({"ELASTRAIN_KEEP_HEAP": "1"}, None),
    ],
)
def test_an_allocator_the_user_chose_or_tuned_is_named(environ: dict[str, str], chosen: str | None) -> None:
    assert user_chose_allocator(environ) == chosen
