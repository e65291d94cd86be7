"""The checkpointer's own process groups, and the few collectives it needs; a 1-process world without dist.

Objects travel as plain data (:mod:`elastrain.wire`): a peer's message is parsed, never unpickled.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastrain import wire
from elastrain.group_pins import pin_default_group

log = logging.getLogger(__name__)
_exit_hook_registered = False
_live_groups: weakref.WeakSet[Group] = weakref.WeakSet()
_abandoned_groups: list[Group] = []


def _destroy_process_groups_at_exit() -> None:
    """Destroy the process groups while the interpreter is still whole.

    A process that ends with gloo groups alive can abort (SIGABRT) during interpreter finalisation:
    gloo's threads still hold work objects whose tensors need the GIL to be freed (pytorch#179291,
    not merged). Scripts rarely call ``destroy_process_group`` (the Trainer does not), so every process
    that builds a :class:`Group` destroys them at exit. Its own groups are dropped too: the last reference
    gone, a gloo group's destructor waits for its threads, which then cannot outlive the interpreter with
    a finished collective (the checkpoint's last all-gather, right before the script ends) to free.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    for group in list(_live_groups):
        try:
            group.destroy()
        except (RuntimeError, ValueError) as exc:
            log.warning("destroying a checkpoint process group at exit failed: %s", exc)
    try:
        dist.destroy_process_group()
    except (RuntimeError, ValueError) as exc:  # a group already broken by a peer: nothing left to free cleanly
        log.warning("destroying the process groups at exit failed: %s", exc)


def _register_exit_hook() -> None:
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_destroy_process_groups_at_exit)
        _exit_hook_registered = True


class Group:
    """A gloo group over the ranks of ``parent`` (the default group when ``None``), with its own timeout.

    The checkpointer uses two: one for the training thread (agreeing when to save, restoring) and one
    for the background save, so that collectives of the two threads never interleave on one group.
    Creating one is a collective over the default group: every process must construct it.
    """

    def __init__(self, parent: dist.ProcessGroup | None = None, timeout_s: float | None = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.pg: dist.ProcessGroup | None = None
        if not self.distributed:
            self.rank, self.world_size = 0, 1
            return
        _register_exit_hook()
        pin_default_group()  # the group the model syncs over, freed at exit and never by DDP (elastrain.group_pins)
        ranks = None if parent is None else dist.get_process_group_ranks(parent)
        timeout = timedelta(seconds=timeout_s) if timeout_s else None
        self.pg = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        _live_groups.add(self)
        self.rank = dist.get_rank(self.pg)
        self.world_size = dist.get_world_size(self.pg)

    def all_max(self, values: list[int]) -> list[int]:
        if not self.distributed:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)
        return [int(v) for v in t.tolist()]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (plain data: :mod:`elastrain.wire`, never a pickle), by rank."""
        if not self.distributed:
            return [wire.decode(wire.encode(obj))]
        return wire.all_gather(obj, group=self.pg)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` (plain data: :mod:`elastrain.wire`, never a pickle) on every rank."""
        if not self.distributed:
            return wire.decode(wire.encode(obj))
        return wire.broadcast(obj, src=dist.get_global_rank(self.pg, 0), group=self.pg)  # type: ignore[arg-type]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.pg)

    def destroy(self) -> None:
        if self.pg is not None:
            dist.destroy_process_group(self.pg)
            self.pg = None

    def abandon(self) -> None:
        """Leave this group to a collective given up on (a broken world's save): never destroyed (its destructor
        would wait for gloo's thread, held until the group's timeout), nor at exit; kept referenced until the
        process ends, so that its last reference never goes on a gloo thread."""
        _live_groups.discard(self)
        _abandoned_groups.append(self)


@contextmanager
def default_group_timeout(timeout_s: float | None, restore_s: float | None) -> Iterator[None]:
    """Run a block whose collectives on the default group wait on storage with ``timeout_s`` (DeepSpeed's
    save barriers), then set the timeout back to ``restore_s``; a no-op without torch.distributed or a timeout."""
    if not (dist.is_available() and dist.is_initialized()) or timeout_s is None or restore_s is None:
        yield
        return
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=restore_s))
