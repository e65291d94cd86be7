"""Split a nested state into tensors (for DCP) and plain data (for JSON), and join them back.

Loading never unpickles: tensors go through DCP (whose tensor reads use ``weights_only``), and every
other value is JSON. Tuples and dicts with non-string keys are tagged so that they round-trip
exactly (AdamW's ``betas`` stay a tuple, a float stays bit-identical).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import torch

from elastrain.errors import CheckpointError

TENSOR = "__tensor__"
TUPLE = "__tuple__"
ITEMS = "__items__"  # a dict whose keys are not all strings
_TAGS = (TENSOR, TUPLE, ITEMS)


def _key(path: tuple[str, ...]) -> str:
    return "/".join(quote(p, safe="._-") for p in path)


def split_state(tree: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, plain)``: tensors keyed by their path, and a JSON-ready tree with placeholders."""
    tensors: dict[str, torch.Tensor] = {}

    def enc(value: Any, path: tuple[str, ...]) -> Any:
        if isinstance(value, torch.Tensor):
            key = _key(path)
            tensors[key] = value
            return {TENSOR: key}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if hasattr(value, "item") and type(value).__module__ == "numpy":
            return value.item()
        if isinstance(value, tuple):
            return {TUPLE: [enc(v, (*path, str(i))) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [enc(v, (*path, str(i))) for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            if all(isinstance(k, str) for k in value) and not any(k in _TAGS for k in value):
                return {k: enc(v, (*path, k)) for k, v in value.items()}
            items = []
            for i, (k, v) in enumerate(value.items()):
                if isinstance(k, torch.Tensor) or not (k is None or isinstance(k, (bool, int, float, str, tuple))):
                    raise CheckpointError(f"state key {'/'.join(path)}: dict key {k!r} cannot be saved")
                items.append([enc(k, (*path, f"key{i}")), enc(v, (*path, f"#{i}"))])
            return {ITEMS: items}
        raise CheckpointError(
            f"state entry {'/'.join(path) or '<root>'} is a {type(value).__name__}; a checkpoint holds tensors and "
            "plain data (None, bool, int, float, str, list, tuple, dict): convert it in your state_dict()"
        )

    plain = {k: enc(v, (k,)) for k, v in tree.items()}
    return tensors, plain


def join_state(plain: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split_state`: the nested state with the placeholders replaced by ``tensors``."""
    if isinstance(plain, list):
        return [join_state(v, tensors) for v in plain]
    if isinstance(plain, dict):
        if TENSOR in plain and len(plain) == 1:
            key = plain[TENSOR]
            if key not in tensors:
                raise CheckpointError(f"state entry {key} is missing from the loaded tensors")
            return tensors[key]
        if TUPLE in plain and len(plain) == 1:
            return tuple(join_state(v, tensors) for v in plain[TUPLE])
        if ITEMS in plain and len(plain) == 1:
            return {_hashable(join_state(k, tensors)): join_state(v, tensors) for k, v in plain[ITEMS]}
        return {k: join_state(v, tensors) for k, v in plain.items()}
    return plain


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, (list, tuple)) else value
