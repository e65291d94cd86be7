"""What the zygote preloads: the modules a worker's script imports at its top level, read without running it.

``--zygote`` forks workers from a per-node process that already imported torch; it also imports,
once, the modules the entrypoint imports at its top level (``import transformers``, ``from datasets
import load_dataset``), so that a restarted worker finds them in ``sys.modules`` instead of paying
for the import again. This module reads those names from the script's source with :mod:`ast` and
checks with the import system's finders, without importing anything, that each one can be found here.

What is read (for ``python script.py`` and ``python -m module``; one file, not recursive):

- ``import a.b`` preloads ``a.b``; ``from a.b import c`` preloads ``a.b``, and then ``a.b.c`` when
  ``c`` is a submodule (``from torch import nn``), or else reads the name ``c`` from ``a.b``, written
  ``a.b:c`` in the list: a package that loads its parts on first use (transformers: ``import
  transformers`` takes 3 s here, ``from transformers import T5ForConditionalGeneration`` 7 s more)
  does that work in the zygote too;
- statements at the top level, and inside top-level ``if``/``try``/``with`` blocks (``if __name__ ==
  "__main__":`` runs in a worker too), but not in functions or classes, nor under ``if TYPE_CHECKING:``;
- not relative imports, ``__future__``, built-in modules (in every process already), nor names that
  cannot be found here;
- not the script's own modules: those found in the script's directory (for ``-m``, the working
  directory), which is where a worker's ``sys.path[0]`` points. They are the user's code: they may read
  the worker's environment when imported (``RANK = int(os.environ["RANK"])``), which a preloaded copy
  would have read from the agent's, and they may change between two restarts, as the script may; the
  worker imports them itself, as it re-reads the script.
"""

from __future__ import annotations

import ast
import importlib.machinery
import os
import sys
from collections.abc import Iterator, Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path


def imported_names(source: str) -> list[str]:
    """Candidate module names imported at the top level of ``source``, in order, without duplicates.

    A dotted name comes with its parents (``import a.b`` gives ``a``, ``a.b``: both are imported), and
    ``from a import b`` gives ``a`` and ``a:b`` (``b`` from ``a``: a submodule or a name in ``a``).
    Raises ``SyntaxError`` for a source that does not parse.
    """
    names: list[str] = []
    for node in _top_level_statements(ast.parse(source).body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names.extend(_with_parents(alias.name))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module != "__future__":
            names.extend(_with_parents(node.module))
            names.extend(f"{node.module}:{alias.name}" for alias in node.names if alias.name != "*")
    return list(dict.fromkeys(names))


def _with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _top_level_statements(body: Sequence[ast.stmt]) -> Iterator[ast.stmt]:
    for node in body:
        if isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _top_level_statements(node.body)
            yield from _top_level_statements(node.orelse)
        elif isinstance(node, ast.Try | getattr(ast, "TryStar", ast.Try)):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _top_level_statements(block)
        elif isinstance(node, ast.With):
            yield from _top_level_statements(node.body)
        else:
            yield node


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING`` (any module prefix)."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def find_spec(name: str, first: str, rest: Sequence[str]) -> tuple[ModuleSpec, bool] | None:
    """The spec of module ``name`` and whether it was found in ``first`` (the script's own directory),
    searching ``first`` then ``rest`` as ``sys.path``; ``None`` if it is not found.

    Imports nothing: ``importlib.util.find_spec("a.b")`` would import ``a`` to find ``a.b``; this
    walks the packages' search locations instead. Built-in and frozen modules are never local.
    """
    top, *subs = name.split(".")
    found = _find_top(top, first, rest)
    if found is None:
        return None
    spec, local = found
    for i in range(len(subs)):
        locations = spec.submodule_search_locations
        if not locations:
            return None  # a module, not a package: ``c`` of ``from a.b import c`` is a name in it
        sub = importlib.machinery.PathFinder.find_spec(".".join([top, *subs[: i + 1]]), list(locations))
        if sub is None:
            return None
        spec = sub
    return spec, local


def _find_top(name: str, first: str, rest: Sequence[str]) -> tuple[ModuleSpec, bool] | None:
    if not name.isidentifier():
        return None
    spec = importlib.machinery.BuiltinImporter.find_spec(name) or importlib.machinery.FrozenImporter.find_spec(name)
    if spec is not None:
        return spec, False
    spec = importlib.machinery.PathFinder.find_spec(name, [first])
    if spec is not None:
        return spec, True
    spec = importlib.machinery.PathFinder.find_spec(name, list(rest))
    if spec is not None:
        return spec, False
    # Other finders on sys.meta_path: setuptools' editable installs, for example.
    known = (importlib.machinery.BuiltinImporter, importlib.machinery.FrozenImporter, importlib.machinery.PathFinder)
    for finder in sys.meta_path:
        if finder in known or not hasattr(finder, "find_spec"):
            continue
        try:
            other = finder.find_spec(name, None)
        except (ImportError, ValueError, OSError):
            continue
        if other is not None:
            return other, False
    return None


def script_of(argv: Sequence[str], cwd: str, rest: Sequence[str]) -> tuple[Path, str] | None:
    """The file a worker runs for ``argv`` (``["script.py", ...]`` or ``["-m", "module", ...]``) and
    the directory that is its ``sys.path[0]``; ``None`` if it is not a Python source file found here."""
    if argv[:1] == ["-m"] and len(argv) > 1:
        module = argv[1]
        found = find_spec(module, cwd, rest)
        if found is not None and found[0].submodule_search_locations is not None:
            found = find_spec(f"{module}.__main__", cwd, rest)  # python -m package runs package/__main__.py
        origin = found[0].origin if found else None
        return (Path(origin), cwd) if origin and origin.endswith(".py") else None
    if not argv or argv[0].startswith("-"):
        return None
    path = Path(cwd, argv[0])
    return path, str(path.resolve().parent)


def entrypoint_imports(argv: Sequence[str], cwd: str | None = None, path: Sequence[str] | None = None) -> list[str]:
    """What to preload for a worker started as ``python *argv``, in order: module names, and
    ``module:name`` for a name to read from a module (see the module docstring).

    ``cwd`` is the worker's working directory (default: this process's); ``path`` is ``sys.path``
    without its first entry (default: this process's, which is the worker's but for ``sys.path[0]``).
    Never raises for a script it cannot read or parse: it preloads nothing then.
    """
    cwd = os.getcwd() if cwd is None else cwd
    rest = list(sys.path[1:] if path is None else path)
    located = script_of(argv, cwd, rest)
    if located is None:
        return []
    script, first = located
    try:
        names = imported_names(script.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError):
        return []  # the worker reports it the normal way
    if argv[:1] == ["-m"]:
        # runpy imports the module's parent packages (and the package itself for package/__main__.py)
        parents = _with_parents(argv[1])
        names = parents[:-1] + (parents[-1:] if script.name == "__main__.py" else []) + names
    out: list[str] = []
    for name in names:
        module, _, attr = name.partition(":")
        if module == "__main__" or module in sys.builtin_module_names:
            continue
        if not attr:
            if _installed(module, first, rest):
                out.append(module)
        elif _installed(f"{module}.{attr}", first, rest):
            out.append(f"{module}.{attr}")  # ``from a import b``, ``b`` a submodule
        elif module in out and module.partition(".")[0] not in sys.stdlib_module_names:
            out.append(name)  # a name to read from a preloaded package (the standard library loads no parts lazily)
    return list(dict.fromkeys(out))


def _installed(name: str, first: str, rest: Sequence[str]) -> bool:
    found = find_spec(name, first, rest)
    return found is not None and not found[1]
