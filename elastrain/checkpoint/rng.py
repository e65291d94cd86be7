"""Random number generator states of one process (Python, NumPy, torch CPU and CUDA) as plain data."""

from __future__ import annotations

import base64
import random
from typing import Any

import torch


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture_rng() -> dict[str, Any]:
    """This process's generator states, JSON-ready."""
    version, internal, gauss = random.getstate()
    out: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "torch": _b64(torch.get_rng_state()),
    }
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        out["numpy"] = {
            "name": name,
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        }
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng` captured (parts this process cannot use are skipped)."""
    py = state.get("python")
    if py:
        random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss"]))
    if "torch" in state:
        torch.set_rng_state(_unb64(state["torch"]))
    np_state = state.get("numpy")
    if np_state:
        import numpy as np

        np.random.set_state(
            (
                np_state["name"],
                np.asarray(np_state["keys"], dtype=np.uint32),
                np_state["pos"],
                np_state["has_gauss"],
                np_state["cached"],
            )
        )
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([_unb64(s) for s in cuda])
