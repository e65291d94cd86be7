"""What elastrain sends between processes, and the plain part of what it stores: JSON values, never pickles.

torch's object collectives (``broadcast_object_list``, ``all_gather_object``) pickle on one rank and
unpickle on the others, so a peer, or whoever can reach the group's sockets, could run code in every
rank. elastrain's own collectives carry JSON in ``uint8`` tensors instead (:func:`broadcast`,
:func:`all_gather`); what arrives is parsed, never executed.

The values are plain data: ``None``, ``bool``, ``int``, ``float``, ``str``, ``list`` and ``dict`` with
string keys, which JSON holds as they are, and two more that it cannot: tuples and dicts with other
keys (an optimizer's ``state`` is keyed by ints), which are tagged so that they round-trip exactly
(AdamW's ``betas`` stay a tuple, a float stays bit-identical). Tensors never go into the JSON: the
caller's ``tensor`` hook replaces each by a placeholder on the way out (:func:`to_plain`) and by the
real tensor on the way back (:func:`from_plain`); the checkpoint sidecars
(:mod:`elastrain.checkpoint.codec`) and the live state transfer (:mod:`elastrain.live.transfer`) use the
same tags.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote

import torch
import torch.distributed as dist

from elastrain.errors import WireFormatError

TENSOR = "__tensor__"
TUPLE = "__tuple__"
ITEMS = "__items__"  # a dict whose keys are not all strings
_TAGS = (TENSOR, TUPLE, ITEMS)

TensorOut = Callable[[torch.Tensor, tuple[str, ...]], Any]
"""``hook(tensor, path)``: the JSON placeholder payload that stands for ``tensor`` at ``path``."""
TensorIn = Callable[[Any], torch.Tensor]
"""``hook(payload)``: the tensor that a placeholder's payload stands for."""

DTYPES: dict[str, torch.dtype] = {
    name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype) and "." not in name
}
"""Every torch dtype by its attribute name (``"float32"``), so that a dtype travels as a plain string."""


def path_key(path: tuple[str, ...]) -> str:
    """``a/b%2Fc``: a path of keys as one string (``/`` inside a key is escaped)."""
    return "/".join(quote(p, safe="._-") for p in path)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: Any) -> torch.dtype:
    """The dtype a :func:`dtype_name` stands for; :class:`WireFormatError` for anything else."""
    found = DTYPES.get(name) if isinstance(name, str) else None
    if found is None:
        raise WireFormatError(f"{name!r} is not a torch dtype")
    return found


