"""Move a worker's training state from one rank to all at the wire's speed: model, optimizer, small ``Stateful``s.

The source sends a skeleton first: the state dicts with every tensor replaced by a placeholder (its index, shape,
dtype and path), and the plain values, as JSON (:mod:`elastrain.wire`: what a peer sends is parsed, never
unpickled). Then the tensors' bytes travel as a stream of pieces of at most :data:`PIECE_BYTES`, several in flight
at once (:data:`IN_FLIGHT`): gloo moves a large tensor in one piece several times slower than in pieces (measured
in ``bench/state_transfer.py``), and pieces let sending and receiving overlap. A tensor that fills pieces of its own
is sent from its own memory and received straight into its destination (no copy on either side); small tensors
are packed into shared pieces. A receiver's destination is its own tensor at the same path when it has one of the
same shape and dtype (a member that rolls back, the model of a new member: received in place, no
``load_state_dict`` copy), or a new one (the optimizer state of a new member). New CPU memory is written (zeroed)
just before its piece is received, while the pieces before it are on the wire: a page first touched by the
kernel's socket copy costs several times one touched in user space (measured in ``bench/state_transfer.py``: a
joiner's 210 MB of AdamW state took 0.59 s of system time when received into untouched pages). All ranks call
:func:`send_state` together, on the current default group; with ``overlap`` the optimizer's state
streams on in a background thread (:class:`Transfer`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastrain import wire
from elastrain.errors import WireFormatError
from elastrain.live.group import GroupBrokenError
from elastrain.live.receive_pool import ReceivePool
from elastrain.log import lifecycle

PIECE_BYTES = 16 << 20
"""The most bytes one broadcast carries (gloo: 16 MiB pieces move 1 GiB about 10x faster than one broadcast)."""
IN_FLIGHT = 4
"""Pieces on the wire at once: the next ones travel while one is being copied."""
GIVE_UP_POLL_S = 0.2
"""How often a wait for the rest of a transfer asks whether to give up."""
_TAGS = 1 << 10
"""Point-to-point pieces carry their number modulo this as their tag (far more than are ever in flight)."""
OWN_PIECES_BYTES = 1 << 20
"""A tensor of at least this many bytes travels in pieces of its own, straight from and into its memory."""


@dataclass(frozen=True)
class _TensorSlot:
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    path: str

    @classmethod
    def parse(cls, payload: Any) -> _TensorSlot:
        """A placeholder's payload, ``[index, shape, dtype, path]``, checked (it came from a peer)."""
        if not (isinstance(payload, list) and len(payload) == 4 and isinstance(payload[0], int)):
            raise WireFormatError(f"a tensor placeholder must be [index, shape, dtype, path], got {payload!r:.80}")
        index, shape, dtype, path = payload
        if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
            raise WireFormatError(f"tensor {index}: its shape {shape!r:.80} is not a list of sizes")
        if not isinstance(path, str):
            raise WireFormatError(f"tensor {index}: its path {path!r:.80} is not a string")
        return cls(index, tuple(shape), wire.dtype_of(dtype), path)

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Piece:
    """One broadcast: bytes ``[start, stop)`` of tensor ``own`` (in its memory), or a packed run of whole tensors."""

    own: int | None
    start: int = 0
    stop: int = 0
    packed: tuple[int, ...] = ()
    """Indices of the small tensors packed in this piece, in order (``own`` is None)."""


def plan_pieces(sizes: list[int], piece_bytes: int = PIECE_BYTES, own_bytes: int = OWN_PIECES_BYTES) -> list[Piece]:
    """Pure: the pieces that carry tensors of ``sizes`` bytes (by index): large ones in pieces of their own of at
    most ``piece_bytes``, small ones packed in order into pieces of at most ``piece_bytes``. The same on every rank."""
    pieces: list[Piece] = []
    run: list[int] = []
    run_bytes = 0
    for index, size in enumerate(sizes):
        if size >= own_bytes:
            pieces.extend(Piece(index, a, min(a + piece_bytes, size)) for a in range(0, size, piece_bytes))
            continue
        if size == 0:
            continue
        if run and run_bytes + size > piece_bytes:
            pieces.append(Piece(None, packed=tuple(run)))
            run, run_bytes = [], 0
        run.append(index)
        run_bytes += size
    if run:
        pieces.append(Piece(None, packed=tuple(run)))
    return pieces


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


