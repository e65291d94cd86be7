"""Probe a peer by the name it advertises, as an agent does, then SIGKILL it: what the probe and the death watch read.

    python tests/workers/probe_names.py NAME [LISTEN]

A child process listens on its probe port as an agent does: on ``binding.listen_host(NAME)`` (the address of this
machine's interfaces NAME resolves to), or on LISTEN when given. This process then probes ``(NAME, port)``
(``liveness.refused``) and watches it (``DeathWatch``) while the child lives, SIGKILLs it, and does both again. It
prints one JSON line: where the child listened and what each read.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

from elastrain.rendezvous import liveness
from elastrain.rendezvous.death_watch import DeathWatch

_CHILD = """
import sys, time
from elastrain import binding
from elastrain.rendezvous.liveness import ProbeListener
host = sys.argv[2] if len(sys.argv) > 2 else binding.listen_host(sys.argv[1])
listener = ProbeListener(host)
print(host, listener.port, flush=True)
time.sleep(600)
"""


def main() -> None:
    name = sys.argv[1]
    child = subprocess.Popen([sys.executable, "-c", _CHILD, *sys.argv[1:]], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    host, port = child.stdout.readline().split()
    target = {"peer": (name, int(port))}
    wake = threading.Event()
    watch = DeathWatch(wake, rearm_s=60.0)
    try:
        out: dict[str, object] = {"listened_on": host}
        out["refused_alive"] = sorted(liveness.refused(target, 2.0))
        watch.follow(target)
        out["woke_alive"] = wake.wait(1.0)
        wake.clear()
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        out["woke_dead"] = wake.wait(10.0)
        out["closed"] = sorted(watch.closed())
        out["refused_dead"] = sorted(liveness.refused(target, 2.0))
    finally:
        watch.close()
        child.kill()
        child.wait(timeout=10)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
