"""Build torch's WorkerSpec and run an ElastrainAgent: the equivalent of torch's ``launch_agent``."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic import events, metrics
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.metrics.api import MetricsConfig
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.launcher.api import LaunchConfig, _get_addr_and_port, _get_entrypoint_name

from elastrain import binding
from elastrain.env import TRAINER_INTEGRATION
from elastrain.errors import NodeLeftError, RendezvousStoreLostError, UsageError
from elastrain.launcher import orphans
from elastrain.launcher.agent import ElastrainAgent
from elastrain.launcher.options import ElastrainOptions
from elastrain.launcher.script_kind import ScriptKind, classify
from elastrain.log import lifecycle
from elastrain.preemption import start_monitor
from elastrain.rendezvous.api import Membership, membership_of
from elastrain.rendezvous.registry import ETCD_V3
from elastrain.rendezvous.state import Departure
from elastrain.storage import is_url, storage_for


def launch(
    config: LaunchConfig, entrypoint: Callable[..., Any] | str, args: list[Any], options: ElastrainOptions
) -> dict[int, Any]:
    """Run this node's agent until the job ends; return the workers' return values by rank."""
    entrypoint_name = _get_entrypoint_name(entrypoint, args)
    kind = _script_kind(entrypoint, args)
    prepare_worker_environment(options)
    if isinstance(entrypoint, str):
        # Workers die with this agent, even on SIGKILL (see orphans.py).
        entrypoint, args = orphans.wrap(entrypoint, list(args))
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    _check_checkpoint_dir(options.checkpoint_dir)
    if options.checkpoint_dir and params.get("checkpoint_root", None) is None:
        # The fencing generation lives in the checkpoint root: at most one world of the job commits there.
        params.config["checkpoint_root"] = options.checkpoint_dir
    elif not options.checkpoint_dir and config.max_nodes > 1:
        lifecycle("fencing_off", level=logging.WARNING, why=fencing_off_advice(config.rdzv_backend))
    listen_on_loopback(binding.advertised_address(config.local_addr, config.rdzv_endpoint))
    master_addr, master_port = _get_addr_and_port(params)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    lifecycle(
        "agent_started",
        entrypoint=entrypoint_name,
        nnodes=f"{config.min_nodes}:{config.max_nodes}",
        nproc_per_node=config.nproc_per_node,
        rdzv_backend=config.rdzv_backend,
        rdzv_endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        max_restarts=config.max_restarts,
        live=options.live,
        script=kind.value,
    )
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank,
    )
    assert config.logs_specs is not None  # LaunchConfig.__post_init__ fills it
    agent = ElastrainAgent(
        spec=spec,
        logs_specs=config.logs_specs,
        options=options,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=config.shutdown_timeout or 30,
        warm_start=options.live and _waits_for_round(kind, options),
    )
    shutdown_rdzv = True
    try:
        metrics.initialize_metrics(MetricsConfig(config.metrics_cfg))
        # Cloud preemption notices (--preemption-watchers) become agent.request_leave, from a daemon thread.
        start_monitor(options.preemption_watchers, agent.request_leave, options.metadata_endpoint)
        result = agent.run()
        events.record(agent.get_event_succeeded(), config.event_log_handler)
        if result.is_failed():
            # This node's own failure: it leaves the job, the others go on (only a finished job closes it).
            shutdown_rdzv = False
            ranks = ",".join(str(r) for r in sorted(result.failures))
            lifecycle("node_failed", level=logging.ERROR, failed_ranks=ranks, max_restarts=config.max_restarts)
            membership = membership_of(spec.rdzv_handler)
            if agent.config_error:
                membership.leave("a worker exited with EX_USAGE or EX_CONFIG", Departure.CONFIG)
            else:
                membership.leave(f"workers failed past --max-restarts {config.max_restarts}", Departure.FAILED)
            raise ChildFailedError(name=entrypoint_name, failures=result.failures)
        lifecycle("job_succeeded")
        return dict(result.return_values)
    except ChildFailedError:
        raise
    except RendezvousClosedError:
        # The job finished on the other nodes while this one waited (a spare, a late joiner).
        shutdown_rdzv = False
        lifecycle("job_finished_elsewhere")
        return {}
    except NodeLeftError as exc:
        # A graceful leave: the others go on without us; the rendezvous stays open.
        shutdown_rdzv = False
        lifecycle("agent_left", reason=str(exc))
        return {}
    except RendezvousStoreLostError as exc:
        shutdown_rdzv = False
        lifecycle("rendezvous_store_lost", level=logging.ERROR, error=str(exc))
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise SystemExit(f"elastrain-run: error: {exc}") from exc
    except SignalException as exc:
        # Leaving on a signal must not close the rendezvous: the other nodes go on without us.
        shutdown_rdzv = False
        lifecycle("agent_signalled", signal=exc.sigval.name)
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    except Exception as exc:
        if isinstance(spec.rdzv_handler, Membership):
            # This node's own error (no round formed within --rdzv-conf join_timeout, a bug): it leaves the job,
            # which goes on without it. torch's launcher closes the rendezvous here (and still does for torch's
            # handlers); on etcd, the job's one rendezvous, that ended every other node as if the job had finished
            # (job_finished_elsewhere, exit 0) at its next round, and every node launched later (soak seed 90007).
            shutdown_rdzv = False
            lifecycle("node_failed", level=logging.ERROR, error=repr(exc)[:300])
            spec.rdzv_handler.leave(f"its agent failed: {type(exc).__name__}", Departure.FAILED)
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    finally:
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()
        else:  # no liveness thread may be inside a store call when the interpreter finalises
            membership_of(spec.rdzv_handler).stop_beating()


def fencing_off_advice(backend: str) -> str:
    """Why running without --checkpoint-dir is unsafe with ``backend``, and what to do about it."""
    if backend == ETCD_V3:
        return (
            "no --checkpoint-dir: etcd keeps one rendezvous, but a world cut off from etcd trains on until its "
            "requests time out (--rdzv-conf retry_timeout), and only the workers' own fence at the root they write "
            "into keeps it from committing; give a shared --checkpoint-dir"
        )
    return (
        "no --checkpoint-dir: the rendezvous cannot stop a second world of this job after a partition or a store "
        "host's death (c10d); only the workers' own fence at the root they write into keeps it from committing; "
        "give a shared --checkpoint-dir, or use --rdzv-backend etcd-v3"
    )


# Where gloo and NCCL listen, in the workers (they inherit the agent's environment); the user's setting wins.
# gloo takes an interface name; NCCL a list of prefixes, where "=" asks for that exact name.
SOCKET_IFNAME_FORMATS = {"GLOO_SOCKET_IFNAME": "{}", "NCCL_SOCKET_IFNAME": "={}"}


def listen_on_loopback(address: str) -> None:
    """A node that peers reach on loopback (--standalone, a loopback endpoint): its workers' gloo and NCCL sockets
    listen on the loopback interface too, not on the one the host name resolves to."""
    if binding.listen_host(address) == binding.ANY or not binding.is_loopback(binding.listen_host(address)):
        return
    name = binding.loopback_interface()
    if name is None:
        return
    for var, form in SOCKET_IFNAME_FORMATS.items():
        os.environ.setdefault(var, form.format(name))


BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")
"""The directory whose ``sitecustomize`` runs at every worker's start (the Trainer integration)."""


