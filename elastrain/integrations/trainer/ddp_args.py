"""The DDP that accelerate builds for a Trainer in a live world: no broadcast of a model every member holds
already, and the first iteration's gradients synchronised in buckets.

``Trainer.train`` is entered again in every world, and accelerate wraps the model in a new DDP each time. DDP's
constructor broadcasts rank 0's whole model (``init_sync``) although the members just agreed on it and it was
sent to those without it (:mod:`elastrain.integrations.trainer.world`); and without per-bucket caps, DDP (torch
>= 2.9) puts every gradient of its first iteration in one bucket when it does not look for unused parameters, so
the new world's first step all-reduces the whole gradient after the whole backward (:mod:`elastrain.bucket_allreduce`
says what that cost). accelerate passes its ``DistributedDataParallelKwargs`` to DDP as keywords, so the
accelerator's handler is replaced by one with the same settings and those two more (the Session does the same:
``elastrain/session/runtime.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from accelerate.utils import DistributedDataParallelKwargs

_DEFAULT_BUCKET_CAP_MB = 25


@dataclass
class ElasticDDPKwargs(DistributedDataParallelKwargs):  # type: ignore[misc]  # accelerate is untyped
    """accelerate's DDP settings and two of DDP's own that it does not carry."""

    init_sync: bool = True
    bucket_cap_mb_list: list[int] | None = None


def tune_ddp(accelerator: Any, in_sync: bool) -> None:
    """Before ``Trainer.train`` wraps the model in this world: DDP without its broadcast when every member holds
    the agreed model (``in_sync``), and with its first iteration in buckets of the script's size (or DDP's)."""
    current = accelerator.ddp_handler
    settings = {f.name: getattr(current, f.name) for f in dataclasses.fields(current)} if current is not None else {}
    settings.pop("init_sync", None)
    settings.pop("bucket_cap_mb_list", None)
    cap = int(settings.get("bucket_cap_mb") or _DEFAULT_BUCKET_CAP_MB)
    accelerator.ddp_handler = ElasticDDPKwargs(**settings, init_sync=not in_sync, bucket_cap_mb_list=[cap])
