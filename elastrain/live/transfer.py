"""Move a worker's training state from one rank to the others at the wire's speed: model, optimizer, ``Stateful``s.

All ranks call :func:`send_state` together, on the current default group. The state goes only to the ranks that
need it (``receivers``), as a skeleton and a stream of pieces (:mod:`elastrain.live.stream`, planned by
:mod:`elastrain.live.pieces`), the model's and the optimizer's sent by every rank that holds them, each its share
(one sender's CPU carried the whole stream here: 2.2 GB/s at 250M parameters in a job, 3.7 GB/s alone). A rank
that receives gets its own tensors overwritten in place where they fit (a member that rolls back, the model of a
new member: no ``load_state_dict`` copy) and new ones otherwise. With ``overlap`` the optimizer's state streams on
in a background thread while the next step's forward and backward run; :meth:`Transfer.finish` waits for it (on
every rank that sends or receives) before the optimizer's step, a save or a state dict.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from elastrain import wire
from elastrain.live import frozen
from elastrain.live.group import GroupBrokenError
from elastrain.live.phases import PER_PARAMETER, LaterPhases, parameter_groups, plan_phases
from elastrain.live.pieces import TensorSlot
from elastrain.live.receive_pool import ReceivePool
from elastrain.live.stream import Background, send_tree
from elastrain.log import lifecycle

GIVE_UP_POLL_S = 0.2
"""How often a wait for the rest of a transfer asks whether to give up."""


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
    save, a state dict.

    A transfer in phases (a catch-up's: :mod:`elastrain.live.phases`) lands its first phase at the first
    :meth:`finish`; each later one streams from :meth:`advance` (at a step boundary, on every rank of the
    transfer) to the next :meth:`finish`. Until the last has landed, a receiver's parameters of the phases to come
    are :meth:`waiting` (their state is not the agreed one yet) and its state is not :attr:`intact`."""

    def __init__(
        self,
        sent: int,
        started: float,
        background: Background | None,
        on_received: Callable[[], None] | None,
        receivers: str | None,
        later: LaterPhases | None = None,
        current: Callable[[], Mapping[str, torch.Tensor]] | None = None,
        waiting: list[list[torch.Tensor]] | None = None,
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
        self._later = later
        self._current = current
        self._waiting = waiting or []
        self.phases = later.count if later is not None else 1
        """How many phases the transfer takes (each a step of a catch-up)."""
        self.phase = 0
        """The phase streaming, or the last landed."""
        self._landed = False
        self._streaming_s = 0.0

    @property
    def intact(self) -> bool:
        """Whether this rank's state is whole: not a receiver whose state did not all arrive (yet)."""
        return not (self.receiving and (self.failed or not self.complete))

    def waiting(self) -> list[torch.Tensor]:
        """A receiver's parameters whose state comes in a phase after the one landed: the optimizer's step must skip
        them (their state would be the wrong step's)."""
        if not self.receiving or self.complete:
            return []
        first = self.phase + 1 if self._landed else self.phase
        return [p for group in self._waiting[first:] for p in group]

    def advance(self) -> bool:
        """At a step boundary, on every rank of the transfer: start the next phase once this one has landed;
        whether one started."""
        later, current = self._later, self._current
        if later is None or current is None or self.failed or self.complete or not self._landed:
            return False
        self.phase += 1
        self._landed = False
        self._background = Background(later.start(self.phase, current()))
        return True

    def finish(self, timeout_s: float, give_up: Callable[[], bool] | None = None) -> bool:
        """Wait (at most ``timeout_s``, and only while ``give_up()`` says no: polled every
        :data:`GIVE_UP_POLL_S`) for the phase on the wire, then load the received optimizer state; raises
        :class:`TransferFailedError` if it did not all arrive (this rank's optimizer state is then incomplete,
        :attr:`failed`). gloo does not always fail a receive whose sender died, so a live worker gives up when
        its agent announces a new round. Once landed, again is a no-op (until :meth:`advance`). Whether a received
        optimizer state was loaded now (its parameter groups are the sender's: the LR of the sender's last step)."""
        if self.failed:
            raise TransferFailedError("the optimizer state transfer failed before")
        if self.complete or self._landed:
            return False
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
            self._streaming_s += (background.finished_at or time.monotonic()) - (
                self._started if self.phase == 0 else background.started_at
            )
        on_received = self._on_received if self.phase == 0 else None
        loaded = on_received is not None
        if on_received is not None:
            on_received()
        elif self.receiving and self._later is not None and self._current is not None:
            self._later.land(self._current())
        self._landed = True
        if self.phase + 1 < self.phases:
            return loaded
        self.complete = True
        if self._receivers is not None:
            took = self._streaming_s if self._background is not None else time.monotonic() - self._started
            lifecycle(
                "state_sent",
                receivers=self._receivers,
                bytes=self.sent,
                took_s=round(took, 3),
                gb_per_s=round(self.sent / max(took, 1e-9) / 1e9, 3),
                blocked_s=round(self.blocked_s, 3),
                overlapped=self._background is not None,
                phases=self.phases,
                spread_s=round(time.monotonic() - self._started, 3),
            )
        return loaded


def send_state(
    src: int,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    objects: Mapping[str, Any],
    device: torch.device,
    receivers: tuple[int, ...] | None = None,
    overlap: bool = False,
    pool: ReceivePool | None = None,
    helpers: tuple[int, ...] = (),
    defer_model: bool = False,
    phase_bytes: int | None = None,
) -> Transfer:
    """Make the ``module``, ``optimizer`` and ``objects`` (``Stateful``s) of ``receivers`` (None: every rank)
    equal to rank ``src``'s. Every rank of the group calls it. ``overlap``: the optimizer's state streams in
    the background (see :class:`Transfer`); the model, buffers and ``objects`` arrive before it returns.
    ``pool``: a receiver's memory made ready for the optimizer's state (:mod:`elastrain.live.receive_pool`);
    closed here. ``helpers`` (with ``receivers``): other ranks that hold the same model and optimizer state as
    ``src`` (the agreed step's, :meth:`~elastrain.live.agreement.Agreement.holders`); they send their share of it.
    A rank that neither receives nor helps keeps its own state. ``defer_model`` (with ``overlap``): the model's
    tensors stream in the background too (receivers that sit the next step out: :mod:`elastrain.session.catch_up`);
    only the ``objects`` arrive before it returns; with ``phase_bytes`` and a per-parameter optimizer, in phases of
    about that many bytes (:mod:`elastrain.live.phases`), the first streamed now, each next one from
    :meth:`Transfer.advance`."""
    rank = dist.get_rank()
    mine = rank == src
    started = time.monotonic()
    if pool is not None:
        pool.stop()  # its tensors are received into now (or never: what is left is freed with it)
    own_model = module.state_dict()
    # Frozen parameters every receiver holds as the source does (a LoRA's base model) are not sent.
    names = [n for n in frozen.frozen_names(module) if n in own_model]
    skipped = frozen.held_alike(names, own_model, src, receivers, device)
    sent_model = {k: v for k, v in own_model.items() if k not in skipped} if skipped else own_model
    if skipped and mine:
        held = sum(own_model[k].numel() * own_model[k].element_size() for k in skipped)
        lifecycle("state_frozen_held", params=len(skipped), bytes=held, why="every receiver holds them as sent")
    tree = {
        "model": sent_model,
        "optimizer": optimizer.state_dict(),
        "objects": {name: obj.state_dict() for name, obj in objects.items()},
    }
    groups: list[int | None] = []  # each slot's parameter, once the skeleton is known (a transfer in phases)

    def phases(slots: list[TensorSlot]) -> list[int]:
        groups.extend(parameter_groups([s.path for s in slots], module, optimizer))
        return plan_phases([s.nbytes for s in slots], groups, phase_bytes or 1)

    phased = phase_bytes is not None and defer_model and overlap and isinstance(optimizer, PER_PARAMETER)

    state, sent, background, later = send_tree(
        tree if mine else None,
        src,
        device,
        targets=None if mine else _tensors_by_path(tree),
        receivers=receivers,
        later=(_model_or_optimizer_state if defer_model else _optimizer_state) if overlap else None,
        pool=pool,
        helpers=helpers,
        shared=_held_alike,
        phases=phases if phased else None,
    )

    def current() -> dict[str, torch.Tensor]:
        return _tensors_by_path({"model": module.state_dict(), "optimizer": optimizer.state_dict()})

    if receivers is not None and not mine and rank not in receivers:  # its own state stays as it is
        kept = Transfer(0, started, background, None, None, later, current)
        return kept if background is not None else _finished(kept)
    if pool is not None:
        pool.close()  # what the state did not take
    on_received: Callable[[], None] | None = None
    if not mine:

        def load_model() -> None:
            if not _in_place(state["model"], sent_model):
                with torch.no_grad():
                    if not skipped:
                        module.load_state_dict(state["model"])
                        return
                    missing, unexpected = module.load_state_dict(state["model"], strict=False)
                    if set(missing) != skipped or unexpected:
                        raise RuntimeError(
                            f"internal: the state left out the frozen {sorted(skipped)[:3]}, but the module misses "
                            f"{sorted(missing)[:3]} and does not know {unexpected[:3]}"
                        )

        model_later = defer_model and background is not None
        if not model_later:
            load_model()
        for name, obj in objects.items():
            obj.load_state_dict(state["objects"][name])

        def on_received() -> None:
            if model_later:
                load_model()
            optimizer.load_state_dict(state["optimizer"])

    to = "all" if receivers is None else ",".join(map(str, sorted(set(receivers) - {src})))
    waiting = _parameters_by_phase(groups, later, optimizer) if later is not None and not mine else None
    transfer = Transfer(sent, started, background, on_received, to if mine and sent else None, later, current, waiting)
    return transfer if background is not None else _finished(transfer)


def _parameters_by_phase(
    groups: list[int | None], later: LaterPhases, optimizer: torch.optim.Optimizer
) -> list[list[torch.Tensor]]:
    """The optimizer's parameters by the phase their state arrives in (``groups``: each slot's parameter)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    phase_of: dict[int, int] = {}
    for group, phase in zip(groups, later.plan, strict=True):
        if group is not None:
            phase_of[group] = max(phase, phase_of.get(group, 0))
    out: list[list[torch.Tensor]] = [[] for _ in range(later.count)]
    for index, phase in phase_of.items():
        out[phase].append(params[index])
    return out


def _finished(transfer: Transfer) -> Transfer:
    transfer.finish(0.0)
    return transfer


def _optimizer_state(path: str) -> bool:
    return path.startswith("optimizer/")


def _model_or_optimizer_state(path: str) -> bool:
    return path.startswith(("model/", "optimizer/"))


def _held_alike(path: str) -> bool:
    """The tensors every member at the agreed step holds bit for bit: the model's and the optimizer's (not the
    ``Stateful`` objects', which may be a rank's own)."""
    return path.startswith(("model/", "optimizer/"))
