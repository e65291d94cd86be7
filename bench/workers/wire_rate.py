"""The box's own rates between two processes, for ``bench/state_transfer.py``: gloo broadcast and raw loopback,
and elastrain's state transfer in the same two processes.

    python bench/workers/wire_rate.py --rank 0 --port P &  python bench/workers/wire_rate.py --rank 1 --port P

Rank 0 prints one JSON line: GB/s of a warm 1 GiB gloo broadcast in one piece and in 16 MiB pieces (the best of
``--repeat`` tries each), and of 1 GiB over a plain loopback TCP socket. With ``--state-sizes`` (millions of
parameters), also the rate of :func:`elastrain.live.transfer.send_state` from rank 0 to rank 1 for the bench's
Session model of each size (2048x2048 linear layers with AdamW), nothing else running: received into rank 1's own
tensors (a member that rolls back), into memory a warm worker made ready while it waited (a joiner with a
:class:`~elastrain.live.receive_pool.ReceivePool`), and into new memory (a joiner without one). The best of
``--repeat`` tries each; the time is the sender's, from the call to the receiver's last piece (a barrier).
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from elastrain.live.receive_pool import ReceivePool
from elastrain.live.transfer import send_state

GIB = 1 << 30
WIDTH = 2048
"""The Session model's layers, as in bench/workers/transfer_worker.py."""
PIECE = 16 << 20


def gloo_rates(repeat: int) -> tuple[float, float]:
    buf = torch.ones(GIB, dtype=torch.uint8)  # touched: the rate of the wire, not of the page faults
    whole = pieces = float("inf")
    for _ in range(repeat):
        dist.barrier()
        t = time.monotonic()
        dist.broadcast(buf, src=0)
        dist.barrier()
        whole = min(whole, time.monotonic() - t)
        t = time.monotonic()
        for a in range(0, GIB, PIECE):
            dist.broadcast(buf[a : a + PIECE], src=0)
        dist.barrier()
        pieces = min(pieces, time.monotonic() - t)
    return GIB / whole / 1e9, GIB / pieces / 1e9


def socket_rate(rank: int, port: int) -> float:
    buf = bytearray(GIB)
    view = memoryview(buf)
    if rank == 1:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            got = 0
            while got < GIB:
                n = s.recv_into(view[got:], min(GIB - got, 1 << 24))
                if n == 0:
                    raise ConnectionError("the sender closed early")
                got += n
            s.sendall(b"k")
        return 0.0
    with socket.create_server(("127.0.0.1", port)) as server:
        server.settimeout(60)
        dist.barrier()  # the receiver connects once the server listens
        conn, _ = server.accept()
        with conn:
            t = time.monotonic()
            conn.sendall(view)
            conn.recv(1)
            return GIB / (time.monotonic() - t) / 1e9


def state_rates(sizes_m: list[int], rank: int, repeat: int) -> dict[str, dict[str, float]]:
    """GB/s of ``send_state`` rank 0 -> rank 1 per model size and destination (rank 0's answer; {} on rank 1)."""
    cpu = torch.device("cpu")
    found: dict[str, dict[str, float]] = {}
    for size in sizes_m:
        layers = max(1, round(size * 1e6 / (WIDTH * WIDTH + WIDTH)))
        torch.manual_seed(rank)
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model(torch.randn(2, WIDTH)).sum().backward()
        optimizer.step()  # the optimizer's state exists (rank 1's is overwritten in place, or replaced below)
        optimizer.zero_grad(set_to_none=True)
        best: dict[str, float] = {}
        for into in ("own tensors", "ready memory", "new memory"):
            for _ in range(repeat):
                pool = None
                if rank == 1 and into != "own tensors":
                    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)  # a joiner's: no state yet
                    if into == "ready memory":
                        pool = ReceivePool.for_optimizer(optimizer)
                        pool.ready(300.0)
                dist.barrier()
                started = time.monotonic()
                sent = send_state(0, model, optimizer, {}, cpu, receivers=(1,), pool=pool).sent
                dist.barrier()
                rate = sent / (time.monotonic() - started) / 1e9
                best[into] = max(best.get(into, 0.0), rate)
        best["bytes"] = float(sent)
        found[f"{layers * (WIDTH * WIDTH + WIDTH) / 1e6:.1f}"] = best
        del model, optimizer
    return found if rank == 0 else {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--state-sizes", default="", help="model sizes (millions of parameters) for send_state's rates")
    a = p.parse_args()
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", a.port, 2, a.rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=a.rank, world_size=2)
    whole, pieces = gloo_rates(a.repeat)
    states = state_rates([int(x) for x in a.state_sizes.split(",") if x], a.rank, a.repeat)
    if a.rank == 1:
        dist.barrier()
        socket_rate(1, a.port + 1)
    else:
        raw = socket_rate(0, a.port + 1)
        result = {"gloo_one_piece": whole, "gloo_16mib_pieces": pieces, "raw_socket": raw, "send_state": states}
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