class _Stream:
    """The pieces of one transfer from ``src`` to ``peers``, with at most :data:`IN_FLIGHT` on the wire.

    ``peers`` None: every rank of the group (one broadcast per piece); a tuple of ranks: the source sends each
    piece to each of them (``isend``/``irecv``), and the other ranks take no part."""

    def __init__(
        self,
        src: int,
        tensors: list[torch.Tensor],
        device: torch.device,
        rank: int,
        peers: tuple[int, ...] | None,
        fresh: frozenset[int] = frozenset(),
    ) -> None:
        self.src = src
        self.tensors = tensors
        self.device = device
        self.rank = rank
        self.receiving = rank != src
        self.peers = peers
        self.touch = self.receiving and device.type == "cpu"
        """Whether new memory is written before it is received into (CPU: its pages are mapped then)."""
        self.fresh = fresh
        """Indices of the tensors allocated for this transfer (a receiver's new memory)."""
        self._flight: deque[tuple[list[dist.Work], Piece, torch.Tensor]] = deque()

    def run(self, pieces: list[Piece]) -> None:
        if self.peers is not None and self.rank != self.src and self.rank not in self.peers:
            return
        for number, piece in enumerate(pieces):
            while len(self._flight) >= IN_FLIGHT:
                self._land()
            buffer = self._buffer(piece)
            self._flight.append((self._start(buffer, number % _TAGS), piece, buffer))
        while self._flight:
            self._land()

    def _start(self, buffer: torch.Tensor, tag: int) -> list[dist.Work]:
        if self.peers is None:
            works = [dist.broadcast(buffer, src=self.src, async_op=True)]
        elif self.receiving:
            works = [dist.irecv(buffer, src=self.src, tag=tag)]
        else:
            works = [dist.isend(buffer, dst=peer, tag=tag) for peer in self.peers]
        if any(w is None for w in works):
            raise RuntimeError("internal: an asynchronous send or receive returned no work handle")
        return [w for w in works if w is not None]

    def _buffer(self, piece: Piece) -> torch.Tensor:
        if piece.own is not None:
            buffer = _bytes(self.tensors[piece.own])[piece.start : piece.stop]
            if self.touch and piece.own in self.fresh:
                buffer.zero_()
            return buffer
        parts = [_bytes(self.tensors[i]) for i in piece.packed]
        if self.receiving:
            size = sum(p.numel() for p in parts)
            make = torch.zeros if self.touch else torch.empty
            return make(size, dtype=torch.uint8, device=self.device)
        return torch.cat(parts)

    def _land(self) -> None:
        works, piece, buffer = self._flight.popleft()
        for work in works:
            work.wait()
        if self.receiving and piece.own is None:
            offset = 0
            for i in piece.packed:
                out = _bytes(self.tensors[i])
                out.copy_(buffer[offset : offset + out.numel()])
                offset += out.numel()


def broadcast_tree(
    tree: Any,
    src: int,
    device: torch.device,
    targets: Mapping[str, torch.Tensor] | None = None,
    receivers: tuple[int, ...] | None = None,
) -> tuple[Any, int]:
    """``tree`` (nested dicts/lists of tensors and plain values) of rank ``src`` on every rank; bytes sent.

    ``targets`` (a receiver's): tensors by path (:func:`elastrain.wire.path_key`) to receive into, where the
    shape, dtype and device match and the tensor is contiguous; other tensors are allocated. ``receivers``: the
    ranks that need the tensors (the others get the skeleton only, and ``None`` for the state); None: all."""
    state, sent, _ = _send_tree(tree, src, device, targets, receivers, later=None)
    return state, sent


