"""elastrain's layering rules, checked on the import graph read from the sources with :mod:`ast`.

Nothing of elastrain is imported here. The rules (docs/architecture.md):

1. the worker side (session, live, checkpoint, data, scaling, metrics, integrations) never imports the launcher or
   the rendezvous;
2. the agent side (launcher, rendezvous) never imports DCP (``torch.distributed.checkpoint``);
3. the pure modules (the rendezvous state machine, the data cursor, the scaling maths) import neither torch nor I/O;
4. no import cycle among elastrain's modules (an ``if TYPE_CHECKING:`` import counts);
5. only ``elastrain/env.py`` names ``ELASTRAIN_*`` environment variables as string literals.

What "imports" means. A module *uses* what any import statement in it names (at module level, in a function, or
under ``TYPE_CHECKING``). Importing a module *runs* its module-level imports that are not under ``TYPE_CHECKING``,
and the ``__init__`` of every package above each module it imports. Rules 1 and 2 follow what a module uses and,
from there, what importing runs: a worker module that imports a neutral module that imports the launcher breaks
rule 1. Rule 3 follows only the modules' own imports, not their packages' ``__init__`` (the cursor's package also
holds a torch sampler). Rule 4 follows module-level imports, ``TYPE_CHECKING`` ones included.

Each problem is one line: ``FILE:LINE: what breaks which rule``.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "elastrain"

WORKER_SIDE = ("session", "live", "checkpoint", "data", "scaling", "metrics", "integrations")
AGENT_SIDE = ("launcher", "rendezvous")
DCP = "torch.distributed.checkpoint"
PURE_MODULES = (
    "elastrain.rendezvous.state",
    "elastrain.data.cursor",
    "elastrain.scaling.policy",
    "elastrain.scaling.schedule",
    "elastrain.ports",
)
IO_MODULES = (
    "torch",
    "socket",
    "subprocess",
    "threading",
    "multiprocessing",
    "asyncio",
    "http",
    "urllib.request",
    "requests",
    "boto3",
    "botocore",
    "etcd",
    "etcd3",
    "grpc",
    "fsspec",
    "psutil",
)
ENV_MODULE = "elastrain.env"
ENV_NAME = re.compile(r"ELASTRAIN_[A-Z0-9_]*(=.*)?", re.DOTALL)

# Rule breaks on main today whose fix is a move another engineer (or the lead) makes; the lead empties this after
# merging. Each entry: (importer, imported) -> why.
ALLOWED_EDGES: dict[tuple[str, str], str] = {
    # (importer, imported): why, naming the issue that removes it. Empty: every rule holds everywhere.
}


@dataclass(frozen=True)
class Import:
    """One name an import statement brings in, where, and when it runs."""

    name: str
    line: int
    module_level: bool
    type_checking: bool


@functools.cache
def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def is_package(module: str) -> bool:
    return modules()[module].name == "__init__.py"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@functools.cache
def tree(module: str) -> ast.Module:
    path = modules()[module]
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


@functools.cache
def imports(module: str) -> tuple[Import, ...]:
    """Every name the module's import statements bring in (``from a import b`` gives ``a.b``)."""
    found: list[Import] = []

    def absolute(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = module.split(".") if is_package(module) else module.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        return ".".join([*base, node.module] if node.module else base)

    def visit(nodes: Iterable[ast.AST], module_level: bool, type_checking: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.extend(Import(a.name, node.lineno, module_level, type_checking) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                source = absolute(node)  # `from a import b` imports a.b (a module) or a (b is a name in it)
                found.extend(Import(f"{source}.{a.name}", node.lineno, module_level, type_checking) for a in node.names)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(ast.iter_child_nodes(node), False, type_checking)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.body, module_level, True)
                visit(node.orelse, module_level, type_checking)
            else:
                visit(ast.iter_child_nodes(node), module_level, type_checking)

    visit(tree(module).body, True, False)
    return tuple(found)


def resolve(name: str) -> str | None:
    """The elastrain module an imported name lives in (``elastrain.a.B`` -> ``elastrain.a``), or None."""
    while name:
        if name in modules():
            return name
        name = name.rpartition(".")[0]
    return None


def parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int

    def where(self) -> str:
        return f"{modules()[self.importer].relative_to(ROOT)}:{self.line}"


def edges(module: str, *, uses: bool, with_parents: bool, type_checking: bool = False) -> Iterator[Edge]:
    """Edges to elastrain modules: all that ``module`` uses, or only those its import runs."""
    for imp in imports(module):
        if not uses and (not imp.module_level or (imp.type_checking and not type_checking)):
            continue
        target = resolve(imp.name)
        if target is None or target == module:
            continue
        if (module, target) in ALLOWED_EDGES:
            continue
        yield Edge(module, target, imp.line)
        if imp.name != target:  # `from package import Name`: a lazy __getattr__ may import what holds Name
            yield from (Edge(module, lazy, imp.line) for lazy in lazy_submodules(target) if lazy != module)
        if with_parents:
            for parent in parents(target):
                if parent in modules() and parent != module and not module.startswith(parent + "."):
                    yield Edge(module, parent, imp.line)


@functools.cache
def lazy_submodules(package: str) -> tuple[str, ...]:
    """Submodules a package's module-level ``__getattr__`` may import: those its ``__init__`` names in a string."""
    if not is_package(package) or not any(
        isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree(package).body
    ):
        return ()
    named = {n.value for n in ast.walk(tree(package)) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return tuple(sorted(f"{package}.{s}" for s in named if f"{package}.{s}" in modules()))


def reach(start: str, *, with_parents: bool) -> dict[str, list[Edge]]:
    """Every elastrain module ``start`` brings in, each with the chain of imports that brings it."""
    chains: dict[str, list[Edge]] = {start: []}
    todo = [start]
    while todo:
        module = todo.pop(0)
        for edge in edges(module, uses=module == start, with_parents=with_parents):
            if edge.imported not in chains:
                chains[edge.imported] = [*chains[module], edge]
                todo.append(edge.imported)
    return chains


def external_imports(module: str, *, uses: bool) -> Iterator[Import]:
    for imp in imports(module):
        if resolve(imp.name) is None and (uses or (imp.module_level and not imp.type_checking)):
            yield imp


def in_part(module: str, parts: Iterable[str]) -> bool:
    return any(module == f"elastrain.{p}" or module.startswith(f"elastrain.{p}.") for p in parts)


def describe(chain: list[Edge]) -> str:
    return " -> ".join([chain[0].importer, *(e.imported for e in chain)])


# -- the rules -------------------------------------------------------------------------------------------------


def worker_side_problems() -> list[str]:
    found: dict[str, str] = {}
    for module in modules():
        if not in_part(module, WORKER_SIDE):
            continue
        for target, chain in reach(module, with_parents=True).items():
            if in_part(target, AGENT_SIDE) and chain:
                last = chain[-1]
                found.setdefault(
                    f"{last.where()}: {last.importer} imports {last.imported}",
                    f"the worker side never imports the launcher or the rendezvous ({describe(chain)})",
                )
                break
    return [f"{k}: {v}" for k, v in sorted(found.items())]


def agent_side_problems() -> list[str]:
    found: dict[str, str] = {}
    for module in modules():
        if not in_part(module, AGENT_SIDE):
            continue
        for target, chain in reach(module, with_parents=True).items():
            for imp in external_imports(target, uses=target == module):
                if imp.name == DCP or imp.name.startswith(DCP + "."):
                    where = f"{modules()[target].relative_to(ROOT)}:{imp.line}"
                    via = describe(chain) if chain else module
                    found.setdefault(
                        f"{where}: {target} imports {imp.name}", f"the agent side never imports DCP ({via})"
                    )
    return [f"{k}: {v}" for k, v in sorted(found.items())]


def pure_module_problems() -> list[str]:
    problems: list[str] = []
    for module in PURE_MODULES:
        if module not in modules():
            problems.append(f"{module}: the pure module is gone; name where it moved in PURE_MODULES")
            continue
        for target, chain in reach(module, with_parents=False).items():
            for imp in external_imports(target, uses=True):
                if any(imp.name == io or imp.name.startswith(io + ".") for io in IO_MODULES):
                    via = f" (via {describe(chain)})" if chain else ""
                    problems.append(
                        f"{modules()[target].relative_to(ROOT)}:{imp.line}: {target} imports {imp.name}: the pure "
                        f"module {module} imports neither torch nor I/O{via}"
                    )
    return sorted(set(problems))


def cycles() -> list[list[str]]:
    """The import cycles: strongly connected components of more than one module (Tarjan's algorithm)."""
    graph = {
        m: sorted({e.imported for e in edges(m, uses=False, with_parents=False, type_checking=True)}) for m in modules()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            connect(module)
    return components


def cycle_problems() -> list[str]:
    problems: list[str] = []
    for component in cycles():
        members = set(component)
        steps = [
            f"{e.importer} -> {e.imported} ({e.where()})"
            for m in component
            for e in edges(m, uses=False, with_parents=False, type_checking=True)
            if e.imported in members
        ]
        first = next(e for e in edges(component[0], uses=False, with_parents=False, type_checking=True))
        problems.append(f"{first.where()}: import cycle among {', '.join(component)}: {'; '.join(sorted(set(steps)))}")
    return problems


def env_literal_problems() -> list[str]:
    problems: list[str] = []
    for module, path in modules().items():
        if module == ENV_MODULE:
            continue
        for node in ast.walk(tree(module)):  # an f-string's literal parts are Constants too: f"ELASTRAIN_{x}"
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and ENV_NAME.fullmatch(node.value):
                problems.append(
                    f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}: only elastrain/env.py names ELASTRAIN_* "
                    "variables (use its constants or WorkerEnv)"
                )
    return problems


# -- the tests -------------------------------------------------------------------------------------------------


def test_the_graph_is_read() -> None:
    assert {"elastrain.env", "elastrain.launcher.agent", "elastrain.session", *PURE_MODULES} <= set(modules())
    assert any(
        e.imported == "elastrain.rendezvous.state"
        for e in edges("elastrain.rendezvous.api", uses=True, with_parents=False)
    )


def test_the_worker_side_never_imports_the_launcher_or_the_rendezvous() -> None:
    problems = worker_side_problems()
    assert not problems, "\n" + "\n".join(problems)


def test_the_agent_side_never_imports_dcp() -> None:
    problems = agent_side_problems()
    assert not problems, "\n" + "\n".join(problems)


def test_the_pure_modules_import_neither_torch_nor_io() -> None:
    problems = pure_module_problems()
    assert not problems, "\n" + "\n".join(problems)


def test_no_import_cycle() -> None:
    problems = cycle_problems()
    assert not problems, "\n" + "\n".join(problems)


def test_only_env_names_elastrain_variables() -> None:
    problems = env_literal_problems()
    assert not problems, "\n" + "\n".join(problems)


def test_every_allowed_edge_is_still_needed() -> None:
    """An entry whose import is gone must leave the allow-list, so that the rule holds again."""
    stale = [
        f"{importer} -> {imported}: {why}"
        for (importer, imported), why in ALLOWED_EDGES.items()
        if importer not in modules() or all(resolve(i.name) != imported for i in imports(importer))
    ]
    assert not stale, "allow-list entries that no import needs any more (remove them):\n" + "\n".join(stale)
