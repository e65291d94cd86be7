"""The control channel's writers on several threads at once never collide."""

from __future__ import annotations

import threading
from pathlib import Path

from elastrain.control import ControlChannel, SaveCause


def test_writers_on_many_threads_at_once_never_collide(tmp_path: Path) -> None:
    """The agent's main loop and a preemption watcher may write save-request.json at the same moment: every
    write succeeds, every request gets its own id, and no temporary file is left behind."""
    agent = ControlChannel(tmp_path)
    threads, rounds = 8, 40
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []
    ids: list[int] = []

    def write() -> None:
        try:
            for _ in range(rounds):
                barrier.wait(timeout=60)
                ids.append(agent.request_save(SaveCause.LEAVE, threading.current_thread().name).request_id)
                agent.ack(1, "ckpt", 1.0)  # another file, also written from every thread
        except BaseException as exc:  # reported below
            errors.append(exc)

    workers = [threading.Thread(target=write) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in workers)
    assert errors == []
    assert sorted(ids) == list(range(1, threads * rounds + 1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["save-ack.json", "save-request.json"]
    current = ControlChannel(tmp_path).current_request()
    assert current is not None and current.request_id in ids
