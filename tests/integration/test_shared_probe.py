"""check_shared as pure logic: two ranks as threads with an in-memory group, one directory or one each.

The same probe runs across two real agents in tests/integration/test_object_storage_shared_dir.py.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from elastrain.errors import CheckpointError
from elastrain.storage import PROBE_PREFIX, check_shared


class ThreadGroup:
    """The collectives check_shared needs, for ``world_size`` threads of one process."""

    def __init__(self, shared: dict[str, Any], rank: int, world_size: int) -> None:
        self.shared, self.rank, self.world_size = shared, rank, world_size

    def _exchange(self, obj: Any) -> list[Any]:
        barrier: threading.Barrier = self.shared["barrier"]
        slots: list[Any] = self.shared["slots"]
        slots[self.rank] = obj
        barrier.wait(timeout=10)
        out = list(slots)
        barrier.wait(timeout=10)
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        return self._exchange(obj)

    def broadcast(self, obj: Any) -> Any:
        return self._exchange(obj)[0]


def probe(roots: list[Path]) -> list[BaseException | None]:
    shared: dict[str, Any] = {"barrier": threading.Barrier(len(roots)), "slots": [None] * len(roots)}
    results: list[BaseException | None] = [None] * len(roots)

    def rank(r: int) -> None:
        try:
            check_shared(str(roots[r]), ThreadGroup(shared, r, len(roots)))
        except BaseException as e:
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(roots))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_one_shared_directory_passes_and_leaves_nothing(tmp_path: Path) -> None:
    assert probe([tmp_path, tmp_path, tmp_path]) == [None, None, None]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(PROBE_PREFIX)]


def test_a_directory_per_node_fails_on_every_rank_naming_the_flag(tmp_path: Path) -> None:
    roots = [tmp_path / "node-a", tmp_path / "node-a", tmp_path / "node-b"]
    results = probe(roots)
    assert all(isinstance(e, CheckpointError) for e in results), results
    message = str(results[2])
    assert message.startswith(f"--checkpoint-dir {roots[2]} is not one directory shared by all nodes")
    assert "rank 2 on" in message and "does not see the probe files of ranks 0-1" in message
    assert "rank 0 on" in message and "does not see the probe files of rank 2" in message
