"""The training process group of a live worker: joined per round, left without waiting for dead peers.

Each round gets its own TCPStore (hosted by the round's rank 0 at the port the agent announced, as a
fresh start does) and its own default process group. DDP's gradient all-reduce goes through
:meth:`TrainingGroup.comm_hook`, which hands DDP a future of ours: when the agent's regroup notice
arrives while a rank waits in a collective that a live-but-departed peer will never join, the
watchdog (:mod:`elastrain.live.watchdog`) fails those futures and the training thread gets out at
once. gloo cannot be aborted (pytorch#130345): the abandoned operation would stay in gloo's thread until
its timeout, so a round a member left has its connections shut down (:mod:`elastrain.live.sever`), and
:meth:`TrainingGroup.drain` waits (bounded) for what is left before the process ends (a gloo group destructed with
an operation pending waits for it, or aborts the process): a group whose operation outlives that wait is kept,
never destructed, and the process exits at once all the same.

NCCL (CUDA): a left round's group is aborted, never destroyed (``destroy_process_group`` waits for
in-flight work since pytorch#141510, which a dead peer never completes), and on a departure the
watchdog aborts its communicators at once, which fails the pending kernels; the worker sets
``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (clean up, keep the process) unless the user set it. Written to
torch 2.13's API (``ProcessGroup.abort``, ``_abort_process_group``) but not run here: this machine
has no GPU; ``python bench/nccl_live.py`` checks it where one is.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket, PrefixStore, TCPStore

from elastrain.binding import tcp_store_server
from elastrain.bucket_allreduce import all_reduce_pieces, completion
from elastrain.errors import ElastrainError
from elastrain.group_pins import pin_default_group
from elastrain.live.sever import Connection, sever, tcp_sockets
from elastrain.log import lifecycle
from elastrain.step_flags import StepFlags, carries_flags


def _wait_listening(
    addr: str, port: int, deadline: float, abandon: Callable[[], bool], round_: int, poll_s: float = 0.005
) -> None:
    """Until something accepts connections at ``addr:port`` (bounded; TCPStore's own timeout follows)."""
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((addr, port), timeout=1.0):
                return
        except OSError:
            _abandon_if(abandon, round_, "its rank 0's store never listened")
            time.sleep(poll_s)


def _all_present(store: Any, world_size: int, deadline: float, abandon: Callable[[], bool], round_: int) -> None:
    """Until every member of the round has reached its store (each counts itself in), before the process group's own
    rendezvous, which waits for a member that died before it joined until ``join_timeout`` and cannot be left."""
    present = int(store.add(_PRESENT, 1))
    while present < world_size:
        _abandon_if(abandon, round_, f"{present} of its {world_size} members joined")
        if time.monotonic() > deadline:
            raise TimeoutError(f"round {round_}: {present} of its {world_size} members joined within join_timeout")
        time.sleep(_PRESENCE_POLL_S)
        present = int(store.add(_PRESENT, 0))


def _abandon_if(abandon: Callable[[], bool], round_: int, why: str) -> None:
    if abandon():
        raise JoinAbandonedError(f"round {round_} was superseded by a newer one while this worker joined it ({why})")


_PRESENT = "present"
_PRESENCE_POLL_S = 0.005

FIRST_STEP_TIMEOUT_S = 600.0
"""How long a new world's collectives wait until its first step has ended (then: --collective-timeout), when the script
compiles its model (:func:`is_compiled`, or the Trainer's ``--torch_compile``). That step compiles it: from nothing on
a joiner (measured here: 32-51 s for a tiny GPT-2 on CPU, minutes for a large model), and again on every member for
the micro-batch's new shape. The others wait for the slowest in the step's collectives, as long as torch's own default
for NCCL's (10 minutes). A member that dies meanwhile ends them at once all the same (its agent's notice,
:mod:`elastrain.live.watchdog`); only a worker that hangs with its agent alive is found later in that step than in any
other. An eager model's first step waits --collective-timeout, as every other step."""

DRAIN_LIMIT_S = 5.0
"""How long a worker about to exit waits for gloo to end the collectives it gave up. Severing their round ends them
within milliseconds; one still pending after this would hold on until its own timeout (--collective-timeout, up to
10 minutes: one CI run saw a survivor wait there at its exit). Its group is then kept, never destructed, until the
process ends (:func:`keep_until_exit`)."""


def first_step_wait(collective: timedelta | None, flag_s: float | None, compiles: bool) -> timedelta | None:
    """Pure: how long the collectives of a new world's first step wait: --first-step-timeout (``flag_s``) when given,
    else ``FIRST_STEP_TIMEOUT_S`` when the script compiles; never shorter than --collective-timeout (``collective``;
    None: torch's default, throughout)."""
    wait = flag_s or (FIRST_STEP_TIMEOUT_S if compiles else None)
    if collective is None or wait is None:
        return collective
    return max(collective, timedelta(seconds=wait))


def keep_until_exit(objects: list[Any]) -> None:
    """Never destruct ``objects`` (process groups, stores): each gets a reference no one holds, so the interpreter's
    finalisation leaves them to the process's end. A gloo group destructed with a collective in flight joins its
    thread, which waits for that collective's timeout (or aborts the process, pytorch#179291); one left alone lets the
    process exit at once, with its own exit code."""
    for obj in objects:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` or one of its submodules runs through ``torch.compile`` (wrapped, or compiled in place by
    ``Module.compile``): its first forward pass in a new world compiles."""
    from torch._dynamo.eval_frame import OptimizedModule

    return any(isinstance(m, OptimizedModule) or m._compiled_call_impl is not None for m in module.modules())


class GroupBrokenError(ElastrainError):
    """A collective of the training group failed or was given up: the worker regroups."""


class JoinAbandonedError(GroupBrokenError, RuntimeError):
    """The agent announced a newer round while this worker joined one (a member of it died before joining): the
    worker moves on to the newer round (a RuntimeError, as a failed join, for the regroup loops)."""


class _Pending:
    """One collective handed out as a future: completed by gloo, or failed by :meth:`TrainingGroup.abort`."""

    def __init__(self, work: torch.futures.Future[Any], out: torch.futures.Future[Any], result: Any) -> None:
        self.work = work
        self.out = out
        self.result = result
        self.lock = threading.Lock()

    def settle(self, error: BaseException | None) -> bool:
        """Complete ``out`` once: with the result, or with ``error``; False if it was settled before."""
        with self.lock:
            if self.out.done():
                return False
            if error is None:
                self.out.set_result(self.result)
            else:
                self.out.set_exception(error)
            return True


NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_CLEANUP_ONLY = "2"
"""torch's ``CleanUpOnly``: NCCL's watchdog aborts a failed or timed-out communicator and the process survives
(``1``, torch's default, tears the process down), so a live worker regroups instead of dying."""


def release_by_abort(backend: str) -> bool:
    """Whether a left round's group is aborted (NCCL: never destroyed, which waits for in-flight work) rather than
    destroyed (gloo, whose abandoned work the severed connections end)."""
    return backend.lower() == "nccl"


class TrainingGroup:
    """The default process group of the current round, and the collectives handed out on it."""

    def __init__(
        self,
        backend: str,
        timeout_s: float | None,
        join_timeout_s: float | None = None,
        first_step_timeout_s: float | None = None,
    ) -> None:
        if release_by_abort(backend):
            os.environ.setdefault(NCCL_ERROR_HANDLING, NCCL_CLEANUP_ONLY)  # before any NCCL group exists
        self.backend = backend
        self.timeout = timedelta(seconds=timeout_s) if timeout_s else None
        # Joining waits for every member of the round, which may include a worker the agent restarted
        # (the fallback): longer than a collective, as long as a cold start.
        self.join_timeout = timedelta(seconds=join_timeout_s) if join_timeout_s else self.timeout
        self.first_step_timeout_s = first_step_timeout_s  # --first-step-timeout (None: see first_step_timeout)
        self.round: int | None = None
        self.broken = threading.Event()
        self._lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._abandoned: list[_Pending] = []
        self._graveyard: list[Any] = []  # stores and groups of left rounds that gloo may still use
        self._store: Any = None
        self._connections: frozenset[Connection] = frozenset()  # the current round's (see elastrain.live.sever)
        self._severed: int | None = None  # the last round whose connections were shut down
        self.compiles = False
        """The script compiles its model: a new world's first step waits ``FIRST_STEP_TIMEOUT_S``."""
        self.first_step_until: float | None = None
        """Wall clock: the end of the current world's first step's bound while it is longer than --collective-timeout
        (a compiled model, --first-step-timeout); None once a step every member trained has ended (step_ended)."""

    # -- joining and leaving ----------------------------------------------------------------------
    def join(
        self,
        round_: int,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        abandon: Callable[[], bool] = lambda: False,
    ) -> None:
        """Init the default process group of ``round_`` (collective over the round's members). ``abandon``: whether
        a newer round was announced meanwhile (a member of this one died before it joined): the join is given up
        (:class:`JoinAbandonedError`) rather than waiting ``join_timeout`` for that member."""
        started = time.monotonic()
        join = self.join_timeout or timedelta(minutes=30)
        first_step = self.first_step_timeout()
        if first_step is not None:  # a member answers this round's notice at the end of its first step (step_ended)
            join = max(join, first_step)
        deadline = started + join.total_seconds()
        if rank != 0:
            # The new rank 0 starts the round's store while the others start to connect: a client that
            # finds no server backs off randomly (measured 0.7 s here); wait for the port instead.
            _wait_listening(master_addr, master_port, deadline, abandon, round_)
        before = tcp_sockets()
        if rank == 0:  # listening on MASTER_ADDR's interface only (see elastrain.binding)
            store = tcp_store_server(master_addr, master_port, join, world_size=world_size, wait_for_workers=False)
        else:
            store = TCPStore(master_addr, master_port, world_size, is_master=False, timeout=join)
        prefixed = PrefixStore(f"elastrain/live/round{round_}/", store)
        _all_present(prefixed, world_size, deadline, abandon, round_)
        dist.init_process_group(
            self.backend,
            store=prefixed,
            rank=rank,
            world_size=world_size,
            timeout=join,
        )
        # The first step's bound when it is longer than --collective-timeout (None: it waits that, as any step).
        longer_s = first_step.total_seconds() if first_step is not None and first_step != self.timeout else None
        self.first_step_until = time.time() + longer_s if longer_s is not None else None
        if first_step is not None:  # the join's bound until then; longer for a compiled model's first step
            dist.distributed_c10d._set_pg_timeout(first_step)
        pin_default_group()  # never freed by DDP's Reducer once the script destroyed it (elastrain.group_pins)
        self._store = store
        self._connections = tcp_sockets() - before
        self.round = round_
        self.broken.clear()
        lifecycle(
            "group_joined",
            round=round_,
            rank=rank,
            world_size=world_size,
            master=f"{master_addr}:{master_port}",
            took_s=round(time.monotonic() - started, 3),
            first_step_timeout_s=longer_s,
        )

    def first_step_timeout(self) -> timedelta | None:
        """How long the collectives of a new world's first step wait (:func:`first_step_wait`)."""
        return first_step_wait(self.timeout, self.first_step_timeout_s, self.compiles)

    def step_ended(self) -> bool:
        """A step in which every member of the current world trained has ended on this rank: from now on its
        collectives wait --collective-timeout (the first one waited ``FIRST_STEP_TIMEOUT_S``). Whether that is new."""
        if self.first_step_until is None or self.timeout is None or not dist.is_initialized():
            return False
        self.first_step_until = None
        dist.distributed_c10d._set_pg_timeout(self.timeout)
        lifecycle("group_settled", round=self.round, collective_timeout_s=self.timeout.total_seconds())
        return True

    @contextlib.contextmanager
    def owning_new_connections(self) -> Iterator[None]:
        """The sockets this process opens meanwhile (the process groups a world builds beside the round's own: its
        checkpointer's) belong to the current round: severed with it when a member is gone, so that none of their
        collectives outlives the round (a frozen peer would hold one until its timeout)."""
        before = tcp_sockets()
        try:
            yield
        finally:
            found = tcp_sockets() - before
            with self._lock:
                self._connections = self._connections | found

    def leave(self) -> None:
        """Leave the current round's group without waiting for its peers (some may be dead)."""
        self.abort(GroupBrokenError("the worker left the round's group"))
        with self._lock:
            left = [p for p in self._pending if not p.work.done()]
            self._abandoned.extend(left)
            self._pending.clear()
            left_round, self.round = self.round, None
        if left and left_round is not None:
            # Work given up stays in gloo until its timeout: end it here, and in any peer still blocked in it
            # (a node cut off by a partition would otherwise complete it once the network heals).
            self._sever(left_round, len(left))
        self._connections = frozenset()
        if dist.is_initialized():
            world = dist.group.WORLD
            self._graveyard.append(world)  # never destructed while gloo may still run its abandoned work
            if release_by_abort(self.backend):
                # NCCL: destroy_process_group waits for in-flight work (pytorch#141510), which a dead peer never
                # completes; aborting the communicators ends it, and the process lives on.
                dist.distributed_c10d._abort_process_group()
            else:
                dist.destroy_process_group()
        if self._store is not None:
            self._graveyard.append(self._store)
            self._store = None

    def sever(self, only_round: int) -> None:
        """A member of ``only_round`` is gone (the agent's notice): end every collective of that round now, here and
        in its peers, whether handed out by this group or not (FSDP2's all-gathers, a checkpoint agreement), by
        shutting its connections down (:mod:`elastrain.live.sever`). Nothing if the group moved on meanwhile."""
        with self._lock:
            if self.round != only_round:
                return
            pending = sum(1 for p in self._pending if not p.work.done())
        self._sever(only_round, pending)

    def _sever(self, round_: int, pending: int) -> None:
        with self._lock:
            if self._severed == round_:
                return  # a round is severed once
            self._severed = round_
            connections = self._connections
            world = dist.group.WORLD if dist.is_initialized() and self.round == round_ else None
            if self.round == round_:
                self.broken.set()  # a member is gone: the step in flight can never complete (see comm_hook)
        if release_by_abort(self.backend):
            # NCCL: its sockets are its own; aborting the round's communicators fails every pending kernel and
            # collective (TORCH_NCCL_ASYNC_ERROR_HANDLING=2 keeps the process alive), from this thread.
            if world is not None:
                world.abort()
            lifecycle("round_aborted", round=round_, pending=pending, backend=self.backend)
            return
        lifecycle("round_severed", round=round_, pending=pending, connections=sever(connections))

    def drain(self, timeout_s: float = DRAIN_LIMIT_S) -> None:
        """Before the process exits: wait (bounded) for gloo to end the collectives given up on; the left rounds'
        groups are then freed, or, if one is still pending, kept until the process ends (:func:`keep_until_exit`)."""
        deadline = time.monotonic() + timeout_s
        left = [p for p in self._abandoned if not p.work.done()]
        if left:
            lifecycle("group_draining", pending=len(left), up_to_s=timeout_s)
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = [p for p in left if not p.work.done()]
        self._abandoned = left
        if left:
            lifecycle(
                "group_drain_timeout",
                level=logging.WARNING,
                pending=len(left),
                action="the left rounds' groups are kept, never destructed, until the process ends",
            )
            keep_until_exit(self._graveyard)
            return
        # Free the left rounds' groups now, on this thread, while the interpreter is whole (a gloo group freed
        # during interpreter finalisation can abort the process, pytorch#179291).
        self._graveyard.clear()
        gc.collect()

    # -- collectives ------------------------------------------------------------------------------
    def _hand_out(self, works: list[dist.Work], result: Any) -> torch.futures.Future[Any]:
        fut = completion(works)
        out: torch.futures.Future[Any] = torch.futures.Future()
        pending = _Pending(fut, out, result)
        with self._lock:
            self._pending = [p for p in self._pending if not p.out.done()]
            self._pending.append(pending)

        broken = self.broken  # not self: a callback must never hold the last reference to a process group,
        # whose destructor would then run on gloo's own thread and join it (std::system_error, abort)

        def done(f: torch.futures.Future[Any]) -> None:
            try:
                f.value()
            except Exception as exc:  # gloo's error for this collective: the group is broken
                broken.set()
                pending.settle(GroupBrokenError(f"collective failed: {exc}"))
                return
            pending.settle(None)

        fut.add_done_callback(done)
        return out

    def comm_hook(
        self,
        state: object,
        bucket: GradBucket,
        flags: StepFlags | None = None,
        contributors: int | None = None,
        idle: bool = False,
    ) -> torch.futures.Future[torch.Tensor]:
        """DDP's gradient average over the current group, as a future :meth:`abort` can fail; ``flags``
        ride on the step's last bucket (:mod:`elastrain.step_flags`). ``contributors``: how many members contribute
        gradients to this step (None: all; see :mod:`elastrain.session.catch_up`); an ``idle`` member adds zeros.

        Once the round is broken (a member is gone, :meth:`sever`; a collective failed) it raises
        :class:`GroupBrokenError` instead: the step in flight is lost, and the backward stops at this bucket rather
        than compute on to the end of the pass (DDP lets the exception out of ``backward()``)."""
        if self.broken.is_set():
            raise GroupBrokenError(f"round {self.round} is broken: the backward stops at its next gradient bucket")
        tensor = bucket.buffer()
        if idle:
            tensor.zero_()
        else:
            tensor.div_(contributors or dist.get_world_size())
        if flags is None or not carries_flags(flags, bucket):
            return self._hand_out(all_reduce_pieces(tensor), tensor)
        packed = flags.pack(tensor)
        out = self._hand_out(all_reduce_pieces(packed), packed)
        return out.then(lambda f: flags.unpack(f.value(), tensor))

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """A blocking all-reduce that :meth:`abort` can give up; raises :class:`GroupBrokenError`."""
        work = dist.all_reduce(tensor, op=op, async_op=True)
        if work is None:
            raise RuntimeError("internal: an asynchronous all-reduce returned no work handle")
        out = self._hand_out([work], tensor)
        try:
            result: torch.Tensor = out.wait()
        except GroupBrokenError:
            raise
        except RuntimeError as exc:
            raise GroupBrokenError(f"collective failed: {exc}") from exc
        return result

    def abort(self, error: BaseException, only_round: int | None = None) -> int:
        """Fail every collective still pending (any thread), if the group is still in ``only_round``
        (when given); how many were."""
        with self._lock:
            if only_round is not None and self.round != only_round:
                return 0
            pending = [p for p in self._pending if not p.out.done()]
        if pending:
            self.broken.set()  # before any waiter wakes up: it asks whether the group broke
        return sum(1 for p in pending if p.settle(error))
