"""Checkpoint bench: what a save and a load cost, next to the disk's own rates and torch.save.

    python bench/checkpoint.py                 # 2 ranks, 8 x Linear(2048, 2048) + AdamW = 403 MB
    python bench/checkpoint.py --hidden 512    # a quick, smaller run

Ranks are started with torch.multiprocessing (gloo on CPU); the model is FSDP2-sharded. Times are
medians over --repeats; every save goes to a fresh step directory, fsynced, with CRC-32s. The disk's own
rates are measured in the same run, every rank at once with its share of the checkpoint's bytes: a write
and fsync, and a read of that file with its pages dropped from the page cache first (``posix_fadvise``
``DONTNEED``). The restore is measured the same way, cold, its files' pages dropped before it reads them.

It also prints the bytes read per save and per restore (all ranks, from /proc/self/io ``rchar``):
elastrain's method (CRC-32s computed while writing, checked while loading) against the method it
replaced (read every file back to checksum it after the save; verify, then load, at restore). And
it compares elastrain's background writer thread with torch's ``dcp.async_save`` on the process-based
checkpointer (``AsyncCheckpointerType.PROCESS``) and the default stager: the training stall, the
step time while the write runs, and the peak memory (resident, this process and its children).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastrain import binding
from elastrain.checkpoint import Checkpointer, layout
from elastrain.checkpoint.checkpointer import DEFAULT_INTERVAL_SECONDS


def build(hidden: int, layers: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, hidden: int) -> None:
    model(torch.randn(8, hidden)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def timed(fn: Callable[[], object]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def disk_rates(path: Path, nbytes: int) -> tuple[float, float]:
    """Seconds for every rank to write and fsync its share of ``nbytes`` at once, then to read it back cold."""
    share = nbytes // dist.get_world_size()
    block = os.urandom(8 << 20)
    file = path / f"disk-{dist.get_rank()}.bin"

    def write() -> None:
        with open(file, "wb") as f:
            left = share
            while left > 0:
                f.write(block[: min(left, len(block))])
                left -= len(block)
            f.flush()
            os.fsync(f.fileno())

    def read() -> None:
        buf = bytearray(8 << 20)
        with open(file, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    wrote = timed(write)
    drop_cached(file)
    read_s = timed(read)
    os.remove(file)
    return wrote, read_s


def drop_cached(path: Path) -> None:
    """Drop a file's (or every file's under a folder) clean pages from the page cache: the next read is cold."""
    for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rchar() -> int:
    """Bytes this process read so far through read() calls (page cache included)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def bytes_read(fn: Callable[[], object]) -> int:
    """Bytes all ranks read while running ``fn`` (collective)."""
    before = rchar()
    fn()
    t = torch.tensor([rchar() - before])
    dist.all_reduce(t)
    return int(t.item())


