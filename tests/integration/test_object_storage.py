"""Checkpoints, metrics and events on real object stores: S3 (moto's server) and Azure Blob (Azurite).

A 2-rank job through the real ``elastrain-run`` saves to ``s3://`` or ``az://``; the whole job is
SIGKILLed while one rank is in the middle of writing its shard of a save; a second run resumes
from the newest complete checkpoint and finishes. Both servers are started here on a free
127.0.0.1 port (never skipped) and configured only through the standard variables s3fs and adlfs
read (``AWS_ENDPOINT_URL``..., ``AZURE_STORAGE_CONNECTION_STRING``).
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
from support.azurite_server import AzuriteServer
from support.processes import REPO, alive, descendants, elastrain_cmd, kill_tree, reaped, run, spawn, wait_for
from support.s3_server import S3Server

from elastrain.checkpoint import layout
from elastrain.metrics import read_events, read_metrics
from elastrain.storage import join_path

WORKER = str(REPO / "tests" / "workers" / "object_storage_worker.py")
pytestmark = pytest.mark.slow


def _clear_fsspec_caches() -> None:
    import adlfs
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    adlfs.AzureBlobFileSystem.clear_instance_cache()


@pytest.fixture(params=["s3", "az"])
def store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, dict[str, str]]]:
    """``(root URL, environment)`` of a fresh bucket or container on a server started for this test."""
    server: S3Server | AzuriteServer
    server = S3Server(tmp_path / "moto") if request.param == "s3" else AzuriteServer(tmp_path / "azurite")
    with server:
        if isinstance(server, S3Server):
            url = f"s3://{server.make_bucket('elastrain-ckpt')}/run"
        else:
            url = f"az://{server.make_container('elastrain-ckpt')}/run"
        for k, v in server.env.items():
            monkeypatch.setenv(k, v)  # this process reads the store through the same variables
        _clear_fsspec_caches()
        yield url, server.env
        _clear_fsspec_caches()


def restored(out: str) -> int | None:
    line = next(line for line in out.splitlines() if line.startswith("RESTORED "))
    info = json.loads(line.split(" ", 1)[1])
    return None if info is None else int(info["step"])


def committed(url: str) -> list[int]:
    return [d.step for d in layout.list_step_dirs(url) if d.committed]


def test_sigkill_of_the_whole_job_mid_save_then_resume_on_object_storage(
    store: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    url, env = store
    cmd = elastrain_cmd("--nproc-per-node=2", f"--checkpoint-dir={url}", WORKER, "--max-steps=8", "--save-every=2")
    log = tmp_path / "first.log"
    job = spawn([*cmd, "--hang-step=6"], log, env=env, cwd=tmp_path)
    with reaped(job):
        wait_for(lambda: "IN_SAVE" in log.read_text(errors="replace") or job.poll() is not None, 90, what="IN_SAVE")
        assert job.poll() is None, log.read_text()
        victims = kill_tree(job.pid, signal.SIGKILL)  # the agent and both workers at once
        assert len(victims) >= 3, descendants(job.pid)
        job.wait(timeout=10)
        wait_for(lambda: not alive(victims), 10, what="the killed job to be gone")
    first = log.read_text(errors="replace")
    assert restored(first) is None, first
    # Steps 2 and 4 are committed; 6 was cut in the middle of rank 1's shard: never committed.
    assert committed(url) == [2, 4], first
    assert not (tmp_path / f"{url.split(':', 1)[0]}:").exists(), "a URL was taken for a local path"

    # adlfs serves az:// and abfs:// alike: the Azure resume names the same container the other way.
    again = url.replace("az://", "abfs://", 1)
    resume = elastrain_cmd("--nproc-per-node=2", f"--checkpoint-dir={again}", WORKER, "--max-steps=8", "--save-every=2")
    proc = run(resume, timeout=120, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert restored(out) == 4, out
    assert "DONE 8" in out, out
    assert [(d.step, d.committed) for d in layout.list_step_dirs(url)] == [(4, True), (6, True), (8, True)], out
    for d in layout.list_step_dirs(url):
        layout.verify_step(d.path)

    # Metrics continue on the URL: every step once, the killed start's points past step 4 superseded.
    history = read_metrics(join_path(url, "metrics.jsonl"))
    assert len(history.segments) == 2, history
    assert history.restored_steps[history.segments[1]] == 4
    assert [s for s, _ in history.series("loss")] == list(range(1, 9)), history
    assert all(p.step > 4 for p in history.superseded), history.superseded
    # The resume merged the killed start's parts into one (object stores have no append; see elastrain.metrics.lines).
    fs, folder = fsspec.core.url_to_fs(join_path(url, "metrics.jsonl"))
    names = [str(p).rsplit("/", 1)[-1] for p in fs.find(folder)]
    assert sum("-compacted-" in n for n in names) == 1, names
    events = join_path(url, "events.jsonl")
    assert [e.get("restored_step", None) for e in read_events(events, "start")] == [None, 4]
    assert [e["step"] for e in read_events(events, "restore")] == [4]
    assert 8 in [e["step"] for e in read_events(events, "checkpoint")]
