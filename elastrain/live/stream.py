"""The wire part of a state transfer: a skeleton as JSON, then the tensors' bytes as a stream of pieces.

The source sends the state's skeleton first: the state dicts with every tensor replaced by a placeholder (its
index, shape, dtype and path) and the plain values, as JSON (:mod:`elastrain.wire`: what a peer sends is parsed,
never unpickled). Then the tensors' bytes travel in the pieces :mod:`elastrain.live.pieces` plans, at most
:data:`IN_FLIGHT` on the wire at once: gloo moves a large tensor in one piece several times slower than in pieces,
and pieces let sending and receiving overlap. A receiver's destination is its own tensor at the same path when it
has one of the same shape and dtype (received in place), one of a :class:`~elastrain.live.receive_pool.ReceivePool`'s
(touched while it waited), or new memory, written (zeroed) just before its piece arrives: a page first touched by
the kernel's socket copy costs several times one touched in user space. The pieces a caller defers (the optimizer's
state) stream in a :class:`Background` thread while training goes on.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from elastrain import wire
from elastrain.errors import WireFormatError
from elastrain.live.phases import LaterPhases
from elastrain.live.pieces import Piece, TensorSlot, assign_senders, plan_pieces
from elastrain.live.receive_pool import ReceivePool

IN_FLIGHT = 4
"""Pieces on the wire at once: the next ones travel while one is being copied."""
_TAGS = 1 << 10
"""Point-to-point pieces carry their number modulo this as their tag (far more than are ever in flight)."""


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


class Stream:
    """The pieces of one transfer from ``src`` to ``peers``, with at most :data:`IN_FLIGHT` on the wire.

    ``peers`` None: every rank of the group (one broadcast per piece); a tuple of ranks: each piece's sender
    (``senders``, by piece number; None: ``src`` sends them all) sends it to each of them (``isend``/``irecv``),
    and the other ranks take no part."""

    def __init__(
        self,
        src: int,
        tensors: list[torch.Tensor],
        device: torch.device,
        rank: int,
        peers: tuple[int, ...] | None,
        fresh: frozenset[int] = frozenset(),
        senders: list[int] | None = None,
    ) -> None:
        self.src = src
        self.tensors = tensors
        self.device = device
        self.rank = rank
        self.receiving = rank != src if peers is None else rank in peers
        self.peers = peers
        self.senders = senders
        self.touch = self.receiving and device.type == "cpu"
        """Whether new memory is written before it is received into (CPU: its pages are mapped then)."""
        self.fresh = fresh
        """Indices of the tensors allocated for this transfer (a receiver's new memory)."""
        self._flight: deque[tuple[list[dist.Work], Piece, torch.Tensor]] = deque()

    def run(self, pieces: list[Piece]) -> None:
        for number, piece in enumerate(pieces):
            sender = self.src if self.senders is None else self.senders[number]
            if not self.receiving and sender != self.rank:
                continue  # another holder of the state sends this one (or this rank takes no part)
            while len(self._flight) >= IN_FLIGHT:
                self._land()
            buffer = self._buffer(piece)
            self._flight.append((self._start(buffer, sender, number % _TAGS), piece, buffer))
        while self._flight:
            self._land()

    def _start(self, buffer: torch.Tensor, sender: int, tag: int) -> list[dist.Work]:
        if self.peers is None:
            works = [dist.broadcast(buffer, src=self.src, async_op=True)]
        elif self.receiving:
            works = [dist.irecv(buffer, src=sender, tag=tag)]
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
    state, sent, _, _ = send_tree(tree, src, device, targets, receivers, later=None)
    return state, sent


def send_tree(
    tree: Any,
    src: int,
    device: torch.device,
    targets: Mapping[str, torch.Tensor] | None,
    receivers: tuple[int, ...] | None,
    later: Callable[[str], bool] | None,
    pool: ReceivePool | None = None,
    helpers: tuple[int, ...] = (),
    shared: Callable[[str], bool] | None = None,
    phases: Callable[[list[TensorSlot]], list[int]] | None = None,
) -> tuple[Any, int, Background | None, LaterPhases | None]:
    """:func:`broadcast_tree`, with the tensors whose path ``later`` accepts streamed by a background thread
    (returned; None when there are none or this rank takes no part): the tree comes back at once, those
    tensors filled when the thread is done.

    ``phases`` (with ``later``): each slot's phase (:func:`~elastrain.live.phases.plan_phases`, the same on every
    rank); the background thread carries the deferred tensors of phase 0, and the :class:`LaterPhases` returned
    (None: one phase, or this rank takes no part) the others, each when the caller starts it.

    ``helpers`` (with ``receivers``): ranks that hold the same tensors as ``src`` at the paths ``shared`` accepts,
    given as ``targets`` (their own, by path); they send their share of those pieces
    (:func:`~elastrain.live.pieces.assign_senders`), so that the sending takes as many processes (and, across
    machines, links) as there are holders. A helper's tree comes back None."""
    rank = dist.get_rank()
    device = canonical_device(device)
    sources: list[torch.Tensor] = []

    def slot(t: torch.Tensor, path: tuple[str, ...]) -> list[Any]:
        sources.append(_sendable(t, device))
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
    slots = sorted((TensorSlot.parse(p) for p in wire.placeholders(skeleton)), key=lambda s: s.index)
    if [s.index for s in slots] != list(range(len(slots))):
        raise WireFormatError("the state's tensor placeholders are not numbered 0, 1, 2, ...")
    peers = None if receivers is None else tuple(sorted(set(receivers) - {src}))
    helpers = tuple(h for h in helpers if h != src and h not in (peers or ())) if peers else ()
    helping = rank in helpers
    if peers is not None and rank != src and rank not in peers and not helping:
        return None, 0, None, None
    tensors, fresh = sources, frozenset[int]()
    sharable = [bool(helpers) and shared is not None and shared(s.path) for s in slots]
    if helping:
        tensors = [_held(s, targets or {}, device) if ok else _NOTHING for s, ok in zip(slots, sharable, strict=True)]
    elif rank != src:
        placed = [_destination(s, targets or {}, device, pool) for s in slots]
        tensors = [t for t, _ in placed]
        fresh = frozenset(i for i, (_, new) in enumerate(placed) if new)
    deferred = [later is not None and later(s.path) for s in slots]
    senders = (src, *helpers)

    def stream(pieces: list[Piece]) -> Stream:
        by = assign_senders(pieces, sharable, senders) if helpers else None
        return Stream(src, tensors, device, rank, peers, fresh, by)

    phase = phases(slots) if phases is not None and any(deferred) else [0] * len(slots)
    if len(phase) != len(slots) or any(p != 0 for p, d in zip(phase, deferred, strict=True) if not d):
        raise ValueError("internal: a phase plan must cover every slot, and put what is sent now in phase 0")
    now = plan_pieces([0 if d else s.nbytes for s, d in zip(slots, deferred, strict=True)])
    stream(now).run(now)
    background = None
    if any(deferred):
        first = [s.nbytes if d and p == 0 else 0 for s, d, p in zip(slots, deferred, phase, strict=True)]
        rest = plan_pieces(first)
        first_stream = stream(rest)
        background = Background(lambda: first_stream.run(rest))
    phased: LaterPhases | None = None
    if max(phase, default=0) > 0:

        def resolve(s: TensorSlot, current: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, bool]:
            if rank == src or helping:  # the state it holds now, checked against the skeleton
                return _held(s, current, device), False
            return _destination(s, current, device, None)

        def make_stream(pieces: list[Piece], held: list[torch.Tensor], new: frozenset[int]) -> Callable[[], None]:
            by = assign_senders(pieces, sharable, senders) if helpers else None
            return lambda: Stream(src, held, device, rank, peers, new, by).run(pieces)

        phased = LaterPhases(slots, phase, rank != src and not helping, resolve, make_stream)
    if helping:
        return None, 0, background, phased
    sent = sum(s.nbytes for s in slots) if peers is None or peers else 0
    return wire.from_plain(skeleton, lambda payload: tensors[payload[0]]), sent, background, phased


_NOTHING = torch.empty(0, dtype=torch.uint8)
"""A helper's stand-in for a tensor only the source sends."""


def _sendable(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    t = t.detach()
    return t if t.device == device and t.is_contiguous() else t.to(device).contiguous()


def _held(s: TensorSlot, own: Mapping[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """A helper's own tensor at slot ``s``'s path, to send from: the same shape and dtype as the source's, or the
    members do not hold the same state (raised: the transfer fails, loudly)."""
    mine = own.get(s.path)
    if mine is None or tuple(mine.shape) != s.shape or mine.dtype != s.dtype:
        found = "none" if mine is None else f"{tuple(mine.shape)} {mine.dtype}"
        raise WireFormatError(
            f"a sender of the state transfer holds {found} at {s.path}, the source sent {s.shape} {s.dtype}"
        )
    return _sendable(mine, device)


class Background:
    """The pieces of a transfer streamed by a thread of their own while training goes on."""

    def __init__(self, run: Callable[[], None]) -> None:
        self.error: BaseException | None = None
        self.started_at = time.monotonic()
        self.finished_at: float | None = None
        """When the last piece landed or left (monotonic)."""
        self._thread = threading.Thread(target=self._run, args=(run,), name="elastrain-state", daemon=True)
        self._thread.start()

    def _run(self, run: Callable[[], None]) -> None:
        try:
            run()
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
    s: TensorSlot, targets: Mapping[str, torch.Tensor], device: torch.device, pool: ReceivePool | None
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
