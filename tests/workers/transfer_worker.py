"""One process of test_state_transfer.py: a model of mixed dtypes and sizes with AdamW, moved between ranks.

3 ranks. Every rank builds the same model from a different seed (different states); rank 0 trains two steps.
``receivers``: rank 0 sends its state to rank 2 only (point to point); rank 1 keeps its own. ``all``: rank 0's
state to every rank. ``overlap``: as ``receivers``, with the optimizer's state streamed in the background while
the ranks run a collective of their own (a training step's), then finished. ``broken``: as ``overlap``, with
rank 0 gone (``os._exit``) as soon as the call returns. ``pooled``: as ``receivers``, on accelerate's name for
the CPU (``cpu:0``), with rank 2's optimizer state received into a pool it made beforehand
(:class:`elastrain.live.receive_pool.ReceivePool`); it prints whether every tensor of its optimizer's state is one
of the pool's (``pooled``). ``helped``: ranks 0 and 1 hold the same model and optimizer state (rank 1 helps: it
sends its share), rank 2 receives; ``helped-overlap``: the same with the optimizer's state streamed;
``helped-unlike``: rank 1 helps but holds another state of the same shapes (what rank 2 gets shows it sent).
``frozen``: as ``receivers``, with a frozen layer (``requires_grad`` off) every rank built alike, as adapters'
base model is (it is not sent); ``frozen-unlike``: rank 2 built that layer from another seed (it is sent).
Each rank prints the hash of its state, whether its parameters stayed in their own memory, and the bytes the call
returned; in the overlap modes also the model's hash when the call returned (before the optimizer's state arrived)
and whether the transfer completed.
"""

from __future__ import annotations

import hashlib
import os
import sys

import torch
import torch.distributed as dist

from elastrain.live import pieces, transfer
from elastrain.live.receive_pool import ReceivePool


class Mixed(torch.nn.Module):
    """Large parameters (several pieces each), small ones (packed), buffers of other dtypes, an empty one."""

    def __init__(self, big: int = 700) -> None:
        super().__init__()
        self.big = torch.nn.Linear(1024, big)  # 2.8 MB of weight: pieces of its own
        self.small = torch.nn.Linear(7, 3)
        self.register_buffer("bf16", torch.randn(33, dtype=torch.bfloat16))
        self.register_buffer("count", torch.randint(0, 1 << 40, (5,), dtype=torch.int64))
        self.register_buffer("mask", torch.rand(9) > 0.5)
        self.register_buffer("empty", torch.zeros(0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(self.big(x)[:, :7])


def model_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + str(t.dtype).encode() + t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def state_hash(model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, int]) -> str:
    h = hashlib.sha256(repr(sorted(extra.items())).encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + str(t.dtype).encode() + t.reshape(-1).view(torch.uint8).numpy().tobytes())
    for idx, st in sorted(optimizer.state_dict()["state"].items()):
        for key, v in sorted(st.items()):
            h.update(f"{idx}.{key}".encode() + v.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class Counter:
    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.value = int(sd["value"])


def main() -> None:
    mode, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    pieces.PIECE_BYTES, pieces.OWN_PIECES_BYTES = 1 << 20, 256 << 10  # many pieces, several in flight
    helped = mode.startswith("helped")
    torch.manual_seed(0 if mode in ("helped", "helped-overlap") and rank == 1 else rank)
    model = Mixed(8192 if mode == "broken" else 700)  # broken: 64 MB of optimizer state still to come
    if mode.startswith("frozen"):  # a frozen base layer: alike on every rank, or rank 2's from another seed
        with torch.random.fork_rng():
            torch.manual_seed(7 if mode == "frozen-unlike" and rank == 2 else 99)
            model.base = torch.nn.Linear(512, 512).requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    counter = Counter(rank * 10)
    if rank == 0 or (helped and rank == 1):
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            model(torch.randn(4, 1024, generator=g)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    own = {name: p.data_ptr() for name, p in model.named_parameters()}
    print(
        f"BEFORE rank={rank} hash={state_hash(model, optimizer, counter.state_dict())} model={model_hash(model)}",
        flush=True,
    )
    if mode in ("overlap", "broken", "helped-overlap"):
        overlapped(mode, rank, model, optimizer, counter, own)
        return
    receivers = (2,) if mode in ("receivers", "pooled") or helped or mode.startswith("frozen") else None
    helpers = (0, 1) if helped else ()
    pool = ReceivePool.for_optimizer(optimizer) if mode == "pooled" and rank == 2 else None
    made = {t.data_ptr() for t in (pool.left() if pool is not None else [])}
    device = torch.device("cpu", 0) if mode == "pooled" else torch.device("cpu")
    sent = transfer.send_state(
        0, model, optimizer, {"counter": counter}, device, receivers, pool=pool, helpers=helpers
    ).sent
    in_place = all(p.data_ptr() == own[name] for name, p in model.named_parameters())
    moments = [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim()]
    pooled = bool(made) and len(moments) == len(made) and all(v.data_ptr() in made for v in moments)
    print(
        f"AFTER rank={rank} hash={state_hash(model, optimizer, counter.state_dict())} sent={sent} "
        f"in_place={in_place} counter={counter.value} pooled={pooled}",
        flush=True,
    )
    dist.destroy_process_group()


def overlapped(
    mode: str, rank: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, counter: Counter, own: dict
) -> None:
    cpu = torch.device("cpu")
    helpers = (0, 1) if mode == "helped-overlap" else ()
    pending = transfer.send_state(0, model, optimizer, {"counter": counter}, cpu, (2,), overlap=True, helpers=helpers)
    if mode == "broken" and rank == 0:
        os._exit(0)  # the source is gone with the optimizer's state still on its way
    arrived = model_hash(model)  # the model is in place before the optimizer's state
    if mode in ("overlap", "helped-overlap"):
        total = torch.ones(1)
        dist.all_reduce(total)  # a collective of the training step while the optimizer's state streams
    try:  # broken: gloo fails a receive from a dead sender at once, or never (then this bound ends it)
        pending.finish(5.0 if mode == "broken" else 60.0)
        error = "none"
    except transfer.TransferFailedError as exc:
        error = type(exc).__name__
    in_place = all(p.data_ptr() == own[name] for name, p in model.named_parameters())
    print(
        f"AFTER rank={rank} hash={state_hash(model, optimizer, counter.state_dict())} sent={pending.sent} "
        f"in_place={in_place} counter={counter.value} model_on_return={arrived} intact={pending.intact} "
        f"complete={pending.complete} error={error}",
        flush=True,
    )
    if mode == "broken":
        os._exit(0)  # a peer is gone: no group teardown to wait on
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
