"""A job whose every member died with its store host starts over from a newcomer (c10d, real TCPStores).

The world's store is published with its fencing claim in the checkpoint root; a node that starts later
finds it there. When that world dies (its one member, which hosted the store, SIGKILLed) before the
newcomer joined a round, the newcomer knows no successor: it keeps looking for a live published store
for ``refound_after``, then starts the job over at its ``--rdzv-endpoint`` under the next generation.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest
from support.processes import PYTHON, free_port, reaped, wait_for, worker_env
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastrain import fence
from elastrain.rendezvous.backends.c10d import create_c10d_handler
from elastrain.rendezvous.handler import ElastrainRendezvousHandler

FAST = {"heartbeat_interval": "0.1", "heartbeat_timeout": "1", "last_call_timeout": "0.3"}

WORLD = textwrap.dedent(
    """
    import sys, time
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from elastrain.rendezvous.backends.c10d import create_c10d_handler
    params = RendezvousParameters(backend="c10d", endpoint=sys.argv[1], run_id="refound", min_nodes=1, max_nodes=2,
                                  local_addr="127.0.0.1", is_host="true", checkpoint_root=sys.argv[2],
                                  heartbeat_interval="0.1", heartbeat_timeout="1", last_call_timeout="0.3")
    h = create_c10d_handler(params)
    h.next_rendezvous()
    print("WORLD_FORMED", h.generation, flush=True)
    time.sleep(600)
    """
)


def params(port: int, root: Path, **conf: str) -> RendezvousParameters:
    return RendezvousParameters(
        backend="c10d",
        endpoint=f"127.0.0.1:{port}",
        run_id="refound",
        min_nodes=1,
        max_nodes=2,
        local_addr="127.0.0.1",
        is_host="true",
        checkpoint_root=str(root),
        **{**FAST, **conf},
    )


def test_a_newcomer_whose_job_died_with_its_store_starts_it_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = tmp_path / "world.log"
    world = subprocess.Popen(
        [PYTHON, "-c", WORLD, f"127.0.0.1:{free_port()}", str(tmp_path)],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=worker_env(),
        start_new_session=True,
    )
    with reaped(world):
        wait_for(lambda: "WORLD_FORMED 0" in log.read_text(), 60, what=f"the first world to form: {log}")
        newcomer = create_c10d_handler(params(free_port(), tmp_path, refound_after="4", join_timeout="60"))
        assert isinstance(newcomer, ElastrainRendezvousHandler)
        try:
            published = fence.newest(str(tmp_path))
            assert published is not None and newcomer._store_address == published.store  # joined the running job
            world.send_signal(signal.SIGKILL)  # the world dies with its store, before the newcomer joined a round
            world.wait(timeout=10)
            with caplog.at_level(logging.INFO, logger="elastrain"):
                info = newcomer.next_rendezvous()
            assert (info.world_size, info.rank) == (1, 0)
            assert newcomer.generation == 1  # the next fencing generation: the dead world's claims are stale
            top = fence.newest(str(tmp_path))
            assert top is not None and top.generation == 1 and top.store == newcomer._store_address
            assert newcomer._store_address != published.store
            refounded = [r for r in caplog.records if "event=job_refounded" in r.getMessage()]
            assert len(refounded) == 1, [r.getMessage() for r in caplog.records]
            silent = float(refounded[0].getMessage().split("silent_s=")[1].split()[0])
            assert silent >= 4.0  # it looked for a live store first, for refound_after
        finally:
            newcomer.shutdown()
