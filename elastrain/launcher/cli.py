"""``elastrain-run`` (and ``python -m elastrain``): parse, validate, launch."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.run import config_from_args

from elastrain import log
from elastrain.errors import ElastrainError, UsageError
from elastrain.launcher.launch import launch
from elastrain.launcher.options import build_parser, options_from_args, validate_and_default


def _fail(message: str, code: int = 2) -> None:
    print(f"elastrain-run: error: {message}", file=sys.stderr)
    sys.exit(code)


@record
def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    log.configure()
    args = build_parser().parse_args(argv)
    try:
        validate_and_default(args, argv, os.environ)
        options = options_from_args(args)
        config, cmd, cmd_args = config_from_args(args)
    except UsageError as exc:
        _fail(str(exc))
        return
    except (ValueError, RuntimeError, AssertionError) as exc:
        # Anything torch's own config step still rejects, as one line rather than a traceback.
        _fail(str(exc))
        return
    try:
        launch(config, cmd, cmd_args, options)
    except UsageError as exc:
        # Found only at run time (say, etcd refused the --rdzv-conf credentials).
        _fail(str(exc))
    except ElastrainError as exc:
        # An unreachable rendezvous and the like: what to fix, in one line, not a traceback.
        _fail(str(exc), code=1)


if __name__ == "__main__":
    main()
