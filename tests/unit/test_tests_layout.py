"""The tests' layout, checked on the sources with :mod:`ast` (nothing here is imported or run).

1. tests/unit/ is pure: no unit test (tests/unit/*.py; a fixture's generator script beside its data, run by hand,
   is not one) imports a module that starts processes, threads or servers, names torch's
   process-group or store constructors, or imports a support module that starts a process or a server; those
   tests live in tests/integration/ (a unit test may still read a file or parse a socket address);
2. tests/ holds conftest.py and folders only: the helpers are the ``support`` package (tests/support/), and every
   script a test runs as a process is in tests/workers/;
3. bench/ imports nothing from tests/ or examples/ and puts neither on ``sys.path`` (running an example's script
   as a process is using it, not importing it): what the benches share with the tests is in bench/support/.

Each problem is one line: ``FILE:LINE: what breaks which rule``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
BENCH = ROOT / "bench"

# Rule 1. Modules whose import alone says the test starts something (``http.server`` and ``socketserver``: servers).
NOT_IN_UNIT_MODULES = ("subprocess", "multiprocessing", "threading", "socket", "socketserver", "http.server")
# torch's process group and its store server, and elastrain's own servers (imported or used as an attribute).
NOT_IN_UNIT_NAMES = ("init_process_group", "new_group", "TCPStore", "tcp_store_server", "host_worker_store",
                     "ProbeListener")  # fmt: skip
# The support modules that start processes or servers (the others, crafted_pickle and launch_checks, are data).
NOT_IN_UNIT_SUPPORT = ("support.processes", "support.s3_server", "support.azurite_server", "support.fake_metadata",
                       "support.netns", "support.ledger_chain", "support.trainer_trace",
                       "bench.support.etcd_server")  # fmt: skip

# Rule 3. Words that, in a string that edits sys.path, point it at tests/ or examples/.
OFF_LIMITS_FOR_BENCH = ("tests", "examples")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def _imports(tree: ast.AST, names: bool = True) -> Iterator[tuple[str, int]]:
    """Every module an import statement names, with its line; with ``names``, ``from a import b`` also gives
    ``a.b`` (``b`` may be a module or a name in ``a``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, node.lineno
            for alias in node.names if names else ():
                yield f"{node.module}.{alias.name}", node.lineno


def _is_or_under(name: str, modules: tuple[str, ...]) -> str | None:
    return next((m for m in modules if name == m or name.startswith(m + ".")), None)


def unit_problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for name, line in _imports(tree):
        if hit := _is_or_under(name, NOT_IN_UNIT_MODULES):
            out.append(f"{_rel(path)}:{line}: a unit test imports {hit} (rule 1: move the test to tests/integration)")
        elif hit := _is_or_under(name, NOT_IN_UNIT_SUPPORT):
            out.append(f"{_rel(path)}:{line}: a unit test imports {hit}, which starts processes or servers (rule 1)")
        elif name.rsplit(".", 1)[-1] in NOT_IN_UNIT_NAMES:
            out.append(f"{_rel(path)}:{line}: a unit test imports {name} (rule 1)")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in NOT_IN_UNIT_NAMES:
            out.append(f"{_rel(path)}:{node.lineno}: a unit test uses .{node.attr} (rule 1)")
    return list(dict.fromkeys(out))  # ``from a import b`` names a, then a.b: one line for a


def test_unit_tests_start_no_process_thread_group_or_server() -> None:
    problems = [p for path in sorted((TESTS / "unit").glob("*.py")) for p in unit_problems(path)]
    assert problems == [], "\n".join(problems)


def test_the_rule_catches_what_it_names(tmp_path: Path) -> None:
    bad = tmp_path / "test_bad.py"
    bad.write_text(
        "import threading\nfrom multiprocessing import get_context\nimport torch.distributed as dist\n"
        "from torch.distributed import TCPStore\nfrom support.processes import free_port\n"
        "from support import fake_metadata\ndef test() -> None:\n    dist.init_process_group('gloo')\n"
    )
    found = unit_problems(bad)
    assert [p.split(": ", 1)[1].split(" (", 1)[0] for p in found] == [
        "a unit test imports threading",
        "a unit test imports multiprocessing",
        "a unit test imports torch.distributed.TCPStore",
        "a unit test imports support.processes, which starts processes or servers",
        "a unit test imports support.fake_metadata, which starts processes or servers",
        "a unit test uses .init_process_group",
    ]


def test_tests_holds_conftest_and_folders_and_every_worker_script_is_in_workers() -> None:
    assert sorted(p.name for p in TESTS.glob("*.py")) == ["conftest.py"], "rule 2: helpers go in tests/support/"
    strays = [_rel(p) for p in TESTS.rglob("*_worker.py") if p.parent != TESTS / "workers"]
    assert strays == [], f"rule 2: worker scripts outside tests/workers/: {strays}"
    assert (TESTS / "support" / "__init__.py").is_file()


def _module_names(folder: Path) -> set[str]:
    """The names ``import X`` finds for the modules and packages anywhere under ``folder``."""
    names = {p.stem for p in folder.rglob("*.py") if p.stem != "__init__"}
    return names | {p.parent.name for p in folder.rglob("__init__.py")}


def _strings(node: ast.AST, assigned: dict[str, ast.AST], seen: frozenset[str] = frozenset()) -> Iterator[str]:
    """The string constants in ``node``, following names to their module-level assignment (``T5 = REPO / ...``)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            yield sub.value
        elif isinstance(sub, ast.Name) and sub.id in assigned and sub.id not in seen:
            yield from _strings(assigned[sub.id], assigned, seen | {sub.id})


def _points_off_limits(text: str) -> bool:
    return any(word == text or text.startswith(word + "/") or f"'{word}/" in text or f'"{word}/' in text
               for word in OFF_LIMITS_FOR_BENCH)  # fmt: skip


def _one_liner_off_limits(text: str) -> bool:
    """A ``python -c`` text that puts tests/ or examples/ on sys.path to import from them."""
    return "sys.path" in text and _points_off_limits(text)


def _is_sys_path(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "path" and ast.unparse(node.value) == "sys"


def bench_problems(path: Path, foreign: set[str]) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    assigned = {
        t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)
    }
    out = []
    for name, line in _imports(tree, names=False):
        top = name.split(".")[0]
        if top in ("tests", "examples") or top in foreign:
            out.append(f"{_rel(path)}:{line}: bench imports {name} from tests/ or examples/ (rule 3)")
    for node in ast.walk(tree):
        call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_sys_path(node.func.value)
        assign = isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Subscript) and _is_sys_path(t.value) for t in node.targets
        )
        edits = call or assign
        if edits and any(_points_off_limits(s) for s in _strings(node, assigned)):
            out.append(f"{_rel(path)}:{node.lineno}: bench puts tests/ or examples/ on sys.path (rule 3)")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _one_liner_off_limits(node.value):
            out.append(f"{_rel(path)}:{node.lineno}: bench runs code that puts tests/ or examples/ on sys.path")
    return out


def _foreign_modules() -> set[str]:
    """Module names found under tests/ and examples/ and nowhere in bench/ (``data``, ``report``, ``support``...)."""
    return (_module_names(TESTS) | _module_names(ROOT / "examples")) - _module_names(BENCH)


def test_bench_imports_nothing_from_tests_or_examples() -> None:
    foreign = _foreign_modules()
    assert {"data", "report", "ledger_job", "processes"} <= foreign
    problems = [p for path in sorted(BENCH.rglob("*.py")) for p in bench_problems(path, foreign)]
    assert problems == [], "\n".join(problems)


def test_the_bench_rule_catches_what_it_names(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import sys\nfrom pathlib import Path\nREPO = Path(__file__).parents[1]\nT5 = REPO / 'examples' / 't5'\n"
        "sys.path[:0] = [str(REPO), str(T5)]\nsys.path.insert(0, str(REPO / 'tests'))\nfrom data import prepare\n"
        "from tests.support.processes import run\n"
        "CODE = \"import sys; sys.path.insert(0, 'examples/t5'); import data\"\n"
    )
    found = [p.split(": ", 1)[1] for p in bench_problems(bad, _foreign_modules())]
    assert found == [
        "bench imports data from tests/ or examples/ (rule 3)",
        "bench imports tests.support.processes from tests/ or examples/ (rule 3)",
        "bench puts tests/ or examples/ on sys.path (rule 3)",
        "bench puts tests/ or examples/ on sys.path (rule 3)",
        "bench runs code that puts tests/ or examples/ on sys.path",
    ]
