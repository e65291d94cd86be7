"""elastrain-run's worker bootstrap: on the workers' PYTHONPATH, so Python runs it at start-up.

It takes the worker's SIGTERM on a thread of its own, which defers a node-wide one to the agent's leave
(:mod:`elastrain.control.worker_sigterm`), installs the zero-code Hugging Face Trainer integration when the
launcher asked for it (``--trainer-integration``), then runs the ``sitecustomize`` this one hides, if there is
one further along ``sys.path``, so the environment's own start-up code still runs. It imports nothing heavy.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _install() -> None:
    try:
        from elastrain.control.worker_sigterm import install as take_sigterm
        from elastrain.env import TRAINER_INTEGRATION
    except ImportError:  # another interpreter, without elastrain: nothing to install
        return
    take_sigterm(os.environ)  # first: before any thread starts (the zygote's workers: zygote_process)
    if os.environ.get(TRAINER_INTEGRATION) == "1":
        from elastrain.integrations.trainer.hook import install

        install()


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_install()
_chain()
