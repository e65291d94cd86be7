"""What a launch spec's training script needs where it runs: the packages it imports and the flags it takes.

A spec that starts, then fails on ``import transformers`` or ``unrecognized arguments``, costs a cluster
allocation to find out. These checks read the script without running it:

- :func:`script_imports`: the third-party modules imported at the top level of the script and of its own
  modules (the ``.py`` files beside it that it imports, followed in turn), read by
  :func:`elastrain.launcher.preload.imported_names`, the reader elastrain-run's zygote uses;
- :func:`installed_by`: the distributions ``pip install elastrain[EXTRAS] REQUIREMENT...`` installs, following
  the ``Requires-Dist`` of the distributions installed here (markers evaluated for this machine);
- :func:`missing_imports`: the modules of the first that no distribution of the second provides;
- :func:`unknown_options`: the ``--flags`` given to the script that its ``add_argument`` calls do not define.

They need ``packaging`` (installed with pip's own tooling almost everywhere; part of the dev install).
"""

from __future__ import annotations

import ast
import importlib.metadata
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from elastrain.errors import LaunchSpecError
from elastrain.launcher.preload import imported_names

ROOT = "elastrain"


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise LaunchSpecError(f"cannot read {path}: {exc.strerror}") from None


def _local_module(directory: Path, top: str) -> Path | None:
    for candidate in (directory / f"{top}.py", directory / top / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def script_imports(script: Path) -> list[str]:
    """Top-level names of the modules ``script`` and its own modules import at their top level, in order.

    Standard-library modules are left out; a module found beside the script (``from data import ...``) is
    followed instead of listed, as a worker whose ``sys.path[0]`` is the script's folder would import it.
    """
    found: list[str] = []
    seen: set[Path] = set()
    todo = [script]
    while todo:
        source = todo.pop(0)
        if source in seen:
            continue
        seen.add(source)
        try:
            names = imported_names(_read(source))
        except SyntaxError as exc:
            raise LaunchSpecError(f"{source}: does not parse: {exc.msg} (line {exc.lineno})") from None
        for name in names:
            top = name.partition(":")[0].split(".")[0]
            if top in sys.stdlib_module_names or top in sys.builtin_module_names:
                continue
            local = _local_module(script.parent, top)
            if local is not None:
                todo.append(local)
            else:
                found.append(top)
    return list(dict.fromkeys(found))


def _requirement(text: str) -> Any:
    try:
        from packaging.requirements import InvalidRequirement, Requirement
    except ImportError:
        raise LaunchSpecError("checking installs needs packaging: pip install packaging") from None
    try:
        return Requirement(text)
    except InvalidRequirement as exc:
        raise LaunchSpecError(f"requirement {text!r}: {exc}") from None


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def installed_by(extras: Iterable[str], requirements: Iterable[str] = ()) -> set[str]:
    """Canonical names of every distribution ``pip install elastrain[extras] requirements`` installs.

    Follows the requirements of the distributions installed in this environment; one that is not installed
    here counts, but what it requires in turn is unknown (and not counted).
    """
    todo: list[tuple[str, frozenset[str]]] = [(ROOT, frozenset(extras))]
    for text in requirements:
        req = _requirement(text)
        todo.append((req.name, frozenset(req.extras)))
    out: set[str] = set()
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, wanted = todo.pop()
        key = (_canonical(name), wanted)
        if key in seen:
            continue
        seen.add(key)
        out.add(key[0])
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in requires:
            req = _requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (wanted or {""})):
                todo.append((req.name, frozenset(req.extras)))
    return out


def providers(module: str) -> list[str]:
    """Canonical names of the installed distributions that provide top-level module ``module``."""
    return sorted({_canonical(d) for d in importlib.metadata.packages_distributions().get(module, [])})


def missing_imports(script: Path, extras: Iterable[str], requirements: Iterable[str] = ()) -> list[str]:
    """The modules ``script`` imports that ``pip install elastrain[extras] requirements`` does not provide,
    each as ``module (distribution)``; a module not installed here at all is listed as ``module (not installed
    here)``."""
    installed = installed_by(extras, requirements)
    missing = []
    for module in script_imports(script):
        dists = providers(module)
        if not dists:
            missing.append(f"{module} (not installed here)")
        elif not installed & set(dists):
            missing.append(f"{module} ({', '.join(dists)})")
    return missing


def script_options(script: Path) -> set[str]:
    """Every option string (``--max-steps``, ``-n``) given to an ``add_argument`` call in ``script``."""
    try:
        tree = ast.parse(_read(script))
    except SyntaxError as exc:
        raise LaunchSpecError(f"{script}: does not parse: {exc.msg} (line {exc.lineno})") from None
    options: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("-"):
                    options.add(arg.value)
    return options


def unknown_options(script: Path, args: Sequence[str]) -> list[str]:
    """The flags in ``args`` (``--name`` or ``--name=value``) that ``script`` does not define."""
    known = script_options(script)
    flags: list[str] = []
    for arg in args:
        if arg == "--":
            break  # the rest are positional
        if arg.startswith("-") and not arg[1:2].isdigit():
            flags.append(arg.partition("=")[0])
    return [f for f in dict.fromkeys(flags) if f not in known]
