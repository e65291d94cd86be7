"""``elastrain-run`` (and ``python -m elastrain``): parse, validate, launch."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.run import config_from_args

from elastrain import log
from elastrain.errors import UsageError
from elastrain.launcher.launch import launch
from elastrain.launcher.options import build_parser, options_from_args, validate_and_default


def _fail(message: str) -> None:
    print(f"elastrain-run: error: {message}", file=sys.stderr)
    sys.exit(2)


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
    launch(config, cmd, cmd_args, options)


if __name__ == "__main__":
    main()
