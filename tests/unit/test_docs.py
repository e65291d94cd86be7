"""The docs resolve: every relative link, and every command they quote, names what exists.

Read from README.md, docs/*.md, launch/README.md and examples/**/README.md, outside and inside code:

* a relative link (``[text](path)``, ``[text](path#anchor)``, ``[text](#anchor)``, an image) names a file of the
  repository, and its anchor a heading of that file (GitHub's slugs);
* a command quoted in a code block or in inline code that starts with ``python ``, ``elastrain-run `` or ``./dev ``
  names a file that exists (a script, a ``-m`` module, a ``./dev`` subcommand) and only flags that exist: for
  ``elastrain-run``, the flags of the parser that elastrain's launcher options module builds; for a python file of
  the repository, the flags its argparse defines (``add_argument`` calls read with :mod:`ast`, in the file and in
  the repository modules it imports, never by running it). A script that defines no flags that way (Hugging Face's
  ``HfArgumentParser`` takes them from dataclasses) has its flags unchecked; its file must still exist.

Placeholders are left alone: a path or module with ``<...>`` in it (``elastrain.platforms.<platform>``), and the
reader's own training script after ``elastrain-run`` when it is a bare file name (``train.py``). Each problem is
one line: ``FILE:LINE: what does not resolve``. And README.md stays under 1,500 words: the details live in docs/.
"""

from __future__ import annotations

import argparse
import ast
import functools
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("python", "elastrain-run", "./dev")
SHELL_BREAKS = {"&&", "||", "|", ";", ">", ">>", "<", "2>&1"}
NON_SHELL_BLOCKS = {"python", "py", "yaml", "yml", "json", "toml", "text", "console-output", "ini"}
README_WORDS = 1500
FLAG = re.compile(r"^--?[A-Za-z][\w-]*(=.*)?$")


def doc_files() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "launch" / "README.md"]
    found += sorted((ROOT / "examples").glob("**/README.md"))
    return [p for p in found if p.is_file()]


@dataclass(frozen=True)
class Snippet:
    """A piece of a markdown file: inline text (links and inline code live there) or one logical line of code."""

    line: int
    text: str
    code: bool
    shell: bool = False


def snippets(path: Path) -> Iterator[Snippet]:
    """The file's prose (with code blocks blanked, so line numbers hold) and each shell line of its code blocks."""
    lines = path.read_text(encoding="utf-8").split("\n")
    prose: list[str] = []
    fence: str | None = None
    language = ""
    pending: tuple[int, str] | None = None
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if fence is None and stripped.startswith(("```", "~~~")):
            fence, language = stripped[:3], stripped[3:].strip().lower()
            prose.append("")
            continue
        if fence is not None:
            prose.append("")
            if stripped.startswith(fence):
                fence = None
                continue
            if language in NON_SHELL_BLOCKS:
                continue
            start, text = pending if pending else (number, "")
            text += " " + stripped
            if text.endswith("\\"):
                pending = (start, text[:-1])
                continue
            pending = None
            yield Snippet(start, text.strip(), code=True, shell=True)
            continue
        prose.append(line)
    yield Snippet(1, "\n".join(prose), code=False)


def inline_code(prose: str) -> Iterator[tuple[int, str]]:
    """Inline code spans (within a paragraph) with the line each starts on."""
    for match in re.finditer(r"`((?:[^`\n]|\n(?![ \t]*\n))+)`", prose):
        yield prose.count("\n", 0, match.start()) + 1, match.group(1).replace("\n", " ")


