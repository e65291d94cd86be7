"""``python -m elastrain`` is ``elastrain-run``."""

from elastrain.launcher.cli import main

if __name__ == "__main__":
    main()
