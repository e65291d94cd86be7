"""Control flags agreed inside the step's gradient all-reduce: no collective of their own.

A checkpoint that the launcher asks for (a node leaves, a node joins) or that a rank's clock says is
due must start at the same step on every rank, so the ranks agree on it at each step boundary. A
collective for that alone costs a round trip on every step. Data-parallel training already makes
one all-reduce per step that every rank joins: DDP's gradient buckets. :class:`StepFlags` appends a
few numbers to the step's last bucket (:func:`flagged_allreduce`, a DDP comm hook; live mode's
:meth:`elastrain.live.group.TrainingGroup.comm_hook` does the same), so that after the backward every
rank holds, for each flag, whether any rank raised it. The checkpointer's save trigger reads them at
the step boundary (:meth:`elastrain.checkpoint.schedule.SaveTrigger.use_flags`). A step whose backward
made no sync (no DDP: a sharded model; a step without micro-batches) agrees them by a small all-reduce
of its own (:meth:`StepFlags.agree`, on every rank alike), as it must for any decision it shares.

The values are summed in the gradients' dtype: a sum of zeros and ones is zero only if every value
is zero, in any dtype, so "any rank raised it" survives fp16 and bf16 buckets. The agreed numbers
stay on the device until read (one small copy at the step boundary, not a sync inside backward).

*Totals* ride along the same way (:meth:`StepFlags.add_total`): a number each rank adds, summed over
all ranks, such as the step's loss, so the step's mean loss needs no collective after the step, one
that a peer's departure between the step and its logging would break. A total is kept only when the
bucket's dtype holds it well (float32 or float64); otherwise :meth:`StepFlags.total` says ``None``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket

from elastrain.bucket_allreduce import all_reduce_pieces, completion


class StepFlags:
    """Named boolean flags, raised by this rank at the step's last gradient sync, agreed by all ranks."""

    def __init__(self) -> None:
        self._sources: dict[str, Callable[[], bool]] = {}
        self._totals: dict[str, Callable[[], torch.Tensor | float]] = {}
        self._agreed: torch.Tensor | None = None
        self._agreed_view: dict[str, bool] | None = None  # _agreed read once (a device copy), then kept
        self._totals_view: dict[str, float] | None = None
        self._names: tuple[str, ...] = ()
        self._total_names: tuple[str, ...] = ()  # empty when the agreed dtype could not hold them

    def add(self, name: str, source: Callable[[], bool]) -> None:
        """``source()`` is asked at each step's last gradient sync whether this rank raises ``name``."""
        self._sources[name] = source

    def add_total(self, name: str, source: Callable[[], torch.Tensor | float]) -> None:
        """``source()`` is this rank's addend of ``name``, summed over all ranks with the flags (read with
        :meth:`total`). Totals ride only on a sync that carries flags: they never make one of their own."""
        self._totals[name] = source

    def remove(self, name: str, source: Callable[[], bool]) -> None:
        """Stop asking ``source`` for ``name`` (when it is still the one :meth:`add` registered for it)."""
        if self._sources.get(name) == source:
            del self._sources[name]

    def begin_step(self) -> None:
        """A new step starts on every rank: nothing is agreed for it yet."""
        self._agreed = self._agreed_view = self._totals_view = None

    @property
    def active(self) -> bool:
        return bool(self._sources)

    def pack(self, grads: torch.Tensor) -> torch.Tensor:
        """``grads`` followed by this rank's flags and totals (a new tensor, to all-reduce with SUM)."""
        return torch.cat([grads, self._raised(grads.dtype, grads.device)])

    def _raised(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """This rank's flags now, one number per registered name, then its totals when ``dtype`` holds them
        (the names' order is kept for :meth:`agreed` and :meth:`total`)."""
        self._names = tuple(self._sources)
        flags = torch.tensor([1.0 if self._sources[n]() else 0.0 for n in self._names], dtype=dtype)
        self._total_names = tuple(self._totals) if dtype in (torch.float32, torch.float64) else ()
        # A total may be a device tensor (a loss): concatenated on the device, never read here (no sync).
        totals = [torch.as_tensor(self._totals[n](), device=device).to(dtype).reshape(1) for n in self._total_names]
        return torch.cat([flags.to(device, non_blocking=True), *totals])

    def unpack(self, packed: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        """After the all-reduce: the gradients back into ``grads``; flags and totals kept as agreed for this step."""
        n = grads.numel()
        grads.copy_(packed[:n])
        self._agreed, self._agreed_view, self._totals_view = packed[n:].detach().clone(), None, None
        return grads

    def agree(self, all_reduce: Callable[[torch.Tensor], object], device: torch.device) -> None:
        """For a step whose backward made no gradient sync to ride on (no DDP: FSDP2, ``ddp=False``; a step
        without micro-batches): agree the flags by an all-reduce of their own (``all_reduce`` sums in place),
        on every rank alike. Nothing when this step's sync carried them, or when no flag is registered."""
        if self._agreed is not None or not self._sources:
            return
        raised = self._raised(torch.float64, device)
        all_reduce(raised)
        self._agreed, self._agreed_view, self._totals_view = raised, None, None

    def agreed(self) -> dict[str, bool] | None:
        """Every flag, True if any rank raised it in this step's sync; None if this step made no sync."""
        if self._agreed is None:
            return None
        return dict(self._read(self._agreed)[0])

    def total(self, name: str) -> float | None:
        """The sum over all ranks of ``name``'s addends in this step's sync; None if this step made no sync
        that carried it."""
        if self._agreed is None:
            return None
        return self._read(self._agreed)[1].get(name)

    def _read(self, agreed: torch.Tensor) -> tuple[dict[str, bool], dict[str, float]]:
        """The agreed flags and totals, copied from the device once per step (the checkpointer, the regroup
        and the mean loss all ask at the same boundary)."""
        if self._agreed_view is None or self._totals_view is None:
            values = agreed.tolist()
            flags, totals = values[: len(self._names)], values[len(self._names) :]
            self._agreed_view = {name: value > 0 for name, value in zip(self._names, flags, strict=True)}
            self._totals_view = dict(zip(self._total_names, totals, strict=True))
        return self._agreed_view, self._totals_view


def carries_flags(flags: StepFlags, bucket: GradBucket) -> bool:
    """Whether this bucket carries the step's flags: the last bucket of the backward, once per step."""
    return flags.active and bucket.is_last()


def flagged_allreduce(
    flags: StepFlags, group: dist.ProcessGroup | None = None
) -> Callable[[object, GradBucket], torch.futures.Future[torch.Tensor]]:
    """A DDP comm hook: DDP's gradient average, with ``flags`` riding on the last bucket."""

    def hook(state: object, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        grads = bucket.buffer()
        grads.div_(dist.get_world_size(group))
        sent = flags.pack(grads) if carries_flags(flags, bucket) else grads

        def reduced(done: torch.futures.Future[None]) -> torch.Tensor:
            done.value()  # raises the all-reduce's error
            return grads if sent is grads else flags.unpack(sent, grads)

        out: torch.futures.Future[torch.Tensor] = completion(all_reduce_pieces(sent, group)).then(reduced)
        return out

    return hook
