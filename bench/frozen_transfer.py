"""A join's state transfer for a model trained with adapters (LoRA): the frozen base held, against sent whole.

    python bench/frozen_transfer.py [--base-m 100,250] [--dtype bfloat16] [--repeat 3]

Two gloo processes on this machine (rank 0 the source, rank 1 a joiner that loaded the same frozen base, as
``from_pretrained`` does, and holds other adapters). The model: a frozen base of 2048x2048 linear layers of about
``--base-m`` million parameters, each with a trainable rank-16 adapter, AdamW over the adapters. Per size, the
sender's time of :func:`elastrain.live.transfer.send_state` to the joiner (best of ``--repeat``) two ways:
``held`` (elastrain: the frozen parameters checksummed on both sides and left out, the adapters and their
optimizer state sent) and ``whole`` (the base marked trainable for the call, so it is sent as it was before
``elastrain/live/frozen.py``); the bytes of each, and the box's own gloo broadcast rate of the base's bytes in the
same run. It checks that the joiner ends with the source's adapters either way. Prints a table and the ratio.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from elastrain.live.transfer import send_state

WIDTH, RANK = 2048, 16


class Adapted(torch.nn.Module):
    """A frozen base of ``layers`` linear layers, each with a trainable low-rank adapter beside it."""

    def __init__(self, layers: int, dtype: torch.dtype, adapter_seed: int) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same base on every rank (a from_pretrained)
        self.base = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH, dtype=dtype) for _ in range(layers))
        self.base.requires_grad_(False)
        torch.manual_seed(adapter_seed)
        self.down = torch.nn.ModuleList(torch.nn.Linear(WIDTH, RANK, bias=False) for _ in range(layers))
        self.up = torch.nn.ModuleList(torch.nn.Linear(RANK, WIDTH, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for base, down, up in zip(self.base, self.down, self.up, strict=True):
            x = base(x.to(base.weight.dtype)).float() + up(down(x.float()))
        return x


def one_size(base_m: int, dtype: torch.dtype, repeat: int, rank: int) -> dict[str, float] | None:
    layers = max(1, round(base_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    model = Adapted(layers, dtype, adapter_seed=rank)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    model(torch.randn(2, WIDTH)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    cpu = torch.device("cpu")
    out: dict[str, float] = {"layers": layers}
    for how in ("held", "whole"):
        model.base.requires_grad_(how == "whole")
        best = float("inf")
        for _ in range(repeat):
            dist.barrier()
            started = time.monotonic()
            sent = send_state(0, model, optimizer, {}, cpu, receivers=(1,)).sent
            dist.barrier()
            best = min(best, time.monotonic() - started)
        out[f"{how}_s"], out[f"{how}_bytes"] = best, float(sent)
        model.base.requires_grad_(False)
    adapters = torch.cat([p.detach().reshape(-1) for p in trainable])
    source = adapters.clone()
    dist.broadcast(source, 0)
    assert torch.equal(adapters, source), "the joiner's adapters differ from the source's"
    base_bytes = sum(p.numel() * p.element_size() for p in model.base.parameters())
    buf = torch.ones(base_bytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeat):
        dist.barrier()
        started = time.monotonic()
        dist.broadcast(buf, 0)
        dist.barrier()
        best = min(best, time.monotonic() - started)
    out["base_bytes"], out["gloo_gbs"] = float(base_bytes), base_bytes / best / 1e9
    return out if rank == 0 else None


def worker(rank: int, port: int, sizes: list[int], dtype: torch.dtype, repeat: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    rows = [one_size(size, dtype, repeat, rank) for size in sizes]
    dist.destroy_process_group()
    if rank:
        return
    print(f"dtype {dtype}; gloo: the box's broadcast of the base's bytes, the same run\n")
    print("| base params | base | held: sent, time | whole: sent, time | whole / held | gloo broadcast |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        assert r is not None
        params = r["layers"] * (WIDTH * WIDTH + WIDTH) / 1e6
        print(
            f"| {params:.1f}M | {r['base_bytes'] / 1e9:.2f} GB | {r['held_bytes'] / 1e6:.1f} MB, {r['held_s']:.3f} s | "
            f"{r['whole_bytes'] / 1e9:.2f} GB, {r['whole_s']:.3f} s | {r['whole_s'] / r['held_s']:.1f}x | "
            f"{r['gloo_gbs']:.2f} GB/s |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-m", default="100,250", help="frozen base sizes, millions of parameters, comma-separated")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    sizes, dtype = [int(x) for x in a.base_m.split(",") if x], getattr(torch, a.dtype)
    if a.rank is not None:
        worker(a.rank, a.port, sizes, dtype, a.repeat)
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, __file__, "--base-m", a.base_m, "--dtype", a.dtype, "--repeat", str(a.repeat)]
    peer = subprocess.Popen([*args, "--rank", "1", "--port", str(port)], env=env)
    try:
        subprocess.run([*args, "--rank", "0", "--port", str(port)], env=env, check=True, timeout=1800)
    finally:
        peer.wait(timeout=120)


if __name__ == "__main__":
    main()
