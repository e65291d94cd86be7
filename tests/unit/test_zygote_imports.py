"""The zygote's preload list: a script's top-level imports, read with ast and found without importing."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from elastrain.launcher import orphans
from elastrain.launcher.preload import entrypoint_imports, find_spec, imported_names
from elastrain.launcher.zygote import Zygote


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import a", ["a"]),
        ("import a.b.c as x", ["a", "a.b", "a.b.c"]),
        ("import a, b", ["a", "b"]),
        ("from a.b import c, d as e", ["a", "a.b", "a.b:c", "a.b:d"]),
        ("from a import *", ["a"]),
        ("from . import a", []),
        ("from .a import b", []),
        ("from __future__ import annotations", []),
        ("def f():\n    import a", []),
        ("class C:\n    import a", []),
        ("if TYPE_CHECKING:\n    import a\nelse:\n    import b", ["b"]),
        ("if typing.TYPE_CHECKING:\n    import a", []),
        ("if sys.version_info >= (3, 11):\n    import a\nelse:\n    import b", ["a", "b"]),
        (
            "try:\n    import a\nexcept ImportError:\n    import b\nelse:\n    import c\nfinally:\n    import d",
            ["a", "b", "c", "d"],
        ),
        ("with ctx():\n    import a", ["a"]),
        ('if __name__ == "__main__":\n    import a', ["a"]),
        ("import a\nimport a\nfrom a import b", ["a", "a:b"]),
        ("for x in y:\n    import a", []),
        ("x = __import__('a')\nimportlib.import_module('b')", []),
    ],
)
def test_imported_names(source: str, expected: list[str]) -> None:
    assert imported_names(source) == expected


def test_imported_names_rejects_bad_syntax() -> None:
    with pytest.raises(SyntaxError):
        imported_names("import (")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """``lib/`` (like site-packages): pkg/{__init__,sub,__main__}.py, plain.py, broken.py;
    ``app/`` (the script's directory): local.py, localpkg/__init__.py."""
    files = {
        "lib/pkg/__init__.py": "X = 1\n",
        "lib/pkg/sub.py": "",
        "lib/pkg/__main__.py": "import plain\nfrom pkg import sub, X\n",
        "lib/plain.py": "",
        "lib/broken.py": "raise RuntimeError('broken at import')\n",
        "lib/nsroot/leaf.py": "",  # namespace package
        "app/local.py": "import plain\n",
        "app/localpkg/__init__.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def _script(tree: Path, source: str) -> str:
    path = tree / "app" / "train.py"
    path.write_text(textwrap.dedent(source))
    return str(path)


def test_entrypoint_imports_keeps_what_resolves_outside_the_script_directory(tree: Path) -> None:
    script = _script(
        tree,
        """
        from __future__ import annotations
        import sys, json
        import plain
        import broken
        import missing_module_xyz
        from pkg import sub, X
        from pkg.sub import anything
        import local
        from localpkg import thing
        from . import relative
        import nsroot.leaf
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            import pkg.typing_only

        def main():
            import inside_function
        """,
    )
    got = entrypoint_imports([script, "--flag"], cwd=str(tree), path=[str(tree / "lib"), *sys.path[1:]])
    # sys: built in; missing_module_xyz: not found; local, localpkg: the script's own; X, anything: names
    # read from pkg and pkg.sub; TYPE_CHECKING: a name in the standard library, which has nothing to load.
    # broken is found (it fails only when imported: the zygote logs and skips it).
    assert got == [
        "json",
        "plain",
        "broken",
        "pkg",
        "pkg.sub",
        "pkg:X",
        "pkg.sub:anything",
        "nsroot",
        "nsroot.leaf",
        "typing",
    ]


def test_entrypoint_imports_of_a_module_and_a_package(tree: Path) -> None:
    path = [str(tree / "lib"), *sys.path[1:]]
    (tree / "lib" / "runme.py").write_text("import plain\nimport pkg.sub\n")
    assert entrypoint_imports(["-m", "runme", "x"], cwd=str(tree / "app"), path=path) == ["plain", "pkg", "pkg.sub"]
    # python -m pkg imports pkg, then runs pkg/__main__.py
    assert entrypoint_imports(["-m", "pkg"], cwd=str(tree / "app"), path=path) == ["pkg", "plain", "pkg.sub", "pkg:X"]
    # python -m pkg.sub imports pkg first
    assert entrypoint_imports(["-m", "pkg.sub"], cwd=str(tree / "app"), path=path) == ["pkg"]
    # with -m, the working directory is sys.path[0]: its modules are the user's own, what they import is not
    assert entrypoint_imports(["-m", "local"], cwd=str(tree / "app"), path=path) == ["plain"]
    assert entrypoint_imports(["-m", "localpkg"], cwd=str(tree / "app"), path=path) == []


@pytest.mark.parametrize(
    "argv",
    [[], ["-c", "import json"], ["missing.py"], ["-m", "missing_module_xyz"], ["-m"], ["app/bad.py"], ["data.bin"]],
)
def test_entrypoint_imports_preloads_nothing_for_what_it_cannot_read(tree: Path, argv: list[str]) -> None:
    (tree / "app" / "bad.py").write_text("import (\n")
    (tree / "data.bin").write_bytes(b"\xff\xfe\x00")
    assert entrypoint_imports(argv, cwd=str(tree), path=[str(tree / "lib")]) == []


def test_find_spec_imports_nothing(tree: Path) -> None:
    found = find_spec("pkg.sub", str(tree / "app"), [str(tree / "lib")])
    assert found is not None and found[1] is False
    assert "pkg" not in sys.modules and "broken" not in sys.modules
    assert find_spec("broken", str(tree / "app"), [str(tree / "lib")]) is not None
    assert "broken" not in sys.modules
    local = find_spec("local", str(tree / "app"), [str(tree / "lib")])
    assert local is not None and local[1] is True and local[0].origin == str(tree / "app" / "local.py")
    assert find_spec("pkg.X", str(tree / "app"), [str(tree / "lib")]) is None  # a name, not a submodule
    assert find_spec("plain.sub", str(tree / "app"), [str(tree / "lib")]) is None  # plain is no package
    assert find_spec("not an identifier", str(tree / "app"), [str(tree / "lib")]) is None


def test_the_t5_example_preloads_its_installed_imports_not_its_own_modules() -> None:
    repo = Path(__file__).resolve().parents[2]
    got = entrypoint_imports([str(repo / "examples" / "t5" / "train.py")], cwd=str(repo))
    assert "torch" in got and "elastrain.session" in got
    assert "data" not in got and "model" not in got  # examples/t5/data.py, model.py: the script's own


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        ([], {}, True),  # the default
        (["--zygote", "false"], {}, False),
        (["--zygote=0"], {}, False),
        (["--zygote", "true"], {"PET_ZYGOTE": "false"}, True),  # the flag wins over the variable
        ([], {"PET_ZYGOTE": "false"}, False),
        ([], {"PET_ZYGOTE": "off"}, False),
    ],
)
def test_zygote_option(
    argv: list[str], environ: dict[str, str], expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from elastrain.launcher.options import ElastrainOptions, build_parser, options_from_args

    monkeypatch.delenv("PET_ZYGOTE", raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    assert options_from_args(build_parser().parse_args([*argv, "train.py"])).zygote is expected
    assert ElastrainOptions().zygote is True


@pytest.mark.parametrize(
    "command", [("/bin/sleep", ["5"]), orphans.wrap("/bin/sleep", ["5"]), (sys.executable, ["-c", "x"])]
)
def test_no_zygote_for_a_command_it_could_not_fork(command: tuple[str, list[object]]) -> None:
    # --no-python jobs (bench/scale.py runs 64 agents of `sleep`) must not pay for a zygote's torch import.
    assert Zygote.for_entrypoint(*command) is None