class PeakMemory:
    """Samples the resident memory of this process and its children (a process-based writer) every 10 ms."""

    def __init__(self) -> None:
        self._me = psutil.Process()
        self.baseline = self.now()
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        total = self._me.memory_info().rss
        for child in self._me.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                total += child.memory_info().rss
        return int(total)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.now())

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def bytes_section(root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, float]:
    """Bytes read per save and per restore: elastrain's method, and the read-back it replaced."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with Checkpointer(root / "bytes", keep_last=1, async_save=False, interval_seconds=math.inf) as ck:
        ck.register(model=model, optimizer=opt)
        save_new = bytes_read(lambda: ck.save(1, blocking=True))
    path = str(root / "bytes" / layout.step_dir_name(1))
    files = sorted(layout.read_commit_marker(path).files)
    # The old save read every file back (each rank a share) to compute the marker's CRC-32s.
    readback = bytes_read(lambda: layout.manifest(path, layout.share(files, rank, world), True))
    # The old restore verified every file (each rank a share) and then loaded.
    verify_old = bytes_read(lambda: layout.verify_step(path, True, rank, world))
    with Checkpointer(root / "bytes", keep_last=1) as ck:
        ck.register(model=model, optimizer=opt)
        restore_new = bytes_read(ck.restore)
    size = sum(layout.read_commit_marker(path).files[f].size for f in files)
    return {
        "ckpt_bytes": size,
        "save_new": save_new,
        "save_old": save_new + readback,
        "restore_new": restore_new,
        "restore_old": verify_old + restore_new,
    }


def async_section(
    root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace
) -> dict[str, Any]:
    """elastrain's writer thread against dcp.async_save with the process checkpointer and the default stager."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse, async_save

    def steps_while(done: Callable[[], bool]) -> tuple[float, int]:
        """Train until ``done()`` on every rank (at most 200 steps); mean step time and steps run."""
        n, t0 = 0, time.perf_counter()
        while n < 200:
            flag = torch.tensor([0 if done() else 1])
            dist.all_reduce(flag)
            if int(flag.item()) == 0:
                break
            train_step(model, opt, args.hidden)
            n += 1
        return (time.perf_counter() - t0) / max(n, 1), n

    def plain_step_s() -> float:
        t0 = time.perf_counter()
        for _ in range(args.every):
            train_step(model, opt, args.hidden)
        return (time.perf_counter() - t0) / args.every

    Start = Callable[[int], tuple[float, Callable[[], bool], Callable[[], float]]]

    def measure(start: Start) -> list[dict[str, float]]:
        """The first save and --repeats more: stall, step time while writing (vs a plain block just before), memory.

        ``start(i)`` saves and returns (seconds training waited, whether the write is done, finish); ``finish()``
        waits for the write and returns how long a training step waited for it meanwhile.
        """
        rows = []
        for i in range(1 + args.repeats):
            plain = plain_step_s()
            dist.barrier()
            with PeakMemory() as mem:
                stall, done, finish = start(i)
                during, n = steps_while(done)
                stall += finish()
            rows.append(
                {
                    "stall": stall,
                    "slowdown": during / plain - 1 if n else math.nan,
                    "steps": n,
                    "peak_mb": (mem.peak - mem.baseline) / 1e6,
                }
            )
        return rows

    out: dict[str, Any] = {"stager_error": None}
    # elastrain: save() returns after staging what the next step can change; optimizer.step() waits for the rest.
    with Checkpointer(root / "el-async", keep_last=1, interval_seconds=math.inf) as ck:
        ck.register(model=model, optimizer=opt)

        def elastrain_start(i: int) -> tuple[float, Callable[[], bool], Callable[[], float]]:
            waited0, t0 = ck._stager.waited_s, time.perf_counter()
            ck.save(i + 1)
            stall = time.perf_counter() - t0

            def finish() -> float:
                ck.wait()
                return ck._stager.waited_s - waited0  # the next optimizer.step() waiting for the overlapped copy

            return stall, lambda: ck._inflight is None or ck._inflight.done(), finish

        out["step_s"] = plain_step_s()
        out["elastrain"] = measure(elastrain_start)

    # torch: dcp.async_save, process-based checkpointer, default stager (pinned/shared memory, async staging).
    def torch_start(i: int) -> tuple[float, Callable[[], bool], Callable[[], float]]:
        msd, osd = get_state_dict(model, [opt])
        state = {"model": msd, "optimizer": osd}
        try:
            stager = DefaultStager()
        except (RuntimeError, AssertionError) as e:  # no accelerator: fall back to the CPU-only options
            out["stager_error"] = f"{type(e).__name__}: {e}"
            stager = DefaultStager(StagingOptions(False, True, True, False))
        t0 = time.perf_counter()
        resp = async_save(
            state,
            storage_writer=FileSystemWriter(str(root / "torch-async" / f"step-{i}")),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=stager,
        )
        if isinstance(resp, AsyncSaveResponse):
            resp.staging_completion.result()  # training may change the state only after this
            upload = resp.upload_completion
        else:
            upload = resp
        stall = time.perf_counter() - t0

        def finish() -> float:
            upload.result()
            stager.close()
            return 0.0

        return stall, upload.done, finish

    out["torch"] = measure(torch_start)
    return out


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    root = Path(args.dir)
    model, opt = build(args.hidden, args.layers, world)
    train_step(model, opt, args.hidden)
    local = sum(p.to_local().numel() for p in model.parameters())  # type: ignore[operator]
    nbytes_t = torch.tensor([local * 4 * 3])  # parameters + exp_avg + exp_avg_sq, fp32
    dist.all_reduce(nbytes_t)
    nbytes = int(nbytes_t.item())
    keys = ("disk", "disk_read", "sync", "stall", "async", "load", "torch_save")
    res: dict[str, list[float]] = {k: [] for k in keys}
    # One checkpointer of each kind for all repeats, as in training (the staging buffers are reused).
    sync_ck = Checkpointer(root / "sync", keep_last=1, async_save=False, interval_seconds=math.inf)
    async_ck = Checkpointer(root / "async", keep_last=1, interval_seconds=math.inf)
    for ck in (sync_ck, async_ck):
        ck.register(model=model, optimizer=opt)
    for step in range(1, args.repeats + 1):
        wrote, read = disk_rates(root, nbytes)
        res["disk"].append(wrote)
        res["disk_read"].append(read)
        res["sync"].append(timed(lambda s=step: sync_ck.save(s, blocking=True)))  # type: ignore[misc]
        dist.barrier()
        t0 = time.perf_counter()
        async_ck.save(step)
        stall = time.perf_counter() - t0
        async_ck.wait()
        dist.barrier()
        res["stall"].append(stall)
        res["async"].append(time.perf_counter() - t0)
        with Checkpointer(root / "async", keep_last=1) as ck:
            ck.register(model=model, optimizer=opt)
            os.system("sync")
            drop_cached(root / "async")
            res["load"].append(timed(ck.restore))

        def torch_save() -> None:
            msd, osd = get_state_dict(model, [opt], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:
                with open(root / "full.pt", "wb") as f:
                    torch.save({"model": msd, "optim": osd}, f)
                    f.flush()
                    os.fsync(f.fileno())

        res["torch_save"].append(timed(torch_save))
    sync_ck.close()
    async_ck.close()

    # Training overhead: alternate blocks of --every steps without and with a save (at the block's
    # first step, committed within the block), so that drifts in machine load cancel out pairwise.
    def block(ck: Checkpointer | None, first: int) -> float:
        def run() -> None:
            for i in range(first, first + args.every):
                train_step(model, opt, args.hidden)
                if ck is not None and i == first:
                    ck.save(i)
            if ck is not None:
                ck.wait()

        return timed(run)

    block(None, 0)  # warm up
    pairs = []
    with Checkpointer(root / "train", keep_last=1, interval_seconds=math.inf) as ck:
        ck.register(model=model, optimizer=opt)
        for b in range(args.pairs):
            plain = block(None, 0)
            with_save = block(ck, (b + 1) * args.every)
            pairs.append((plain, with_save))
        step_wait = ck.last_result.step_wait_s if ck.last_result else 0.0
        # The agreement maybe_save() runs every step (one all_reduce of two flags).
        t0 = time.perf_counter()
        for _ in range(100):
            ck._sync.all_max([0, 0])
        agree = (time.perf_counter() - t0) / 100
    byte_counts = bytes_section(root, model, opt)
    comparison = async_section(root, model, opt, args) if args.torch_async else {}
    if rank == 0:
        out.update(byte_counts)
        out["async_compare"] = comparison
        out.update({k: statistics.median(v) for k, v in res.items()})
        out.update(nbytes=nbytes, agree=agree, step_wait=step_wait)
        out.update(step_s=statistics.median(p for p, _ in pairs) / args.every)
        out.update(per_save=statistics.median(w - p for p, w in pairs))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--hidden", type=int, default=2048, help="Linear width (default 2048: 403 MB with AdamW)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pairs", type=int, default=3, help="block pairs (without / with a save) for the overhead")
    p.add_argument("--every", type=int, default=5, help="steps per block: one save every this many steps")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument(
        "--torch-async",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compare with dcp.async_save (process checkpointer, default stager); --no-torch-async skips it",
    )
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="elastrain-bench-", dir=args.dir) as tmp:
        args.dir = tmp
        port = binding.free_port("127.0.0.1")
        manager = mp.Manager()
        out = manager.dict()
        mp.spawn(worker, args=(args.nproc, port, args, out), nprocs=args.nproc, join=True)
        r = dict(out)
    mb = r["nbytes"] / 1e6
    sync = r["sync"]
    model = f"{args.layers} x Linear({args.hidden}, {args.hidden}) + AdamW"
    print(f"checkpoint bench: {args.nproc} ranks, {model} = {mb:.0f} MB")
    print(f"medians of {args.repeats}; every save fsynced and CRC-32-checked; load includes verification\n")
    rows = [
        ("disk write (limit)", r["disk"], f"{mb / r['disk'] / 1e3:.2f} GB/s"),
        ("disk read, cold (limit)", r["disk_read"], f"{mb / r['disk_read'] / 1e3:.2f} GB/s"),
        ("sync save", sync, f"{mb / sync / 1e3:.2f} GB/s, {sync / r['disk']:.2f}x disk"),
        ("async save: stall", r["stall"], f"{100 * r['stall'] / sync:.1f}% of sync save (target <= 10%)"),
        ("  + next step's wait", r["step_wait"], "optimizer.step() waiting for the overlapped copy"),
        ("async save: total", r["async"], f"{r['async'] / sync:.2f}x sync save"),
        (
            "load (restore), cold",
            r["load"],
            f"{mb / r['load'] / 1e3:.2f} GB/s, {r['load'] / r['disk_read']:.2f}x disk read",
        ),
        ("torch.save from rank 0", r["torch_save"], f"{r['torch_save'] / sync:.2f}x sync save"),
    ]
    for name, secs, note in rows:
        print(f"  {name:<24} {secs:8.3f} s   {note}")
    step_s, per_save = r["step_s"], r["per_save"]
    print(f"\ntraining: {step_s:.3f} s/step without checkpoints (median of {args.pairs} blocks of {args.every} steps)")
    print(
        f"  one async save per block: {per_save:+.3f} s per save (median of block pairs), "
        f"= {100 * per_save / (args.every * step_s):.1f}% at a save every {args.every} steps"
    )
    default_pct = 100 * (per_save / DEFAULT_INTERVAL_SECONDS + r["agree"] / step_s)
    print(
        f"  default interval ({DEFAULT_INTERVAL_SECONDS:.0f} s): {per_save:.3f} s per save + agreement "
        f"{1e3 * r['agree']:.2f} ms/step = {default_pct:.2f}% overhead (target <= 5%)"
    )
    ck_mb = r["ckpt_bytes"] / 1e6
    print(f"\nbytes read, all ranks (checkpoint = {ck_mb:.1f} MB; /proc/self/io rchar):")
    print(f"  {'':<12} {'read-back (old)':>16} {'while writing (new)':>20}")
    for name, old, new in (
        ("per save", r["save_old"], r["save_new"]),
        ("per restore", r["restore_old"], r["restore_new"]),
    ):
        print(f"  {name:<12} {old / 1e6:13.1f} MB {new / 1e6:17.1f} MB")
    a = r.get("async_compare") or {}
    if a:
        print(
            "\nasync save, elastrain's writer thread vs dcp.async_save(PROCESS, default stager); "
            f"plain step {a['step_s']:.3f} s; first save, then the median of {args.repeats}"
        )
        if a.get("stager_error"):
            print(f"  (default stager failed here: {a['stager_error']}; used pinned=False, shared=True, async=True)")
        print(f"  {'':<26} {'stall':>8} {'step during write':>18} {'peak memory':>12}")
        for key, label in (("elastrain", "elastrain thread"), ("torch", "torch process")):
            rows = a[key]
            for name, picked in (("1st", [rows[0]]), ("then", rows[1:] or rows)):
                m = {k: statistics.median(x[k] for x in picked) for k in ("stall", "slowdown", "steps", "peak_mb")}
                print(
                    f"  {label + ', ' + name:<26} {m['stall']:7.3f}s {100 * m['slowdown']:+8.0f}% "
                    f"({m['steps']:.0f} steps) {m['peak_mb']:9.0f} MB"
                )


if __name__ == "__main__":
    main()
