import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from support.trainer_trace import References

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1]))  # bench.support: helpers bench and tests share


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """In CI (CI=true) a skipped test is a failure: everything the suite needs is installed by ./dev."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI", "").lower() in ("1", "true", "yes") and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, which must run every test: {report.longrepr}"


def _shared_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every test process of this session shares (pytest-xdist gives each worker a folder under it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def hf_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/hf's tiny models and data (local files), made once per session."""
    from support.trainer_trace import make_assets

    return make_assets(_shared_tmp(tmp_path_factory) / "hf-assets")


@pytest.fixture(scope="session")
def hf_references(tmp_path_factory: pytest.TempPathFactory) -> "References":
    """Uninterrupted runs of examples/hf's scripts, each run once per session."""
    from support.trainer_trace import References

    return References(_shared_tmp(tmp_path_factory) / "hf-references")


@pytest.fixture
def logged() -> Iterator[list[str]]:
    """The elastrain log lines written during the test (whatever configured the logger before)."""
    lines: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger, handler = logging.getLogger("elastrain"), _Keep()
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
