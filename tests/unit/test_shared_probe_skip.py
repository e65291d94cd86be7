"""check_shared skips the probe where it has nothing to compare: URLs, and a single process (no collectives run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from elastrain.storage import check_shared


class NoCollectives:
    """A group of ``world_size`` whose collectives fail: the probe must not call them here."""

    rank = 0

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def all_gather(self, obj: Any) -> list[Any]:
        raise AssertionError("all_gather called")

    def broadcast(self, obj: Any) -> Any:
        raise AssertionError("broadcast called")


@pytest.mark.parametrize("root", ["s3://bucket/run", "az://container/run"])
def test_urls_and_single_processes_skip_the_probe(root: str, tmp_path: Path) -> None:
    group = NoCollectives(2)  # any collective fails: there is no second rank
    check_shared(root, group)
    check_shared(str(tmp_path), NoCollectives(1))
