"""Through the real elastrain-run: the zygote preloads the script's top-level imports, and nothing it
preloads can stop a start (a module that fails to import, a module that starts a thread at import)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from support.processes import REPO, elastrain_cmd, run

from elastrain.log import parse_event_line

pytestmark = pytest.mark.slow

# Modules of a "site-packages" on PYTHONPATH; none of them is imported by torch or elastrain.
LIB = {
    "zyg_marker_mod.py": "import os\nIMPORTED_BY = os.getpid()\n",
    "zyg_after_mod.py": "",
    "zyg_broken_mod.py": "raise RuntimeError('zyg_broken_mod refuses to import')\n",
    "zyg_thread_mod.py": "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=1).start()\n",
}
PROBE = ("zyg_marker_mod", "zyg_thread_mod", "zyg_after_mod", "zyg_local_mod")


def _job(tmp_path: Path, imports: list[str], *flags: str) -> tuple[int, str, dict[str, str]]:
    """Run a one-worker job whose script reports, before its own imports, which probe modules it
    found in sys.modules; returns the exit code, the output and the report."""
    lib = tmp_path / "lib"
    lib.mkdir(exist_ok=True)
    for name, text in LIB.items():
        (lib / name).write_text(text)
    app = tmp_path / "app"
    app.mkdir(exist_ok=True)
    (app / "zyg_local_mod.py").write_text("")  # the script's own module: never preloaded
    script = app / "worker.py"
    lines = [
        "import sys",
        f"FOUND = [m for m in {PROBE!r} if m in sys.modules]  # the first thing the worker does",
        "import os",
        "import zyg_local_mod",
        "import zyg_marker_mod",
        *imports,
        'print("report found=" + (",".join(FOUND) or "-") + " marker_from_zygote="',
        "      + str(zyg_marker_mod.IMPORTED_BY != os.getpid()), flush=True)",
    ]
    script.write_text("\n".join(lines) + "\n")
    proc = run(
        elastrain_cmd("--standalone", "--nproc-per-node", "1", *flags, str(script)),
        timeout=300,
        env={"PYTHONPATH": os.pathsep.join([str(lib), str(REPO)])},
        cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    match = re.search(r"report found=(\S+) marker_from_zygote=(\S+)", out)
    report = {"found": match.group(1), "marker_from_zygote": match.group(2)} if match else {}
    return proc.returncode, out, report


def _events(out: str, name: str) -> list[dict[str, str]]:
    return [e for e in map(parse_event_line, out.splitlines()) if e is not None and e.get("event") == name]


def test_a_forked_worker_finds_the_script_imports_already_loaded(tmp_path: Path) -> None:
    code, out, report = _job(tmp_path, ["import zyg_after_mod"])  # --zygote is on by default
    assert code == 0, out
    assert report == {"found": "zyg_marker_mod,zyg_after_mod", "marker_from_zygote": "True"}, out
    (ready,) = _events(out, "zygote_ready")
    assert ready["preloaded"].split(",") == ["os", "zyg_marker_mod", "zyg_after_mod"], out


def test_zygote_false_starts_workers_that_import_everything_themselves(tmp_path: Path) -> None:
    code, out, report = _job(tmp_path, ["import zyg_after_mod"], "--zygote", "false")
    assert code == 0, out
    assert report == {"found": "-", "marker_from_zygote": "False"}, out
    assert not _events(out, "zygote_ready")


def test_a_broken_import_is_skipped_and_the_worker_fails_with_its_own_traceback(tmp_path: Path) -> None:
    code, out, report = _job(tmp_path, ["import zyg_broken_mod"])
    assert code != 0 and not report, out
    (failed,) = _events(out, "zygote_preload_failed")
    assert failed["module"] == "zyg_broken_mod" and "RuntimeError" in failed["error"], out
    assert _events(out, "zygote_ready") and _events(out, "workers_started"), out
    # The worker was forked, imported the module itself and failed the normal way: its traceback.
    assert "Traceback" in out and "zyg_broken_mod refuses to import" in out, out
    assert 'File "' + str(tmp_path / "app" / "worker.py") in out, out


def test_a_module_that_starts_a_thread_at_import_is_not_preloaded(tmp_path: Path) -> None:
    # zyg_marker_mod comes before the unsafe module (kept), zyg_after_mod after it (not preloaded).
    code, out, report = _job(tmp_path, ["import zyg_thread_mod", "import zyg_after_mod"])
    assert code == 0, out
    (unsafe,) = _events(out, "zygote_preload_unsafe")
    assert unsafe["module"] == "zyg_thread_mod" and "thread" in unsafe["why"], out
    (ready,) = _events(out, "zygote_ready")  # from the restarted zygote
    assert ready["preloaded"].split(",") == ["os", "zyg_marker_mod"], out
    assert report == {"found": "zyg_marker_mod", "marker_from_zygote": "True"}, out


def test_datasets_and_transformers_are_preloaded(tmp_path: Path) -> None:
    """The imports of every Hugging Face example: pyarrow's jemalloc starts a thread as it loads, unless told not to
    (the zygote does): the zygote preloads datasets and what comes after it, and does not restart."""
    code, out, _ = _job(tmp_path, ["import datasets", "import transformers", "import zyg_after_mod"])
    assert code == 0, out
    assert not _events(out, "zygote_preload_unsafe"), out
    (ready,) = _events(out, "zygote_ready")
    assert ready["preloaded"].split(",") == ["os", "zyg_marker_mod", "datasets", "transformers", "zyg_after_mod"], out
