"""The box's own rates between two processes, for ``bench/state_transfer.py``: gloo broadcast and raw loopback.

    python bench/workers/wire_rate.py --rank 0 --port P &  python bench/workers/wire_rate.py --rank 1 --port P

Rank 0 prints one JSON line: GB/s of a warm 1 GiB gloo broadcast in one piece and in 16 MiB pieces (the best of
``--repeat`` tries each), and of 1 GiB over a plain loopback TCP socket.
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

GIB = 1 << 30
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--repeat", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", a.port, 2, a.rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=a.rank, world_size=2)
    whole, pieces = gloo_rates(a.repeat)
    if a.rank == 1:
        dist.barrier()
        socket_rate(1, a.port + 1)
    else:
        raw = socket_rate(0, a.port + 1)
        print(json.dumps({"gloo_one_piece": whole, "gloo_16mib_pieces": pieces, "raw_socket": raw}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