def _send_tree(
    tree: Any,
    src: int,
    device: torch.device,
    targets: Mapping[str, torch.Tensor] | None,
    receivers: tuple[int, ...] | None,
    later: Callable[[str], bool] | None,
    pool: ReceivePool | None = None,
) -> tuple[Any, int, _Background | None]:
    """:func:`broadcast_tree`, with the tensors whose path ``later`` accepts streamed by a background thread
    (returned; None when there are none or this rank takes no part): the tree comes back at once, those
    tensors filled when the thread is done."""
    rank = dist.get_rank()
    device = canonical_device(device)
    sources: list[torch.Tensor] = []

    def slot(t: torch.Tensor, path: tuple[str, ...]) -> list[Any]:
        t = t.detach()
        sources.append(t if t.device == device and t.is_contiguous() else t.to(device).contiguous())
        return [len(sources) - 1, list(t.shape), wire.dtype_name(t.dtype), wire.path_key(path)]

    data: bytes | None = None
    if rank == src:
        try:
            data = wire.dumps({"state": wire.to_plain(tree, slot)})
        except WireFormatError as exc:  # every rank hears of it: none waits for tensors that never come
            data = wire.dumps({"error": f"rank {src}: {exc}"})
    message = wire.loads(wire.broadcast_bytes(data, src, device=device))
    if not isinstance(message, dict) or not ("state" in message or "error" in message):
        raise WireFormatError(f"rank {src} sent no state ({str(message)[:80]})")
    if "error" in message:
        raise WireFormatError(f"the live state cannot be sent: {message['error']}")
    skeleton = message["state"]
    slots = sorted((_TensorSlot.parse(p) for p in wire.placeholders(skeleton)), key=lambda s: s.index)
    if [s.index for s in slots] != list(range(len(slots))):
        raise WireFormatError("the state's tensor placeholders are not numbered 0, 1, 2, ...")
    peers = None if receivers is None else tuple(sorted(set(receivers) - {src}))
    if peers is not None and rank != src and rank not in peers:
        return None, 0, None
    tensors, fresh = sources, frozenset[int]()
    if rank != src:
        placed = [_destination(s, targets or {}, device, pool) for s in slots]
        tensors = [t for t, _ in placed]
        fresh = frozenset(i for i, (_, new) in enumerate(placed) if new)
    deferred = [later is not None and later(s.path) for s in slots]
    now = plan_pieces([0 if d else s.nbytes for s, d in zip(slots, deferred, strict=True)])
    _Stream(src, tensors, device, rank, peers, fresh).run(now)
    background = None
    if any(deferred):
        rest = plan_pieces([s.nbytes if d else 0 for s, d in zip(slots, deferred, strict=True)])
        background = _Background(_Stream(src, tensors, device, rank, peers, fresh), rest)
    sent = sum(s.nbytes for s in slots) if peers is None or peers else 0
    return wire.from_plain(skeleton, lambda payload: tensors[payload[0]]), sent, background


