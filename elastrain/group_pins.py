"""The default process group kept referenced from Python until the worker exits, so that it is never freed with
the GIL held.

DDP's ``Reducer`` keeps the process group its model syncs over. Once a script destroys that group itself
(``Trainer.end()`` and accelerate's ``end_training`` call ``destroy_process_group``), the ``Reducer`` holds the
group's last reference, and freeing the model (the script's ``main`` returning) frees the group in the
``Reducer``'s destructor, which pybind runs with the GIL held. gloo's destructor joins its threads; a thread still
freeing the script's last collective (an all-gather's tensors, whose Python objects need the GIL) then waits for the
GIL forever, and the worker hangs after its script returned, deaf to SIGTERM (seen here: TRL's DPO and SFT scripts,
which end with ``trainer.end()``, in 3 runs of 11 on a loaded box; pytorch#56297 describes the destructor).

A group pinned here outlives the model: its last reference goes when the pins are released at exit, from Python,
whose ``ProcessGroup`` releases the GIL before its destructor runs; gloo's threads then finish what they hold.
"""

from __future__ import annotations

import atexit
import gc
import threading

import torch.distributed as dist

_lock = threading.Lock()
_pinned: dict[int, dist.ProcessGroup] = {}


def pin_default_group() -> None:
    """Keep the current default process group referenced until the process exits (a no-op without one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    group = dist.group.WORLD
    if group is None:
        return
    with _lock:
        _pinned.setdefault(id(group), group)


def pinned() -> int:
    """How many groups are pinned."""
    with _lock:
        return len(_pinned)


def release_pins() -> None:
    """Let the pinned groups go (at exit): first the garbage that may hold them (a model's ``Reducer`` in a
    reference cycle, freed here with the group still pinned), then the pins themselves, from Python."""
    gc.collect()
    with _lock:
        groups = list(_pinned.values())
        _pinned.clear()
    del groups  # each ProcessGroup's destructor runs here, with the GIL released


# Registered at import, before any hook of the objects that pin (atexit runs hooks last-registered-first): the
# pins go after the live group drained and the checkpointer destroyed its groups.
atexit.register(release_pins)
