"""Split a nested state into tensors (for DCP) and plain data (for JSON), and join them back.

Loading never unpickles: tensors go through DCP (whose tensor reads use ``weights_only``), and every
other value is JSON in :mod:`elastrain.wire`'s plain form, whose tags make tuples and dicts with
non-string keys round-trip exactly (AdamW's ``betas`` stay a tuple, a float stays bit-identical).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from elastrain import wire
from elastrain.errors import CheckpointError, WireFormatError

TENSOR, TUPLE, ITEMS = wire.TENSOR, wire.TUPLE, wire.ITEMS


def split_state(tree: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, plain)``: tensors keyed by their path, and a JSON-ready tree with placeholders."""
    tensors: dict[str, torch.Tensor] = {}

    def keep(value: torch.Tensor, path: tuple[str, ...]) -> str:
        key = wire.path_key(path)
        tensors[key] = value
        return key

    try:
        plain = {k: wire.to_plain(v, keep, (k,)) for k, v in tree.items()}
    except WireFormatError as e:
        raise CheckpointError(f"state {e}") from None
    return tensors, plain


def join_state(plain: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split_state`: the nested state with the placeholders replaced by ``tensors``."""

    def find(key: Any) -> torch.Tensor:
        if not isinstance(key, str) or key not in tensors:
            raise CheckpointError(f"state entry {key} is missing from the loaded tensors")
        return tensors[key]

    try:
        return wire.from_plain(plain, find)
    except WireFormatError as e:
        raise CheckpointError(f"saved state: {e}") from None