class _Background:
    """The pieces of a transfer streamed by a thread of their own while training goes on."""

    def __init__(self, stream: _Stream, pieces: list[Piece]) -> None:
        self.error: BaseException | None = None
        self.finished_at: float | None = None
        """When the last piece landed or left (monotonic)."""
        self._thread = threading.Thread(target=self._run, args=(stream, pieces), name="elastrain-state", daemon=True)
        self._thread.start()

    def _run(self, stream: _Stream, pieces: list[Piece]) -> None:
        try:
            stream.run(pieces)
            self.finished_at = time.monotonic()
        except Exception as exc:  # a peer gone mid-transfer: the training thread hears of it in finish()
            self.error = exc

    def join(self, timeout_s: float) -> bool:
        """Whether the pieces all arrived (or left) within ``timeout_s`` without an error."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive() and self.error is None

    @property
    def running(self) -> bool:
        return self._thread.is_alive()


def canonical_device(device: torch.device) -> torch.device:
    """``device`` as tensors report theirs: accelerate's CPU device is ``cpu:0``, a CPU tensor's is ``cpu`` (the
    two compare unequal, and a receiver's own tensors would not be received into)."""
    if device.type == "cpu":
        return torch.device("cpu")
    if device.index is None and device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _destination(
    s: _TensorSlot, targets: Mapping[str, torch.Tensor], device: torch.device, pool: ReceivePool | None
) -> tuple[torch.Tensor, bool]:
    """Where a receiver receives slot ``s``: its own tensor at that path when it fits, else one of ``pool``'s
    (touched while it waited), else new memory; whether it is untouched new memory."""
    mine = targets.get(s.path)
    if (
        mine is not None
        and tuple(mine.shape) == s.shape
        and mine.dtype == s.dtype
        and mine.device == device
        and mine.is_contiguous()
    ):
        return mine.detach(), False
    pooled = pool.take(s.shape, s.dtype, device) if pool is not None else None
    if pooled is not None:
        tensor, touched = pooled
        return tensor, not touched
    return torch.empty(s.shape, dtype=s.dtype, device=device), True


def _tensors_by_path(tree: Any) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}

    def slot(t: torch.Tensor, path: tuple[str, ...]) -> None:
        found[wire.path_key(path)] = t

    wire.to_plain(tree, slot)
    return found


def _in_place(received: Mapping[str, Any], own: Mapping[str, Any]) -> bool:
    """Whether every received tensor is the receiver's own one (it was received into it): nothing to load."""
    return received.keys() == own.keys() and all(
        isinstance(v, torch.Tensor) and v.data_ptr() == own[k].data_ptr() for k, v in received.items()
    )


class TransferFailedError(GroupBrokenError):
    """The part of a state transfer that overlapped training did not complete (a peer left): the receiver's
    optimizer state is incomplete, and the world regroups."""


class Transfer:
    """A state transfer whose optimizer state may still be on the wire (:func:`send_state` with ``overlap``).

    The model, buffers and small state are in place when :func:`send_state` returns; the optimizer's state
    streams on while the next step's forward and backward run. :meth:`finish` must come before anything
    reads or changes the optimizer's state: its step (which would change the source's state mid-send), a
    save, a state dict."""

    def __init__(
        self,
        sent: int,
        started: float,
        background: _Background | None,
        on_received: Callable[[], None] | None,
        receivers: str | None,
    ) -> None:
        self.sent = sent
        """Bytes of tensors sent to each receiver (0 on a rank that neither sent nor received)."""
        self.receiving = on_received is not None
        self._started = started
        self._background = background
        self._on_received = on_received
        self._receivers = receivers
        """The source's: the ranks it sent to, for its ``state_sent`` line."""
        self.blocked_s = time.monotonic() - started
        """How long the transfer held training up: the part before :func:`send_state` returned."""
        self.complete = False
        self.failed = False

    @property
    def intact(self) -> bool:
        """Whether this rank's state is whole: not a receiver whose optimizer state did not all arrive."""
        return not (self.receiving and self.failed)

    def finish(self, timeout_s: float, give_up: Callable[[], bool] | None = None) -> None:
        """Wait (at most ``timeout_s``, and only while ``give_up()`` says no: polled every
        :data:`GIVE_UP_POLL_S`) for the rest of the transfer, then load the received optimizer state; raises
        :class:`TransferFailedError` if it did not all arrive (this rank's optimizer state is then incomplete,
        :attr:`failed`). gloo does not always fail a receive whose sender died, so a live worker gives up when
        its agent announces a new round. Once done, again is a no-op."""
        if self.failed:
            raise TransferFailedError("the optimizer state transfer failed before")
        if self.complete:
            return
        background = self._background
        if background is not None:
            deadline = time.monotonic() + timeout_s
            arrived = background.join(min(timeout_s, GIVE_UP_POLL_S))
            gave_up = False
            while not arrived and background.running and time.monotonic() < deadline:
                gave_up = give_up is not None and give_up()
                if gave_up:
                    break
                arrived = background.join(min(GIVE_UP_POLL_S, max(0.0, deadline - time.monotonic())))
            if not arrived:
                self.failed = True
                if gave_up:
                    why = "given up: a new round was announced"
                elif background.error is not None:
                    why = repr(background.error)[:200]
                else:
                    why = f"not done after {timeout_s:.0f} s"
                raise TransferFailedError(f"the optimizer state did not all arrive: {why}") from background.error
        if self._on_received is not None:
            self._on_received()
        self.complete = True
        if self._receivers is not None:
            done = self._background.finished_at if self._background is not None else None
            took = (done or time.monotonic()) - self._started
            lifecycle(
                "state_sent",
                receivers=self._receivers,
                bytes=self.sent,
                took_s=round(took, 3),
                gb_per_s=round(self.sent / max(took, 1e-9) / 1e9, 3),
                blocked_s=round(self.blocked_s, 3),
                overlapped=self._background is not None,
            )


