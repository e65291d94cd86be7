"""Command-line options: torchrun's parser, elastrain's options beside it, and validation of both.

torchrun's own parser (``torch.distributed.run.get_args_parser``) is reused unchanged, so every
torchrun flag and ``PET_*`` variable keeps its meaning. elastrain adds a group of options that also
read ``PET_<NAME>`` variables. Validation turns bad input into :class:`UsageError` naming the flag.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.argparse_util import env
from torch.distributed.elastic.multiprocessing import Std
from torch.distributed.run import get_args_parser

from elastrain.env import DEFAULT_IO_TIMEOUT_S, RDZV_SECRET_FILE
from elastrain.errors import UsageError
from elastrain.preemption.monitor import parse_watchers

NPROC_KEYWORDS = ("auto", "cpu", "gpu", "xpu")
# elastrain's fast handler serves this name; torch's own c10d handler stays reachable as TORCH_C10D.
ELASTIC_DEFAULT_BACKEND = "c10d"


@dataclass(frozen=True)
class ElastrainOptions:
    """elastrain's own launcher options (torchrun's stay in torch's ``LaunchConfig``)."""

    checkpoint_dir: str | None = None
    """Directory for checkpoints, passed to workers as ELASTRAIN_CHECKPOINT_DIR."""
    save_on_change: bool = True
    """Ask workers to checkpoint before an announced membership change (SIGTERM, a node joining)."""
    save_timeout_s: float = 60.0
    """How long the agent waits for that checkpoint to commit before it restarts anyway."""
    collective_timeout_s: float = 30.0
    """Timeout for workers' collectives (ELASTRAIN_COLLECTIVE_TIMEOUT); bounds a hang on a frozen peer."""
    first_step_timeout_s: float | None = None
    """--live: how long the collectives of a new world's first step may wait (ELASTRAIN_FIRST_STEP_TIMEOUT); None:
    10 minutes when the script compiles its model (elastrain/live/group.py), else ``collective_timeout_s``."""
    io_timeout_s: float = DEFAULT_IO_TIMEOUT_S
    """Timeout for workers' collectives that wait on storage (ELASTRAIN_IO_TIMEOUT): checkpoint saves and loads."""
    preemption_watchers: str = "none"
    """Cloud preemption notices to watch: none, auto, or a list of azure,aws,gcp."""
    metadata_endpoint: str | None = None
    """Base URL of the instance metadata service (default: each cloud's own; tests point it at 127.0.0.1)."""
    zygote: bool = True
    """Fork workers from a per-node process that already imported torch and the script's top-level imports."""
    live: bool = True
    """Regroup workers in place on a membership change (Session and Trainer scripts); others keep the restart path."""
    trainer_integration: bool = True
    """Make Hugging Face Trainer scripts elastic with no code change (the workers' bootstrap patches the Trainer)."""

    def __post_init__(self) -> None:
        if self.save_timeout_s < 0:
            raise UsageError("--save-timeout", f"must be >= 0 seconds, got {self.save_timeout_s}")
        if self.collective_timeout_s <= 0:
            raise UsageError("--collective-timeout", f"must be > 0 seconds, got {self.collective_timeout_s}")
        if self.first_step_timeout_s is not None and not self.first_step_timeout_s > 0:
            raise UsageError("--first-step-timeout", f"must be > 0 seconds, got {self.first_step_timeout_s}")
        if not self.io_timeout_s > 0:
            raise UsageError("--io-timeout", f"must be > 0 seconds, got {self.io_timeout_s}")
        parse_watchers(self.preemption_watchers)


