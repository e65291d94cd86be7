"""A state transfer spread over several steps: each parameter's state sent whole in one of a few phases.

At a catch-up (:mod:`elastrain.session.catch_up`) the members that need the agreed state sit out the steps its
transfer takes. Sent in one step, the whole stream must fit in that step's forward and backward (the holders'
optimizer step waits for it) and shares its CPU. In phases (the Session's ``catch_up_phase_bytes``: for a state
whose transfer takes longer than a step, over a slow network), each step carries about that many bytes: the state
of a run of parameters (each parameter with its optimizer state) as the holders hold it at that step boundary. A
receiver takes part in every step's gradient all-reduce and applies the optimizer's step to the parameters whose
state has arrived only (the others have no gradient, so torch's optimizers skip them): each parameter's state then
follows the holders' step by step, bit for bit, from the step it arrived at. That holds for optimizers whose step of
one parameter reads only that parameter's state and gradient (:data:`PER_PARAMETER`: torch's own); any other gets
one phase. The price: the receivers sit out as many steps as there are phases (a joiner helps that much later), and
step a growing share of the parameters meanwhile.

:func:`plan_phases` is pure (the same plan on every rank, from the skeleton the source sent); :class:`LaterPhases`
starts the phases after the first on one rank, each from and into the tensors the rank holds when it starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import unquote

import torch

from elastrain import wire
from elastrain.errors import WireFormatError
from elastrain.live.pieces import Piece, TensorSlot, plan_pieces

MAX_PHASES = 8
"""The most steps a catch-up's transfer is spread over (the needy members sit them all out)."""

PER_PARAMETER: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.ASGD,
    torch.optim.Rprop,
)
"""Optimizers whose step of a parameter is a function of that parameter's state and gradient alone, and which skip a
parameter without a gradient."""


def plan_phases(
    sizes: Sequence[int], groups: Sequence[int | None], phase_bytes: int, max_phases: int = MAX_PHASES
) -> list[int]:
    """Pure: the phase (0, 1, ...) of each tensor of ``sizes`` bytes, given its parameter (``groups``: the
    parameter's index, None for a tensor of no parameter: the first phase). A parameter's tensors share a phase;
    parameters are taken in index order, cut into about ``total / phase_bytes`` runs of equal bytes (at most
    ``max_phases``), numbered without gaps."""
    if len(sizes) != len(groups):
        raise ValueError(f"plan_phases: {len(sizes)} sizes for {len(groups)} groups")
    per_group: dict[int, int] = {}
    for size, group in zip(sizes, groups, strict=True):
        if group is not None:
            per_group[group] = per_group.get(group, 0) + size
    total = sum(per_group.values())
    count = max(1, min(max_phases, math.ceil(total / max(1, phase_bytes))))
    raw: dict[int, int] = {}
    before = 0
    for group in sorted(per_group):
        raw[group] = min(count - 1, before * count // total) if total else 0
        before += per_group[group]
    numbered = {p: n for n, p in enumerate(sorted(set(raw.values()) | {0}))}
    return [0 if g is None else numbered[raw[g]] for g in groups]


def parameter_groups(
    paths: Sequence[str], module: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> list[int | None]:
    """Each state path's parameter, by its index in ``optimizer``'s parameter groups (the optimizer state dict's
    numbering): ``model/<name>`` of a parameter, and ``optimizer/state/<index>/...``; None for anything else (a
    buffer, a tied parameter's second name, the ``Stateful`` objects)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    names = {id(p): name for name, p in module.named_parameters()}
    by_path = {wire.path_key(("model", names[id(p)])): i for i, p in enumerate(params) if id(p) in names}
    out: list[int | None] = []
    for path in paths:
        parts = path.split("/")
        if len(parts) > 3 and parts[0] == "optimizer" and parts[1] == "state":
            key = unquote(parts[2]).lstrip("#")
            out.append(int(key) if key.isdigit() and int(key) < len(params) else None)
        else:
            out.append(by_path.get(path))
    return out


MakeStream = Callable[[list[Piece], list[torch.Tensor], frozenset[int]], Callable[[], None]]
"""``(pieces, tensors by slot index, fresh indices)``: a run of those pieces, to be called on a background thread."""
Resolve = Callable[[TensorSlot, Mapping[str, torch.Tensor]], tuple[torch.Tensor, bool]]
"""This rank's tensor of a slot among the tensors it holds now (and whether it is new memory)."""


class LaterPhases:
    """One rank's part of a transfer's phases after the first, each started at a step boundary the caller picks.

    A sender sends each phase's tensors as it holds them when the phase starts (the state of that step); a receiver
    receives into the tensors it holds then (its optimizer's, loaded with the first phase), or into new memory
    copied into them once landed."""

    def __init__(
        self,
        slots: list[TensorSlot],
        phase_of: list[int],
        receiving: bool,
        resolve: Resolve,
        make_stream: MakeStream,
    ) -> None:
        self.count = max(phase_of, default=0) + 1
        self._slots = slots
        self._phase_of = phase_of
        self._receiving = receiving
        self._resolve = resolve
        self._make_stream = make_stream
        self._landed: list[tuple[str, torch.Tensor]] = []

    def start(self, phase: int, current: Mapping[str, torch.Tensor]) -> Callable[[], None]:
        """The run of ``phase``'s pieces (1 .. count-1), from or into this rank's ``current`` tensors by path."""
        if not 0 < phase < self.count:
            raise ValueError(f"phase {phase} of a transfer in {self.count} phases")
        tensors: list[torch.Tensor] = [_NOTHING] * len(self._slots)
        fresh: set[int] = set()
        self._landed = []
        for i, s in enumerate(self._slots):
            if self._phase_of[i] != phase:
                continue
            tensor, new = self._resolve(s, current)
            tensors[i] = tensor
            if new and self._receiving:
                fresh.add(i)
                self._landed.append((s.path, tensor))
        sizes = [s.nbytes if p == phase else 0 for s, p in zip(self._slots, self._phase_of, strict=True)]
        return self._make_stream(plan_pieces(sizes), tensors, frozenset(fresh))

    def land(self, current: Mapping[str, torch.Tensor]) -> None:
        """After a phase arrived on a receiver: what came into new memory, copied into the tensor it stands for."""
        landed, self._landed = self._landed, []
        for path, tensor in landed:
            mine = current.get(path)
            if mine is None or mine.shape != tensor.shape:
                raise WireFormatError(f"the state received at {path} has no tensor of its shape to go into")
            with torch.no_grad():
                mine.copy_(tensor)

    @property
    def plan(self) -> list[int]:
        """Each slot's phase."""
        return list(self._phase_of)


_NOTHING = torch.empty(0, dtype=torch.uint8)
"""A stand-in for a tensor a phase does not carry."""