def send_state(
    src: int,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    objects: Mapping[str, Any],
    device: torch.device,
    receivers: tuple[int, ...] | None = None,
    overlap: bool = False,
    pool: ReceivePool | None = None,
) -> Transfer:
    """Make the ``module``, ``optimizer`` and ``objects`` (``Stateful``s) of ``receivers`` (None: every rank)
    equal to rank ``src``'s. Every rank of the group calls it. ``overlap``: the optimizer's state streams in
    the background (see :class:`Transfer`); the model, buffers and ``objects`` arrive before it returns.
    ``pool``: a receiver's memory made ready for the optimizer's state (:mod:`elastrain.live.receive_pool`);
    closed here."""
    rank = dist.get_rank()
    mine = rank == src
    started = time.monotonic()
    if pool is not None:
        pool.stop()  # its tensors are received into now (or never: what is left is freed with it)
    if receivers is not None and not mine and rank not in receivers:
        broadcast_tree(None, src, device, receivers=receivers)  # the skeleton only: this rank's state is the same
        return _finished(Transfer(0, started, None, None, None))
    own_model = module.state_dict()
    tree = {
        "model": own_model,
        "optimizer": optimizer.state_dict(),
        "objects": {name: obj.state_dict() for name, obj in objects.items()},
    }
    state, sent, background = _send_tree(
        tree if mine else None,
        src,
        device,
        targets=None if mine else _tensors_by_path(tree),
        receivers=receivers,
        later=_optimizer_state if overlap else None,
        pool=pool,
    )
    if pool is not None:
        pool.close()  # what the state did not take
    on_received: Callable[[], None] | None = None
    if not mine:
        if not _in_place(state["model"], own_model):
            with torch.no_grad():
                module.load_state_dict(state["model"])
        for name, obj in objects.items():
            obj.load_state_dict(state["objects"][name])

        def on_received() -> None:
            optimizer.load_state_dict(state["optimizer"])

    to = "all" if receivers is None else ",".join(map(str, sorted(set(receivers) - {src})))
    transfer = Transfer(sent, started, background, on_received, to if mine and sent else None)
    return transfer if background is not None else _finished(transfer)


def _finished(transfer: Transfer) -> Transfer:
    transfer.finish(0.0)
    return transfer


def _optimizer_state(path: str) -> bool:
    return path.startswith("optimizer/")


def pieces_of(pieces: list[Piece]) -> Iterator[int]:
    """The tensor indices a list of pieces carries, in order (for tests)."""
    for p in pieces:
        yield from ([p.own] if p.own is not None else p.packed)