def _str_to_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def build_parser() -> argparse.ArgumentParser:
    """torchrun's parser with elastrain's option group added beside its options."""
    parser = get_args_parser()
    parser.prog = "elastrain-run"
    parser.description = (
        "Elastic drop-in for torchrun: every torchrun option and PET_* variable works unchanged; "
        "the options below are elastrain's own (each also reads PET_<NAME>)."
    )
    group = parser.add_argument_group("elastrain")
    group.add_argument(
        "--checkpoint-dir",
        "--checkpoint_dir",
        action=env,
        default=None,
        help="Checkpoint directory handed to workers (ELASTRAIN_CHECKPOINT_DIR).",
    )
    group.add_argument(
        "--save-on-change",
        "--save_on_change",
        action=env,
        type=_str_to_bool,
        default=True,
        help="Ask workers for a checkpoint before an announced membership change (default: true).",
    )
    group.add_argument(
        "--save-timeout",
        "--save_timeout",
        action=env,
        type=float,
        default=60.0,
        help="Seconds to wait for a requested checkpoint before restarting anyway (default: 60).",
    )
    group.add_argument(
        "--collective-timeout",
        "--collective_timeout",
        action=env,
        type=float,
        default=30.0,
        help="Seconds a worker's collective may wait on a peer (default: 30; gloo's own is 30 min).",
    )
    group.add_argument(
        "--first-step-timeout",
        "--first_step_timeout",
        action=env,
        type=float,
        default=None,
        help="--live: seconds the collectives of a new world's first step may wait, where a joiner compiles "
        "(default: 600 when the script torch.compile's its model, else --collective-timeout; never shorter than it).",
    )
    group.add_argument(
        "--io-timeout",
        "--io_timeout",
        action=env,
        type=float,
        default=DEFAULT_IO_TIMEOUT_S,
        help="Seconds a worker's collective may wait on storage: checkpoint writes, verification and loads "
        f"(default: {DEFAULT_IO_TIMEOUT_S:.0f}).",
    )
    group.add_argument(
        "--preemption-watchers",
        "--preemption_watchers",
        action=env,
        default="none",
        help="Preemption notices to act on with a checkpoint and a graceful leave: none (default), auto "
        "(probe the cloud metadata service once), or a list of azure,aws,gcp.",
    )
    group.add_argument(
        "--metadata-endpoint",
        "--metadata_endpoint",
        action=env,
        default=None,
        help="Base URL of the metadata service for the preemption watchers (default: http://169.254.169.254).",
    )
    group.add_argument(
        "--zygote",
        action=env,
        type=_str_to_bool,
        default=True,
        help="Fork workers from a per-node process that already imported torch and the modules the script "
        "imports at its top level, so a restart does not pay for those imports again (python scripts and "
        "-m modules only; false: start every worker as a new process; default: true).",
    )
    group.add_argument(
        "--live",
        action=env,
        type=_str_to_bool,
        default=True,
        help="Live reconfiguration: on a membership change, workers that use elastrain's Session or a Hugging "
        "Face Trainer regroup in place (no restart, no checkpoint read); other scripts, and workers that do not "
        "answer in time, are restarted. The workers of such scripts are started before their node joins a "
        "round (warm join). false: every membership change restarts the workers (default: true).",
    )
    group.add_argument(
        "--trainer-integration",
        "--trainer_integration",
        action=env,
        type=_str_to_bool,
        default=True,
        help="Make Hugging Face Trainer scripts elastic with no code change: the global batch kept at every "
        "world size, the exact data position, committed checkpoints, resume, and live regroup. The workers' "
        "Python start-up patches transformers' Trainer (tested transformers versions only; others are refused "
        "with a message). false: the Trainer runs unchanged (default: true).",
    )
    # Positionals must stay last for argparse.REMAINDER; torch's parser added them already.
    _move_positionals_last(parser)
    return parser


def _move_positionals_last(parser: argparse.ArgumentParser) -> None:
    positionals = [a for a in parser._actions if not a.option_strings]
    for action in positionals:
        parser._actions.remove(action)
        parser._actions.append(action)


def options_from_args(args: argparse.Namespace) -> ElastrainOptions:
    return ElastrainOptions(
        checkpoint_dir=args.checkpoint_dir,
        save_on_change=bool(args.save_on_change),
        save_timeout_s=float(args.save_timeout),
        collective_timeout_s=float(args.collective_timeout),
        first_step_timeout_s=float(args.first_step_timeout) if args.first_step_timeout is not None else None,
        io_timeout_s=float(args.io_timeout),
        preemption_watchers=str(args.preemption_watchers),
        metadata_endpoint=args.metadata_endpoint,
        zygote=bool(args.zygote),
        live=bool(args.live),
        trainer_integration=bool(args.trainer_integration),
    )


