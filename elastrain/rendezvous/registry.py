"""Registration of elastrain's rendezvous handlers in torch's handler registry.

``register_handlers()`` is idempotent; elastrain-run calls it before the agent asks the registry for a
handler, and torch's ``torchrun.handlers`` entry point reaches the same creators under plain torchrun.

Inside elastrain, ``c10d`` is elastrain's fast handler over torch's c10d store backend; torch's own
c10d handler stays reachable as ``torch-c10d``. ``etcd-v3`` is elastrain's handler over an etcd v3
backend (``elastrain.rendezvous.backends.etcd_v3``), imported only when used.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as _registry

# torch's own c10d handler, kept reachable under this name (baselines, comparisons).
TORCH_C10D = "torch-c10d"
C10D = "c10d"
ETCD_V3 = "etcd-v3"

_done = False


def _create_torch_c10d_handler(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.registry import _create_c10d_handler

    return _create_c10d_handler(params)


def create_c10d_handler(params: RendezvousParameters) -> RendezvousHandler:
    """elastrain's handler with its state in the embedded c10d store, with store failover."""
    from elastrain.rendezvous.backends.c10d import create_c10d_handler as create

    return create(params)


def create_etcd_v3_handler(params: RendezvousParameters) -> RendezvousHandler:
    from elastrain.rendezvous.backends.etcd_options import store_address
    from elastrain.rendezvous.backends.etcd_v3 import create_backend  # type: ignore[import-not-found,unused-ignore]
    from elastrain.rendezvous.handler import create_handler

    backend, store = create_backend(params)
    return create_handler(backend, store, params, store_address=store_address(params.endpoint))


def etcd_v3_handler_creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point for ``etcd-v3`` (torch calls it with no arguments)."""
    return create_etcd_v3_handler


def register_handlers() -> None:
    global _done
    if _done:
        return
    _done = True
    known = getattr(_registry, "_registry", {})
    if TORCH_C10D not in known:
        _registry.register(TORCH_C10D, _create_torch_c10d_handler)
    # Replace torch's "c10d" inside this process only (elastrain-run); torch's register() refuses to.
    known[C10D] = create_c10d_handler
    if ETCD_V3 not in known:
        _registry.register(ETCD_V3, create_etcd_v3_handler)
