"""``python -m elastrain.chaos`` is ``elastrain-chaos``."""

import sys

from elastrain.chaos.cli import main

if __name__ == "__main__":
    sys.exit(main())