def parse_nnodes(value: str) -> tuple[int, int]:
    parts = value.split(":")
    if len(parts) not in (1, 2):
        raise UsageError("--nnodes", f"expected N or MIN:MAX, got {value!r}")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise UsageError("--nnodes", f"expected integers as N or MIN:MAX, got {value!r}") from None
    lo, hi = (nums[0], nums[0]) if len(nums) == 1 else (nums[0], nums[1])
    if lo < 1:
        raise UsageError("--nnodes", f"the minimum number of nodes must be at least 1, got {value!r}")
    if lo > hi:
        raise UsageError("--nnodes", f"MIN must not exceed MAX, got {value!r} (did you mean {hi}:{lo}?)")
    return lo, hi


# --rdzv-conf keys whose values are secrets: never echoed in a message or a log line. Paths to secrets
# (password_file, secret_file, client_key) are not secret themselves and stay visible, to say which file is wrong.
_SECRET_WORDS = ("password", "passwd", "secret", "token", "credential", "apikey", "api_key", "private_key")


def is_secret_key(name: str) -> bool:
    lowered = name.strip().lower()
    return any(w in lowered for w in _SECRET_WORDS) and not lowered.endswith(("_file", "_path"))


def redact_conf(value: str) -> str:
    """``--rdzv-conf`` as it may be shown: each secret value (and whatever follows it up to the next key, which
    may be the rest of a value that holds a comma) replaced by ``<redacted>``."""
    out, hiding = [], False
    for item in value.split(","):
        key, sep, _ = item.partition("=")
        if sep and key.strip():
            hiding = is_secret_key(key)
            out.append(f"{key.strip()}=<redacted>" if hiding else item.strip())
        else:
            out.append("<redacted>" if hiding else item.strip())
    return ",".join(out)


def parse_rdzv_conf(value: str) -> dict[str, str]:
    """Strict ``key=value,key=value`` parsing (torch's parser accepts ``key`` alone as ``None``); messages never
    show a secret value (:func:`redact_conf`)."""
    out: dict[str, str] = {}
    text = value.strip()
    if not text:
        return out
    shown = redact_conf(text).split(",")
    for n, item in enumerate(text.split(",")):
        key, sep, val = item.partition("=")
        key = key.strip()
        if not sep or not key or not val.strip():
            raise UsageError(
                "--rdzv-conf", f"expected key=value[,key=value...], got {shown[n]!r} in {','.join(shown)!r}"
            )
        out[key] = val.strip()
    if "secret" in out:
        raise UsageError(
            "--rdzv-conf secret",
            f"a secret on the command line is visible to every user of the machine; put it in a file and give "
            f"secret_file=PATH, or set {RDZV_SECRET_FILE}=PATH",
        )
    return out


def known_backends() -> list[str]:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    from elastrain.rendezvous import registry

    registry.register_handlers()
    names = set(getattr(rendezvous_handler_registry, "_registry", {}))
    return sorted(names)


def _explicit(argv: Sequence[str], environ: Mapping[str, str], flag: str) -> bool:
    names = (f"--{flag}", f"--{flag.replace('-', '_')}")
    pet = "PET_" + flag.replace("-", "_").upper()
    return pet in environ or any(a == n or a.startswith(n + "=") for a in argv for n in names)


