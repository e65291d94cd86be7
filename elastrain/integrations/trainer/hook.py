"""Install the zero-code Trainer integration into a worker: transformers is patched as it is imported.

elastrain-run puts a bootstrap directory on its workers' ``PYTHONPATH`` whose ``sitecustomize`` calls
:func:`install` (``--trainer-integration true``, the default). Nothing is imported here until the script
imports transformers' Trainer modules; then the wrappers of :mod:`~elastrain.integrations.trainer.patches`
are applied right after each module runs, before the script binds any of its names.

The wrappers depend on the Trainer's internals, so they are applied only to the transformers versions
they were tested with (:data:`TESTED`); with any other version a Trainer refuses to start with one line
that names the version and the flag to turn the integration off (exit code 78, EX_CONFIG: the node
leaves instead of restarting).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from elastrain.errors import EX_CONFIG

TESTED = ("5.23.",)
"""transformers versions (prefixes) whose Trainer internals the patches were written and tested against."""

_installed = False


def supported(version: str) -> bool:
    return version.startswith(TESTED)


def _patches() -> dict[str, Callable[[ModuleType], None]]:
    from elastrain.integrations.trainer import patches

    if not supported(importlib.metadata.version("transformers")):
        return {"transformers.trainer": _refuse}
    return {
        "transformers.trainer_utils": patches.patch_trainer_utils,
        "transformers.training_args": patches.patch_training_args,
        "transformers.trainer": patches.patch_trainer,
    }


def _refuse(module: ModuleType) -> None:
    version = importlib.metadata.version("transformers")
    cls: Any = module.Trainer
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        sys.stderr.write(
            f"elastrain-run: the Trainer integration supports transformers {', '.join(v + 'x' for v in TESTED)}, "
            f"this is {version}: install one of those, or run elastrain-run --trainer-integration false\n"
        )
        sys.stderr.flush()
        raise SystemExit(EX_CONFIG)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    cls.__init__ = __init__


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch: Callable[[ModuleType], None]) -> None:
        self._inner = inner
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of the modules to patch, so the patch runs right after them."""

    def __init__(self) -> None:
        self._targets: dict[str, Callable[[ModuleType], None]] | None = None

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("transformers.trainer") and fullname != "transformers.training_args":
            return None
        if self._targets is None:
            self._targets = _patches()
        patch = self._targets.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec: importlib.machinery.ModuleSpec | None = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def install() -> None:
    """Patch transformers' Trainer for elastrain (idempotent): modules already imported now, the others on import."""
    global _installed
    if _installed:
        return
    _installed = True
    finder = _Finder()
    sys.meta_path.insert(0, finder)
    loaded = [
        name
        for name in ("transformers.trainer_utils", "transformers.training_args", "transformers.trainer")
        if name in sys.modules
    ]
    if loaded:
        targets = _patches()
        for name in loaded:
            patch = targets.get(name)
            if patch is not None:
                patch(sys.modules[name])
