"""Through the real elastrain-run: a worker forked by the zygote ends exactly as the same script ends when
started the normal way (``--zygote false``, as torchrun starts it): ``atexit`` handlers run after the
non-daemon threads are joined, a file left open and unflushed keeps its tail, stdio is flushed, and
``sys.exit`` codes and messages and uncaught exceptions give the same exit code and the same output."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.processes import elastrain_cmd, run

pytestmark = pytest.mark.slow

SCRIPT = r"""
import atexit, os, sys, threading, time

out, mode = sys.argv[1], sys.argv[2]


def note(name, text):
    with open(os.path.join(out, name), "w") as f:
        f.write(text)


joined = threading.Event()


def late():
    time.sleep(0.3)  # still running when the script's body ends: the interpreter must wait for it
    joined.set()
    note("thread", "done")


atexit.register(lambda: note("atexit", f"after the thread: {joined.is_set()}"))
left_open = open(os.path.join(out, "unflushed.txt"), "w")
left_open.write("the tail of a buffer nobody flushed")
threading.Thread(target=late).start()
print("stdout without a newline", end="")
print("stderr without a newline", end="", file=sys.stderr)
if mode == "exit3":
    sys.exit(3)
if mode == "exit_message":
    sys.exit("a message for stderr")
if mode == "raise":
    raise RuntimeError("boom from the script")
"""


def _observe(tmp_path: Path, zygote: str, mode: str) -> dict[str, object]:
    """What one run leaves behind: the files, the worker's exit code, and what it printed."""
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"out-{zygote}"
    out.mkdir()
    proc = run(
        elastrain_cmd("--standalone", "--nproc-per-node", "1", "--zygote", zygote, "probe.py", str(out), mode),
        timeout=240,
        cwd=tmp_path,
    )
    text = proc.stdout + proc.stderr
    exit_code = re.search(r"exitcode\s*:\s*(-?\d+)", text)
    traceback = re.search(r"Traceback \(most recent call last\):\n(?:  .*\n)+RuntimeError: boom from the script", text)
    return {
        "files": {p.name: p.read_text() for p in sorted(out.iterdir())},
        "agent_exit_code": proc.returncode,
        "worker_exit_code": int(exit_code.group(1)) if exit_code else 0,
        "stdout": "stdout without a newline" in proc.stdout,
        "stderr": "stderr without a newline" in proc.stderr,
        "message": "a message for stderr" in proc.stderr,
        "traceback": traceback.group(0) if traceback else None,
        "zygote_used": "zygote_ready" in text and "zygote_skipped" not in text,
    }


@pytest.mark.parametrize(("mode", "worker_exit_code"), [("ok", 0), ("exit3", 3), ("exit_message", 1), ("raise", 1)])
def test_a_forked_worker_exits_as_the_same_script_started_the_normal_way(
    tmp_path: Path, mode: str, worker_exit_code: int
) -> None:
    forked = _observe(tmp_path, "true", mode)
    normal = _observe(tmp_path, "false", mode)
    assert forked.pop("zygote_used") is True and normal.pop("zygote_used") is False, (forked, normal)
    assert forked == normal
    assert normal["worker_exit_code"] == worker_exit_code
    assert normal["files"] == {
        "atexit": "after the thread: True",
        "thread": "done",
        "unflushed.txt": "the tail of a buffer nobody flushed",
    }
    assert normal["stdout"] and normal["stderr"] and normal["message"] == (mode == "exit_message")
    if mode == "raise":  # the script's own frames only, naming the script by its absolute path
        assert f'File "{tmp_path / "probe.py"}", line' in str(normal["traceback"]), normal["traceback"]
    else:
        assert normal["traceback"] is None
