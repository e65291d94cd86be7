"""The state a live world's members hand over on entering it: sent from the agreed source to the members that
need it, the optimizer's part possibly still streaming while the first step runs (:mod:`elastrain.live.transfer`).

:class:`Handover` is the one place that starts a world's transfer, waits for the rest of it before the optimizer's
state is read or changed (:meth:`Handover.settle`), and gives it up when the world is left.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch

from elastrain.env import WorkerEnv
from elastrain.live import heap
from elastrain.live.agreement import Agreement
from elastrain.live.member import LiveMember
from elastrain.live.receive_pool import ReceivePool
from elastrain.live.transfer import Transfer, TransferFailedError, send_state
from elastrain.log import lifecycle
from elastrain.session.catch_up import CatchUp
from elastrain.session.runtime import Runtime

TRANSFER_TIMEOUT_S = 1800.0
"""The bound on the rest of a state transfer without ``--collective-timeout``."""


class Handover:
    """The current world's state transfer (none: this worker held the agreed state, or the world restored)."""

    def __init__(self) -> None:
        self.transfer: Transfer | None = None
        self._timeout_s = TRANSFER_TIMEOUT_S
        self._live: LiveMember | None = None
        self._pool: ReceivePool | None = None
        self._optimizer: torch.optim.Optimizer | None = None

    def prepare(self, runtime: Runtime, optimizer: torch.optim.Optimizer) -> ReceivePool | None:
        """A warm worker, before it waits for its first round: memory for the optimizer state it will receive, and
        the gradients of its first backward, being touched (``World.enter`` stops the pool before any step), and the
        heap its first steps allocate from (:mod:`elastrain.live.heap`). Only on the CPU, for a model whose state
        travels (a sharded one's never does)."""
        if runtime.device.type != "cpu" or runtime.sharded is not None:
            return None
        self._pool = ReceivePool.for_optimizer(optimizer, gradients=True)
        heap.grow_for(p for group in optimizer.param_groups for p in group["params"])  # meanwhile, on this thread
        return self._pool

    def drop_pool(self) -> None:
        """The state comes from elsewhere (a checkpoint) or not at all: the memory made ready is freed, and the
        gradients it gave are taken back (a checkpoint's optimizer state loads into a state torch builds only
        while no parameter has a gradient)."""
        if self._pool is not None:
            self._pool.take_back_gradients()
            self._pool.close()
        self._pool = None

    def start(
        self,
        agreement: Agreement,
        runtime: Runtime,
        optimizer: torch.optim.Optimizer,
        statefuls: Mapping[str, Any],
        env: WorkerEnv,
    ) -> tuple[int, CatchUp | None]:
        """Collective: the agreed source's state to the members that need it (those ahead of the agreed step and
        those without it), every other member sending its share; the bytes sent to each, and the catch-up of the
        world's first steps when the needy sit them out (:meth:`Runtime.catch_up_for`: the model's state streams on
        with the optimizer's, in the transfer's phases). On gloo (and unless the script said
        ``overlap_state_transfer=False``) the optimizer's state streams on while the next step runs."""
        if agreement.source is None or agreement.step is None:
            raise ValueError("internal: a state transfer needs the agreed source")
        needy = agreement.ahead + agreement.receivers  # the others hold the agreed state already
        holders = agreement.holders(runtime.world_size)  # each sends its share of the model and the optimizer
        catch_up = runtime.catch_up_for(holders, needy, agreement.step, agreement.trained_at)
        self.transfer = send_state(
            agreement.source,
            runtime.module,
            optimizer,
            statefuls,
            runtime.device,
            receivers=needy,
            overlap=runtime.backend == "gloo" and runtime.config.overlap_state_transfer,
            pool=self._pool,
            helpers=holders,
            defer_model=catch_up is not None,
            phase_bytes=runtime.config.catch_up_phase_bytes,
        )
        self._pool = None
        self._optimizer = optimizer
        self._timeout_s = env.collective_timeout_s or TRANSFER_TIMEOUT_S
        self._live = runtime.live
        if catch_up is not None:  # the needy sit out as many steps as their state takes to arrive
            catch_up = dataclasses.replace(catch_up, steps=self.transfer.phases)
        return self.transfer.sent, catch_up

    @property
    def intact(self) -> bool:
        """Whether this worker holds its world's whole state: not a receiver whose transfer broke off."""
        return self.transfer is None or self.transfer.intact

    def settle(self) -> bool:
        """Before the optimizer's state is read or changed (its step, a save): the phase of the transfer on the wire,
        waited for (bounded by the collective timeout, and given up when the agent announces a new round: a peer
        left); whether a received optimizer state was loaded just now (its parameter groups are the sender's: the
        LR of the sender's last step). Raises :class:`~elastrain.live.transfer.TransferFailedError` when it broke
        off. A receiver's parameters whose state comes in a later phase lose their gradient here: the optimizer's
        step skips them."""
        transfer = self.transfer
        if transfer is None or transfer.complete:
            return False
        live = self._live
        loaded = transfer.finish(
            self._timeout_s, give_up=None if live is None else lambda: live.pending_notice() is not None
        )
        for param in transfer.waiting():
            param.grad = None
        return loaded

    def advance(self) -> None:
        """At a step boundary of a catch-up, on every member: the transfer's next phase starts streaming (from the
        state the senders hold now), if one is left and the last has landed."""
        if self.transfer is not None and self.transfer.advance():
            lifecycle("state_phase_started", phase=self.transfer.phase, phases=self.transfer.phases)

    def flush(self) -> bool:
        """Before the whole state is read (a save, the session's end), on every member: every phase left, sent now
        and waited for; whether a received optimizer state was loaded (as :meth:`settle`)."""
        loaded = self.settle()
        while self.transfer is not None and not self.transfer.complete and self.transfer.advance():
            loaded = self.settle() or loaded
        return loaded

    def give_up(self) -> None:
        """The world is left (its group gone): what has not arrived by now never will. A receiver's parameters whose
        state was still to come lose the optimizer state loaded for them (memory the stream never wrote): nothing
        steps from it, whatever the next world decides."""
        transfer = self.transfer
        if transfer is None or transfer.complete:
            return
        try:
            transfer.finish(0.0)
        except TransferFailedError as exc:
            lifecycle(
                "state_transfer_broken", level=logging.WARNING, receiving=transfer.receiving, error=str(exc)[:200]
            )
        if self._optimizer is not None:
            for param in transfer.waiting():
                self._optimizer.state.pop(param, None)

    def reset(self) -> None:
        """Entering a new world: the last one's transfer is over (settled or given up)."""
        self.transfer = None