def prepare_worker_environment(options: ElastrainOptions) -> None:
    """What every worker (and the zygote) inherits from this agent's environment: the bootstrap on PYTHONPATH,
    and whether it installs the Trainer integration."""
    os.environ[TRAINER_INTEGRATION] = "1" if options.trainer_integration else "0"
    if not options.trainer_integration:
        return
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != BOOTSTRAP_DIR]
    os.environ["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *paths])


def _waits_for_round(kind: ScriptKind, options: ElastrainOptions) -> bool:
    """Whether the script waits for its round when started warm (see elastrain.launcher.script_kind)."""
    return kind is ScriptKind.SESSION or (kind is ScriptKind.TRAINER and options.trainer_integration)


def _script_kind(entrypoint: Callable[..., Any] | str, args: list[Any]) -> ScriptKind:
    """Whether the worker command runs a script that waits for its round (Session, Trainer): see script_kind."""
    import sys

    if not isinstance(entrypoint, str) or os.path.realpath(entrypoint) != os.path.realpath(sys.executable):
        return ScriptKind.OTHER
    argv = [str(a) for a in args]
    while argv and argv[0] == "-u":
        argv = argv[1:]
    return classify(argv, os.getcwd(), sys.path[1:])


def _check_checkpoint_dir(path: str | None) -> None:
    """A checkpoint URL the job could not use (its filesystem's package missing, no credentials, a bad address),
    found now: one line naming the flag instead of a traceback from the first read of its fencing marks."""
    if not path or not is_url(path):
        return  # a local directory's problems are named where it is first written (the fencing claim)
    flag, scheme = f"--checkpoint-dir {path}", path.split("://", 1)[0]
    try:
        storage_for(path).exists(path)
    except ImportError as exc:
        raise UsageError(flag, f"{scheme}:// needs a package that is not installed here ({exc})") from None
    except Exception as exc:  # whatever its client raises is the user's to fix: said in one line
        raise UsageError(
            flag, f"cannot be reached ({type(exc).__name__}: {str(exc)[:200]}); check its address and credentials"
        ) from None
