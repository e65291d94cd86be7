"""A new member's heap, grown and touched before its first step, and kept: its first steps run as fast as its later
ones.

A process's first training steps on CPU write memory the kernel has never mapped for it: the gradients' temporaries,
DDP's buckets (built anew in every live world, and again when DDP rebuilds them after its first iteration), the
optimizer's intermediates. From the third step on, glibc's malloc hands out the chunks the step before freed, already
mapped. A joiner's first two steps were the slowest of the whole world here (``perf``: at 100M parameters, 1.1 s of
page faults in the joiner's first step and 0.8 s in its second, against none later), and the running workers wait for
them at each step's all-reduce.

So, in a worker that receives its state on CPU (live mode: a joiner, a spare, the first workers), elastrain asks
glibc to keep what is freed (``mallopt``: every chunk from the heap, none from ``mmap``, which DDP's buckets of just
over 32 MiB were, mapped anew with each world and each rebuild on every rank; the heap never trimmed) and, while the
worker waits for its round, grows the heap by what a step needs beyond the state it holds and touches it, on the
thread that trains (glibc gives each thread its own arena). That is what the worker's steps would map anyway; it is
mapped before the worker asks to join, not while the world waits for it. What the process frees is kept for its
next allocations, never given back to the kernel before it ends (as PyTorch's caching allocator does on a GPU). A
process whose allocator the user chose (``LD_PRELOAD``, ``MALLOC_*`` or ``GLIBC_TUNABLES`` set), that sets
``ELASTRAIN_KEEP_HEAP=0``, or that is not on glibc is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import platform
import time
from collections.abc import Iterable, Mapping

import torch

from elastrain.env import KEEP_HEAP
from elastrain.log import lifecycle

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
MMAP_THRESHOLD = 32 * 1024 * 1024
"""glibc's largest mmap threshold (``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit), set so that glibc stops moving it."""
_TRIM_NEVER = -1
"""``M_TRIM_THRESHOLD`` of -1: glibc never gives the heap's top back to the kernel (``man mallopt``)."""
PIECE_BYTES = 16 * 1024 * 1024
"""The heap is grown in pieces of this size, allocated back to back so that, freed, they coalesce."""

HEAP_PER_PARAMETER_BYTE = 3
"""The heap a warm worker maps ahead, per byte of its parameters: a step's gradient temporaries, DDP's buckets
(built with each world, and again when DDP rebuilds them after its first iteration), the optimizer's intermediates."""


def user_chose_allocator(environ: Mapping[str, str]) -> str | None:
    """Pure: the environment variable by which the user chose or tuned the allocator, or None."""
    if environ.get(KEEP_HEAP, "1") == "0":
        return KEEP_HEAP
    if "malloc" in environ.get("LD_PRELOAD", "").lower():
        return "LD_PRELOAD"
    for name in sorted(environ):
        if name.startswith("MALLOC_") or name == "GLIBC_TUNABLES":
            return name
    return None


def keep_freed_memory() -> bool:
    """Ask glibc's malloc (once per process) to take every chunk from the heap, none from ``mmap``, and never to trim
    the heap; whether it is so. Not on another C library, nor when the user chose the allocator."""
    return _tuned_libc() is not None


@functools.cache
def _tuned_libc() -> ctypes.CDLL | None:
    """glibc, tuned as :func:`keep_freed_memory` says (once: cached); None where it is left alone."""
    chosen = user_chose_allocator(os.environ)
    if chosen is not None or platform.libc_ver()[0] != "glibc":
        lifecycle("heap_left_alone", why=f"{chosen} is set" if chosen else "not glibc")
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
        kept = (
            libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_NEVER) == 1
            and libc.mallopt(_M_MMAP_MAX, 0) == 1
        )
    except (OSError, AttributeError) as exc:
        lifecycle("heap_left_alone", level=logging.WARNING, why=f"mallopt failed: {exc!r}"[:200])
        return None
    if not kept:
        lifecycle("heap_left_alone", level=logging.WARNING, why="mallopt refused the settings")
        return None
    return libc


def grow_for(params: Iterable[torch.Tensor]) -> int:
    """:func:`grow` by what a step over ``params`` allocates beyond them (:data:`HEAP_PER_PARAMETER_BYTE`): their
    CPU, trainable part; the bytes mapped."""
    held = sum(p.numel() * p.element_size() for p in params if p.device.type == "cpu" and p.requires_grad)
    return grow(HEAP_PER_PARAMETER_BYTE * held)


def grow(nbytes: int) -> int:
    """Map ``nbytes`` of heap on the calling thread (allocated in pieces, written, freed: glibc keeps them for this
    thread's next allocations); the bytes mapped (0 when the heap is not kept: freed pieces would go back to the
    kernel)."""
    libc = _tuned_libc() if nbytes > 0 else None
    if libc is None:
        return 0
    started = time.monotonic()
    # One piece after another with nothing between them (torch's tensors would leave their small objects there,
    # which glibc's per-thread caches keep: freed, the pieces would stay apart, each too small for a larger chunk).
    pieces = []
    try:
        for _ in range(-(-nbytes // PIECE_BYTES)):
            address = libc.malloc(PIECE_BYTES)
            if not address:
                break  # out of memory: what was mapped so far is still of use
            ctypes.memset(address, 0, PIECE_BYTES)
            pieces.append(address)
    finally:
        for address in reversed(pieces):
            libc.free(address)
    grown = len(pieces) * PIECE_BYTES
    lifecycle("heap_grown", bytes=grown, took_s=round(time.monotonic() - started, 3))
    return grown