def validate_and_default(
    args: argparse.Namespace, argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> None:
    """Validate torchrun's options in place and apply elastrain's defaults; raise UsageError."""
    e = os.environ if environ is None else environ
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    nproc = str(args.nproc_per_node)
    if nproc not in NPROC_KEYWORDS:
        try:
            if int(nproc) < 1:
                raise ValueError
        except ValueError:
            raise UsageError(
                "--nproc-per-node", f"expected a positive integer or one of {', '.join(NPROC_KEYWORDS)}, got {nproc!r}"
            ) from None
    if args.max_restarts < 0:
        raise UsageError("--max-restarts", f"must be >= 0, got {args.max_restarts}")
    if args.monitor_interval <= 0:
        raise UsageError("--monitor-interval", f"must be > 0 seconds, got {args.monitor_interval}")
    rdzv_conf = parse_rdzv_conf(args.rdzv_conf)
    for flag, spec in (("--redirects", args.redirects), ("--tee", args.tee)):
        try:
            Std.from_str(spec)
        except (ValueError, KeyError):
            raise UsageError(flag, f"expected 0-3 or local_rank:value pairs like 0:1,1:2, got {spec!r}") from None
    if args.local_ranks_filter:
        try:
            [int(r) for r in args.local_ranks_filter.split(",")]
        except ValueError:
            raise UsageError(
                "--local-ranks-filter", f"expected comma-separated integers, got {args.local_ranks_filter!r}"
            ) from None
    _check_script(args)
    if args.log_dir and os.path.exists(args.log_dir) and not os.path.isdir(args.log_dir):
        raise UsageError("--log-dir", f"{args.log_dir} is a file; give a directory")
    if args.standalone and min_nodes > 1:
        raise UsageError(
            "--standalone",
            f"runs one node, on a store of its own that no other node can reach: --nnodes {args.nnodes} would wait "
            "for nodes that never come; give every node --rdzv-endpoint HOST:PORT instead",
        )

    if args.standalone:
        args.rdzv_backend = ELASTIC_DEFAULT_BACKEND
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    elif not _explicit(argv, e, "rdzv-backend") and min_nodes < max_nodes:
        # torchrun silently keeps the non-elastic static backend here; an elastic range means c10d.
        args.rdzv_backend = ELASTIC_DEFAULT_BACKEND
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None and max_nodes == 1:
        # torchrun's own single-node default.
        args.rdzv_backend = ELASTIC_DEFAULT_BACKEND
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500

    backends = known_backends()
    if args.rdzv_backend not in backends:
        raise UsageError(
            "--rdzv-backend", f"unknown backend {args.rdzv_backend!r}; choose one of: {', '.join(backends)}"
        )
    if args.rdzv_backend == "static" and min_nodes != max_nodes:
        raise UsageError(
            "--rdzv-backend", f"static rendezvous cannot be elastic (--nnodes {args.nnodes}); use c10d or etcd-v3"
        )
    _check_rendezvous(args, rdzv_conf, min_nodes, max_nodes)


def _check_rendezvous(args: argparse.Namespace, conf: dict[str, str], min_nodes: int, max_nodes: int) -> None:
    """What the rendezvous handler would refuse at start (the endpoint, numbers, the secret, etcd's options),
    found now: one line naming the flag instead of a traceback from inside the agent."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elastrain.rendezvous import auth, conf_keys, registry
    from elastrain.rendezvous.backends import c10d, etcd_options
    from elastrain.rendezvous.settings import HandlerSettings, read_timeout

    backend, endpoint = args.rdzv_backend, args.rdzv_endpoint or ""
    if backend == registry.ETCD_V3:
        etcd_options.parse_endpoints(endpoint)
    elif endpoint:
        c10d.parse_endpoint(endpoint)  # host[:port] for every other backend (static's is the master's)
    if backend not in (registry.C10D, registry.ETCD_V3):
        if conf.get("secret_file") or os.environ.get(RDZV_SECRET_FILE):
            setting = "--rdzv-conf secret_file" if conf.get("secret_file") else RDZV_SECRET_FILE
            raise UsageError(
                setting,
                f"only elastrain's rendezvous (--rdzv-backend c10d or etcd-v3) signs the rendezvous with a secret; "
                f"torch's {backend} backend would ignore it",
            )
        return  # torch's own handlers read the rest of --rdzv-conf their own way
    for key in conf_keys.unknown_keys(conf):
        print(f"elastrain-run: warning: --rdzv-conf {key}: no rendezvous reads this key; ignored", file=sys.stderr)
    params = RendezvousParameters(
        backend, endpoint, args.rdzv_id or "none", min_nodes, max_nodes, args.local_addr, **conf
    )
    read_timeout(params)
    HandlerSettings.from_params(params)
    auth.secret_from(params)
    if backend == registry.ETCD_V3:
        etcd_options.options_from_params(params)


def _check_script(args: argparse.Namespace) -> None:
    script = args.training_script
    if args.module:
        if args.no_python:
            raise UsageError("--no-python", "cannot be combined with -m/--module")
        return
    if args.no_python and not args.run_path:
        if shutil.which(script) is None and not Path(script).is_file():
            raise UsageError("training_script", f"command {script!r} not found (with --no-python it is run as is)")
        return
    if not Path(script).is_file():
        raise UsageError("training_script", f"file {script!r} does not exist")
