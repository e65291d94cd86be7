"""The rendezvous handler's settings and the backend names it registers with torch (no handler runs)."""

from __future__ import annotations

import pytest

from elastrain.rendezvous.registry import ETCD_V3, TORCH_C10D, etcd_v3_handler_creator, register_handlers
from elastrain.rendezvous.settings import HandlerSettings


def test_settings_refuse_a_timeout_that_evicts_busy_nodes() -> None:
    with pytest.raises(Exception, match="heartbeat_timeout"):
        HandlerSettings(heartbeat_interval_s=1.0, heartbeat_timeout_s=1.5)


def test_registry_serves_elastrain_c10d_and_keeps_torch_and_etcd_names() -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    register_handlers()
    known = rendezvous_handler_registry._registry
    assert known["c10d"].__module__ == "elastrain.rendezvous.registry"
    assert TORCH_C10D in known and ETCD_V3 in known
    assert callable(etcd_v3_handler_creator())