def to_plain(value: Any, tensor: TensorOut | None = None, path: tuple[str, ...] = ()) -> Any:
    """``value`` as JSON-ready plain data, tuples and non-string keys tagged, tensors through ``tensor``.

    Raises :class:`WireFormatError` naming the entry for anything else (an object, a function, a
    tensor without a hook).
    """
    if isinstance(value, torch.Tensor):
        if tensor is None:
            raise WireFormatError(f"entry {path_key(path) or '<root>'} is a tensor, which is sent as a tensor")
        return {TENSOR: tensor(value, path)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item") and type(value).__module__ == "numpy":
        return value.item()
    if isinstance(value, tuple):
        return {TUPLE: [to_plain(v, tensor, (*path, str(i))) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [to_plain(v, tensor, (*path, str(i))) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value) and not any(k in _TAGS for k in value):
            return {k: to_plain(v, tensor, (*path, k)) for k, v in value.items()}
        items = []
        for i, (k, v) in enumerate(value.items()):
            if isinstance(k, torch.Tensor) or not (k is None or isinstance(k, (bool, int, float, str, tuple))):
                raise WireFormatError(f"entry {path_key(path) or '<root>'}: dict key {k!r} is not plain data")
            items.append([to_plain(k, tensor, (*path, f"key{i}")), to_plain(v, tensor, (*path, f"#{i}"))])
        return {ITEMS: items}
    raise WireFormatError(
        f"entry {path_key(path) or '<root>'} is a {type(value).__name__}; only tensors and plain data (None, bool, "
        "int, float, str, list, tuple, dict) are saved or sent: convert it in your state_dict()"
    )


def from_plain(plain: Any, tensor: TensorIn | None = None) -> Any:
    """Inverse of :func:`to_plain`: tags undone, each placeholder replaced by ``tensor(payload)``."""
    if isinstance(plain, list):
        return [from_plain(v, tensor) for v in plain]
    if isinstance(plain, dict):
        if len(plain) == 1:
            if TENSOR in plain:
                if tensor is None:
                    raise WireFormatError("a tensor placeholder where no tensor was expected")
                return tensor(plain[TENSOR])
            if TUPLE in plain:
                return tuple(from_plain(v, tensor) for v in _list(plain[TUPLE]))
            if ITEMS in plain:
                out = {}
                for pair in _list(plain[ITEMS]):
                    if not (isinstance(pair, list) and len(pair) == 2):
                        raise WireFormatError(f"a dict item must be a [key, value] pair, got {pair!r:.80}")
                    out[_hashable(from_plain(pair[0], tensor))] = from_plain(pair[1], tensor)
                return out
        return {k: from_plain(v, tensor) for k, v in plain.items()}
    return plain


def placeholders(plain: Any) -> list[Any]:
    """The payloads of every tensor placeholder in ``plain``, in document order."""
    out: list[Any] = []
    stack = [plain]
    while stack:
        cur = stack.pop()
        if isinstance(cur, dict):
            if len(cur) == 1 and TENSOR in cur:
                out.append(cur[TENSOR])
            else:
                stack.extend(reversed(list(cur.values())))
        elif isinstance(cur, list):
            stack.extend(reversed(cur))
    return out


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise WireFormatError(f"a tagged value must hold a list, got {type(value).__name__}")
    return value


def _hashable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        raise WireFormatError("a dict cannot be a dict key")
    return value


def dumps(plain: Any) -> bytes:
    """JSON bytes of already plain data (:func:`to_plain`'s output)."""
    try:
        return json.dumps(plain, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise WireFormatError(f"not plain data: {exc}") from None


def loads(data: bytes) -> Any:
    """Plain data from JSON bytes; :class:`WireFormatError` for anything that is not well-formed JSON."""
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WireFormatError(f"not a well-formed message ({type(exc).__name__}: {exc})"[:300]) from None


def encode(value: Any) -> bytes:
    """``value`` (plain data, tuples included; no tensors) as JSON bytes."""
    return dumps(to_plain(value))


def decode(data: bytes) -> Any:
    """Inverse of :func:`encode`."""
    return from_plain(loads(data))


# -- collectives: JSON bytes in uint8 tensors ---------------------------------------------------------
def broadcast_bytes(
    data: bytes | None, src: int, group: dist.ProcessGroup | None = None, device: torch.device | None = None
) -> bytes:
    """``data`` of global rank ``src`` on every rank of ``group`` (``device``: where the backend wants tensors)."""
    dev = device if device is not None else torch.device("cpu")
    mine = dist.get_rank() == src
    if mine and data is None:
        raise WireFormatError("the source of a broadcast has nothing to send")
    length = torch.tensor([len(data) if mine and data is not None else 0], dtype=torch.int64, device=dev)
    dist.broadcast(length, src=src, group=group)
    n = int(length.item())
    if mine and data is not None:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    else:
        buf = torch.empty(n, dtype=torch.uint8, device=dev)
    if n:
        dist.broadcast(buf, src=src, group=group)
    return bytes(buf.cpu().numpy().tobytes())


def all_gather_bytes(
    data: bytes, group: dist.ProcessGroup | None = None, device: torch.device | None = None
) -> list[bytes]:
    """Every rank's ``data``, by rank in ``group``."""
    dev = device if device is not None else torch.device("cpu")
    world = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64, device=dev), group=group)
    sizes = [int(t.item()) for t in lengths]
    longest = max(sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=dev)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    parts = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(world)]
    if longest:
        dist.all_gather(parts, mine, group=group)
    return [bytes(p[:n].cpu().numpy().tobytes()) for p, n in zip(parts, sizes, strict=True)]


def broadcast(value: Any, src: int, group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> Any:
    """Global rank ``src``'s ``value`` (plain data, see :func:`encode`) on every rank of ``group``."""
    data = encode(value) if dist.get_rank() == src else None
    return decode(broadcast_bytes(data, src, group, device))


def all_gather(value: Any, group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> list[Any]:
    """Every rank's ``value`` (plain data), by rank in ``group``."""
    return [decode(part) for part in all_gather_bytes(encode(value), group, device)]