def links(prose: str) -> Iterator[tuple[int, str]]:
    without_code = re.sub(r"`[^`\n]*`", lambda m: " " * len(m.group(0)), prose)
    for match in re.finditer(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", without_code):
        yield without_code.count("\n", 0, match.start()) + 1, match.group(1)


# -- anchors ---------------------------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link's text stays, its target goes
    text = text.lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found: set[str] = set()
    for snippet in snippets(path):
        if snippet.code:
            continue
        for line in snippet.text.split("\n"):
            match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if not match:
                continue
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def check_link(doc: Path, target: str) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
        return None
    file_part, _, anchor = target.partition("#")
    dest = (doc.parent / file_part).resolve() if file_part else doc
    if not dest.exists():
        return f"link {target!r}: no file {rel(dest)}"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"link {target!r}: {rel(dest)} has no heading with anchor #{anchor}"
    return None


def rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


# -- flags -----------------------------------------------------------------------------------------------------


@functools.cache
def launcher_parser() -> argparse.ArgumentParser:
    from elastrain.launcher.options import build_parser

    return build_parser()


def launcher_takes_value(flag: str) -> bool | None:
    """Whether elastrain-run's ``flag`` takes a value; None when the parser does not know it."""
    # argparse has no public lookup of an option string; its own table is the parser's truth.
    action = launcher_parser()._option_string_actions.get(flag)
    if action is None:
        return None
    return action.nargs != 0


def module_file(module: str) -> Path | None:
    """The repository file ``python -m module`` runs, or None when the module is not in the repository."""
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__main__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_files(path: Path, tree: ast.Module) -> list[Path]:
    """Repository files that ``path`` imports: elastrain modules, and modules beside the script."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    found: list[Path] = []
    for name in names:
        parts = name.split(".")
        for base in (ROOT, path.parent):
            candidate = base.joinpath(*parts)
            for file in (candidate.with_suffix(".py"), candidate / "__init__.py"):
                if file.is_file() and file != path:
                    found.append(file)
    return found


def add_argument_flags(tree: ast.Module) -> set[str]:
    flags: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            negatable = any(
                kw.arg == "action" and ast.unparse(kw.value).endswith("BooleanOptionalAction") for kw in node.keywords
            )
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("-"):
                    flags.add(arg.value)
                    if negatable and arg.value.startswith("--"):
                        flags.add("--no-" + arg.value[2:])  # argparse.BooleanOptionalAction's other half
    return flags


@functools.cache
def script_flags(path: Path) -> frozenset[str] | None:
    """The flags a repository script's argparse defines (with the repository modules it imports); None: none."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    flags = add_argument_flags(tree)
    if not flags:
        return None  # no argparse here: the flags come from elsewhere (HfArgumentParser's dataclasses)
    for file in imported_files(path, tree):
        flags |= add_argument_flags(ast.parse(file.read_text(encoding="utf-8"), filename=str(file)))
    return frozenset(flags | {"-h", "--help"})


@functools.cache
def dev_subcommands() -> frozenset[str]:
    return frozenset(re.findall(r"^\s*([a-z][\w-]*)\)", (ROOT / "dev").read_text(encoding="utf-8"), re.MULTILINE))


def is_placeholder(token: str) -> bool:
    return "<" in token or "..." in token or "$" in token


def flag_name(token: str) -> str | None:
    return token.split("=", 1)[0] if FLAG.match(token) else None


def check_script_args(path: Path, args: list[str], what: str) -> list[str]:
    flags = script_flags(path)
    if flags is None:
        return check_passed_script(args[args.index("--") + 1 :], what) if "--" in args else []
    problems: list[str] = []
    for i, token in enumerate(args):
        if token == "--":  # what follows is the training script a spec or harness runs, and its arguments
            return problems + check_passed_script(args[i + 1 :], what)
        name = flag_name(token)
        if name and name not in flags:
            problems.append(f"{what}: {rel(path)} defines no flag {name}")
    return problems


def check_passed_script(args: list[str], what: str) -> list[str]:
    """``... -- examples/t5/train.py --flag``: the script exists and takes the flags."""
    if not args or not args[0].endswith(".py") or is_placeholder(args[0]) or "/" not in args[0]:
        return []
    path = ROOT / args[0]
    if not path.is_file():
        return [f"{what}: no file {args[0]}"]
    return check_script_args(path, args[1:], what)


def check_python(tokens: list[str], what: str) -> list[str]:
    rest = tokens[1:]
    while rest and rest[0] in ("-u", "-B", "-O", "-X"):
        rest = rest[2:] if rest[0] == "-X" else rest[1:]
    if not rest or rest[0] == "-c":
        return []
    if rest[0] == "-m":
        if len(rest) < 2 or is_placeholder(rest[1]):
            return []
        module = rest[1]
        if module == "elastrain":  # python -m elastrain is elastrain-run
            return check_launcher(["elastrain-run", *rest[2:]], what)
        target = module_file(module)
        if target is None:
            return [f"{what}: no module {module} in the repository"]
        return check_script_args(target, rest[2:], what)
    script = rest[0]
    if is_placeholder(script):
        return []
    path = ROOT / script
    if not path.is_file():
        return [f"{what}: no file {script}"]
    return check_script_args(path, rest[1:], what) if path.suffix == ".py" else []


def check_launcher(tokens: list[str], what: str) -> list[str]:
    problems: list[str] = []
    rest = tokens[1:]
    module = no_python = False
    while rest:
        token = rest.pop(0)
        if token == "--":
            break
        name = flag_name(token)
        if name is None:
            rest.insert(0, token)
            break
        takes_value = launcher_takes_value(name)
        if takes_value is None:
            problems.append(f"{what}: elastrain-run has no flag {name}")
            continue
        module = module or name in ("-m", "--module")
        no_python = no_python or name in ("--no-python", "--no_python")
        if takes_value and "=" not in token and rest:
            rest.pop(0)
    if not rest or no_python or is_placeholder(rest[0]):
        return problems
    script, args = rest[0], rest[1:]
    if module:
        target = module_file(script)
        if target is None:
            return [*problems, f"{what}: no module {script} in the repository"]
        return problems + check_script_args(target, args, what)
    path = ROOT / script
    if path.is_file():
        return problems + (check_script_args(path, args, what) if path.suffix == ".py" else [])
    if "/" not in script:
        return problems  # the reader's own script (train.py)
    return [*problems, f"{what}: no file {script}"]


def check_command(text: str) -> list[str]:
    """Problems with one quoted command (empty when it is not a command this check reads)."""
    text = text.strip()
    text = text.removeprefix("$ ")
    if not text.startswith(tuple(f"{c} " for c in COMMANDS)) and text not in COMMANDS:
        return []
    what = f"command {text[:70] + ('...' if len(text) > 70 else '')!r}"
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError as e:
        return [f"{what}: cannot be split like a shell would ({e})"]
    for i, token in enumerate(tokens):
        if token in SHELL_BREAKS or token.startswith((">", "2>")):
            tokens = tokens[:i]
            break
    if tokens[0] == "python":
        return check_python(tokens, what)
    if tokens[0] == "elastrain-run":
        return check_launcher(tokens, what)
    if len(tokens) < 2 or tokens[1] not in dev_subcommands():
        return [f"{what}: ./dev has no subcommand {tokens[1] if len(tokens) > 1 else '(none)'}"]
    return []


def problems_in(path: Path) -> list[str]:
    found: list[str] = []
    for snippet in snippets(path):
        if snippet.code:
            found += [f"{rel(path)}:{snippet.line}: {p}" for p in check_command(snippet.text)]
            continue
        for line, target in links(snippet.text):
            problem = check_link(path, target)
            if problem:
                found.append(f"{rel(path)}:{line}: {problem}")
        for line, code in inline_code(snippet.text):
            found += [f"{rel(path)}:{line}: {p}" for p in check_command(code)]
    return found


# -- the tests -------------------------------------------------------------------------------------------------


def test_the_docs_are_found() -> None:
    names = {rel(p) for p in doc_files()}
    assert {"README.md", "launch/README.md", "docs/architecture.md"} <= names, names


def test_the_readme_stays_short() -> None:
    """README.md says what elastrain is, how to run it and where to read on; the details live in docs/."""
    words = len((ROOT / "README.md").read_text(encoding="utf-8").split())  # as `wc -w` counts
    assert words <= README_WORDS, f"README.md: {words} words, over {README_WORDS}: move the detail to a docs/ page"


def test_every_link_and_quoted_command_resolves() -> None:
    problems = [p for doc in doc_files() for p in problems_in(doc)]
    assert not problems, "\n" + "\n".join(problems)


def test_the_check_finds_what_does_not_resolve(tmp_path: Path) -> None:
    """A broken link, a missing anchor, an unknown flag and a missing script each give one line."""
    doc = ROOT / "docs" / "architecture.md"
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n"
        "[ok](#title) [gone](no-such-file.md) [anchor](#no-such-heading)\n\n"
        "`elastrain-run --nnodes 1:2 --no-such-flag 3 train.py`\n\n"
        "```bash\npython bench/soak.py --seed 3 \\\n    --no-such-option\npython bench/no_such_bench.py\n```\n"
        "`./dev frobnicate` and `python -m elastrain.platforms.kubernetes trainjob --no-such-thing`\n"
        "`python -m elastrain.platforms.slurm render --name t5 -- examples/t5/gone.py`\n",
        encoding="utf-8",
    )
    found = problems_in(page)
    assert len(found) == 8, "\n".join(found)
    assert any(":3: link 'no-such-file.md': no file" in p for p in found), found
    assert any(":3: link '#no-such-heading'" in p for p in found), found
    assert any(":5: " in p and "elastrain-run has no flag --no-such-flag" in p for p in found), found
    assert any(":8: " in p and "bench/soak.py defines no flag --no-such-option" in p for p in found), found
    assert any(":10: " in p and "no file bench/no_such_bench.py" in p for p in found), found
    assert any(":12: " in p and "./dev has no subcommand frobnicate" in p for p in found), found
    assert any(":12: " in p and "kubernetes/__main__.py defines no flag --no-such-thing" in p for p in found), found
    assert any(":13: " in p and "no file examples/t5/gone.py" in p for p in found), found
    assert check_link(doc, "../README.md#dive-into-the-code") is None


def test_slugs_follow_github() -> None:
    assert slug("The preemption demo (`./dev demo`)") == "the-preemption-demo-dev-demo"
    assert slug("One job per run id: the fencing generation") == "one-job-per-run-id-the-fencing-generation"
    assert slug("etcd v3 rendezvous (`--rdzv-backend etcd-v3`)") == "etcd-v3-rendezvous---rdzv-backend-etcd-v3"
