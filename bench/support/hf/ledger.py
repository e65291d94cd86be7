"""The sample ledger for Trainer scripts: which samples each optimizer step used, in which world.

Not elastrain's: the tests' and benches' own instrument, which the scripts import only when ``LEDGER_DIR`` is set
(bench/support/trainer_ledger.py reads it).
:func:`wrap` wraps the training set so every micro-batch read is noted, in order; :class:`Callback` writes, at
each step's end, one line per rank to ``LEDGER_DIR/ledger-<pid>.jsonl``: the step, the ids of the step's
``gradient_accumulation_steps`` micro-batches (the DataLoader reads one micro-batch ahead: it stays for the
next step), the rank, the world size, the round (``ELASTRAIN_ROUND``, the world it ran in) and the world's
master (``MASTER_ADDR:MASTER_PORT``: a whole job started again counts its rounds from the start). At each step's
start it writes the same line marked ``"phase": "begin"``: a rank killed after its step's gradient all-reduce and
before its end line leaves that, and the reader (bench/support/trainer_ledger.py) counts it when its peers ended
the step in the same world. Reads of a step that never ended (given up when a peer died) are dropped at the next
``train()`` entry. While a test's or
bench's trace plays, each step also waits the seconds written in ``LEDGER_DIR/pace`` (long while a node warms up to
join), so the job outlasts the trace on a slow machine without burning CPU.

An iterable training set (``--streaming``: no index to note) is noted by content instead, as each micro-batch is
collated (the training DataLoader's ``collate_fn``, wrapped as ``train()`` begins): one id per sample, a CRC of its
``input_ids``.

With ``LEDGER_KILL=<step>:<group rank>:<world size>[:<hold s>:<forward|backward>]``, the node of that group rank
SIGKILLs itself (its agent, the agent's zygote and its worker: ``bench/support/node_kill.py``) at the end of the first
backward pass of that step, when it trains in a world of that size: a machine lost in the middle of a step, whose
peers have finished a micro-batch of it (``LEDGER_KILL_BACKWARD=<n>``: at the end of its n-th backward pass of that
step instead, when its peers have finished and counted n - 1 micro-batches). With a hold, the other nodes wait that
long in their second micro-batch of that step, before its forward pass or at the start of its backward pass: they
meet the broken world there, not waiting in the step's gradient all-reduce.

With ``LEDGER_KILL_AFTER=<step>:<group rank>:<world size>:<step_end|eval>``, that node SIGKILLs itself after the
step instead, in the work the Trainer does after it: at the end of the step's ``on_step_end`` (its peers then meet
the broken world in the step's log, evaluation or save), or in the first forward pass of the step's evaluation.
With ``<term>`` in that place, its worker SIGTERMs its agent at the end of the step's ``on_step_end`` and waits a
second: the node is asked to leave while the Trainer logs, evaluates and saves that step.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from collections import deque
from typing import Any

import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import TrainerCallback

_batches: deque[list[int]] = deque()  # micro-batches read and not yet accounted to a step, oldest first
_by_content: list[bool] = []  # [True] once wrap() met an iterable training set: noted as it is collated


class _Noted(Dataset):  # type: ignore[type-arg]
    def __init__(self, base: Any) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> Any:
        _batches.append([int(i)])
        return self.base[i]

    def __getitems__(self, indices: list[int]) -> list[Any]:  # torch's DataLoader reads a micro-batch with it
        _batches.append([int(i) for i in indices])
        return [self.base[i] for i in indices]

    def __getattr__(self, name: str) -> Any:  # column_names, features... of a datasets.Dataset
        return getattr(self.base, name)


def wrap(dataset: Any) -> Any:
    if not hasattr(dataset, "__len__"):  # an iterable set: noted by content, as it is collated
        _by_content.append(True)
        return dataset
    return _Noted(dataset)


class _NotedCollator:
    def __init__(self, collate: Any) -> None:
        self.collate = collate

    def __call__(self, features: list[dict[str, Any]]) -> Any:
        _batches.append([zlib.crc32(repr(list(f["input_ids"])).encode()) & 0x7FFFFFFF for f in features])
        return self.collate(features)


def _row(step: int, ids: list[int]) -> dict[str, Any]:
    return {
        "step": step,
        "ids": ids,
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "world": dist.get_world_size() if dist.is_initialized() else 1,
        "round": int(os.environ.get("ELASTRAIN_ROUND", "0") or 0),
        "master": f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}",
        "pid": os.getpid(),
        "t": time.time(),
    }


def _write(row: dict[str, Any]) -> None:
    with open(os.path.join(os.environ["LEDGER_DIR"], f"ledger-{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def _kill_after(step: int, world: int) -> str | None:
    """Where this node kills itself after ``step`` (``LEDGER_KILL_AFTER``), in a world of ``world`` ranks."""
    spec = os.environ.get("LEDGER_KILL_AFTER")
    if not spec:
        return None
    at, node, size, where = spec.split(":")
    mine = (int(at), node, int(size)) == (step, os.environ.get("GROUP_RANK"), world)
    return where if mine else None


def _node_kill() -> Any:
    """bench/support/node_kill.py (beside this folder, which is all the scripts' path holds of bench)."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import node_kill

    return node_kill


def _kill_own_node() -> None:
    _node_kill().kill_own_node()


def _term_own_agent() -> None:
    _node_kill().term_own_agent()
    time.sleep(1.0)  # the agent writes its checkpoint request meanwhile: it lands before this step's save


def _kill_in_eval(module: Any, args: Any) -> None:
    if not module.training:
        _kill_own_node()


def _kill_at() -> tuple[int, str, int, float, str] | None:
    spec = os.environ.get("LEDGER_KILL")
    if not spec:
        return None
    step, node, world, *hold = spec.split(":")
    return int(step), node, int(world), float(hold[0]) if hold else 0.0, hold[1] if len(hold) > 1 else "forward"


class _Hold:
    """In the model's second forward (or backward) pass from now: sleep ``seconds``, once."""

    def __init__(self, model: Any, seconds: float, where: str) -> None:
        self.seconds, self.calls = seconds, 0
        if where == "forward":
            self.handle = model.register_forward_pre_hook(lambda module, args: self._tick())
        else:  # the last parameter's gradient comes early in a backward pass, before any of DDP's buckets is ready
            self.handle = list(model.parameters())[-1].register_hook(lambda grad: self._tick())

    def _tick(self) -> None:
        self.calls += 1
        if self.calls == 2:
            self.handle.remove()
            time.sleep(self.seconds)


class _KillAtBackward:
    """The embedding's gradient (the last of a backward pass): SIGKILL this node at the ``n``-th from now."""

    def __init__(self, n: int) -> None:
        self.left = n

    def __call__(self, grad: Any) -> Any:
        self.left -= 1
        if self.left == 0:
            _kill_own_node()
        return grad


class Callback(TrainerCallback):
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _batches.clear()
        loader = kwargs.get("train_dataloader")
        if _by_content and loader is not None and not isinstance(loader.collate_fn, _NotedCollator):
            loader.collate_fn = _NotedCollator(loader.collate_fn)  # before train() iterates it

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _batches.clear()  # the last epoch's DataLoader read ahead, and is read no more

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The step's micro-batches are read by now (the Trainer fetches a step's micro-batches before its first).
        count = min(args.gradient_accumulation_steps, len(_batches))
        ids = [i for k in range(count) for i in _batches[k]]
        row = _row(int(state.global_step) + 1, ids)
        _write({**row, "phase": "begin"})
        kill = _kill_at()
        if kill is not None and (row["step"], row["world"]) == (kill[0], kill[2]):
            if os.environ.get("GROUP_RANK") == kill[1]:
                n = int(os.environ.get("LEDGER_KILL_BACKWARD", "1"))
                kwargs["model"].get_input_embeddings().weight.register_hook(_KillAtBackward(n))
            elif kill[3] > 0:
                _Hold(kwargs["model"], kill[3], kill[4])

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ids = [i for _ in range(min(args.gradient_accumulation_steps, len(_batches))) for i in _batches.popleft()]
        row = _row(int(state.global_step), ids)
        _write(row)
        where = _kill_after(row["step"], row["world"])
        if where == "step_end":
            _kill_own_node()
        elif where == "term":
            _term_own_agent()
        elif where == "eval":
            kwargs["model"].register_forward_pre_hook(_kill_in_eval)
        folder = os.environ["LEDGER_DIR"]
        try:
            with open(os.path.join(folder, "pace")) as f:
                time.sleep(float(f.read() or 0))
        except (FileNotFoundError, ValueError):
            pass
