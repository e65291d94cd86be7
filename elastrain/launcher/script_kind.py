"""Whether a worker's script can wait for its round when started warm, read from its source without running it.

In live mode a node's workers are started *before* the node joins a round (a warm join: imports, model and
data are ready when it joins), but only a script that waits for its round before it trains may be started
that way: one that builds elastrain's ``Session``, or a Hugging Face ``Trainer`` (the zero-code integration
waits in ``trainer.train()``). Any other script would train alone, so it starts after the rendezvous, as
in restart mode. The test is on the source, with :mod:`ast`:

* ``session``: ``Session`` imported from ``elastrain`` (or ``elastrain.session``) and called;
* ``trainer``: a name ending in ``Trainer`` imported from ``transformers`` (``Trainer``,
  ``Seq2SeqTrainer``) or from ``trl``, or ``transformers.Trainer``, that is called or subclassed;
* ``other``: anything else, and a script that cannot be read or parsed.
"""

from __future__ import annotations

import ast
import enum
from collections.abc import Sequence

from elastrain.launcher.preload import script_of

_TRAINER_PACKAGES = ("transformers", "trl")


class ScriptKind(str, enum.Enum):
    SESSION = "session"
    TRAINER = "trainer"
    OTHER = "other"


def classify_source(source: str) -> ScriptKind:
    """Pure: the kind of a script's source (see the module docstring)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return ScriptKind.OTHER
    session_names: set[str] = set()
    trainer_names: set[str] = set()
    modules: set[str] = set()  # names bound to transformers/trl modules (import transformers as tf)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            top = node.module.partition(".")[0]
            for alias in node.names:
                bound = alias.asname or alias.name
                if top == "elastrain" and alias.name == "Session":
                    session_names.add(bound)
                elif top in _TRAINER_PACKAGES and alias.name.endswith("Trainer"):
                    trainer_names.add(bound)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.partition(".")[0] in _TRAINER_PACKAGES:
                    modules.add(alias.asname or alias.name.partition(".")[0])
    # Subclasses of a Trainer (class MyTrainer(Trainer)) are Trainers too.
    changed = True
    while changed:
        changed = False
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ClassDef)
                and node.name not in trainer_names
                and any(_names_trainer(base, trainer_names, modules) for base in node.bases)
            ):
                trainer_names.add(node.name)
                changed = True
    kind = ScriptKind.OTHER
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name) and node.func.id in session_names:
            return ScriptKind.SESSION
        if _names_trainer(node.func, trainer_names, modules):
            kind = ScriptKind.TRAINER
    return kind


def _names_trainer(expr: ast.expr, trainer_names: set[str], modules: set[str]) -> bool:
    if isinstance(expr, ast.Name):
        return expr.id in trainer_names
    if isinstance(expr, ast.Attribute) and expr.attr.endswith("Trainer"):
        base = expr.value
        while isinstance(base, ast.Attribute):
            base = base.value
        return isinstance(base, ast.Name) and base.id in modules
    return False


def classify(argv: Sequence[str], cwd: str, path: Sequence[str]) -> ScriptKind:
    """The kind of the script a worker runs as ``python *argv`` (``["script.py", ...]`` or ``["-m", "mod"]``)."""
    located = script_of(argv, cwd, path)
    if located is None:
        return ScriptKind.OTHER
    try:
        return classify_source(located[0].read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return ScriptKind.OTHER
