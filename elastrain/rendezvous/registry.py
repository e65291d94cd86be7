"""Registration of elastrain's rendezvous handlers in torch's handler registry.

``register_handlers()`` is idempotent; elastrain-run calls it before the agent asks the registry for a
handler, and torch's ``torchrun.handlers`` entry point reaches the same creators under plain torchrun.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as _registry

# torch's own c10d handler, kept reachable under this name (baselines, comparisons).
TORCH_C10D = "torch-c10d"

_done = False


def _create_torch_c10d_handler(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.registry import _create_c10d_handler

    return _create_c10d_handler(params)


def register_handlers() -> None:
    global _done
    if _done:
        return
    _done = True
    known = getattr(_registry, "_registry", {})
    if TORCH_C10D not in known:
        _registry.register(TORCH_C10D, _create_torch_c10d_handler)
