"""The SkyPilot task schema kept in ``schemas/skypilot-task.json`` (release and source inside), and a check.

SkyPilot checks a task with ``jsonschema``'s Draft 7 plus two keywords of its own
(``case_insensitive_enum``, ``case_sensitive_enum``; ``sky/utils/validator.py``), the task schema for the
document, the resources schema for ``resources`` and each of its ``any_of``/``ordered`` entries, and the
storage schema for each ``file_mounts`` entry that is a mapping. :func:`validate` does the same,
offline and without SkyPilot installed (it needs ``jsonschema``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

from elastrain.errors import LaunchSpecError

SCHEMA_FILE = Path(__file__).resolve().parent / "schemas" / "skypilot-task.json"


@cache
def kept() -> dict[str, Any]:
    return dict(json.loads(SCHEMA_FILE.read_text()))


@cache
def _validator_class() -> Any:
    try:
        import jsonschema
    except ImportError:
        raise LaunchSpecError("schema validation needs jsonschema: pip install jsonschema") from None

    def case_insensitive_enum(_v: Any, enums: list[str], instance: Any, _s: Any) -> Iterator[Any]:
        if isinstance(instance, str) and instance.lower() not in [e.lower() for e in enums]:
            yield jsonschema.ValidationError(f"{instance!r} is not one of {enums!r}")

    def case_sensitive_enum(_v: Any, enums: list[str], instance: Any, _s: Any) -> Iterator[Any]:
        if instance not in enums:
            yield jsonschema.ValidationError(f"{instance!r} is not one of {enums!r}")

    return jsonschema.validators.extend(
        jsonschema.Draft7Validator,
        validators={"case_insensitive_enum": case_insensitive_enum, "case_sensitive_enum": case_sensitive_enum},
    )


def _check(doc: Any, part: str, where: str) -> None:
    import jsonschema

    try:
        _validator_class()(kept()[part]).validate(doc)
    except jsonschema.ValidationError as exc:
        path = "/".join(str(p) for p in exc.absolute_path)
        raise LaunchSpecError(f"{where}{'/' + path if path else ''}: {exc.message} ({kept()['release']})") from None


def validate(task: Mapping[str, Any]) -> None:
    """A task document (one YAML document of ``sky jobs launch``); raise :class:`LaunchSpecError`."""
    _check({k: v for k, v in task.items() if v is not None}, "task", "task")
    res = task.get("resources") or {}
    _check(res, "resources", "task resources")
    for key in ("any_of", "ordered"):
        for i, alt in enumerate(res.get(key) or []):
            _check(alt, "resources", f"task resources/{key}/{i}")
    for target, mount in (task.get("file_mounts") or {}).items():
        if isinstance(mount, Mapping):
            _check(mount, "storage", f"task file_mounts/{target}")
