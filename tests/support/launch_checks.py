"""What the launch tests share: the repository as the platforms' tools see it, and what the image holds of it."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from pathlib import Path

from elastrain.platforms import image, needs

REPO = Path(__file__).resolve().parents[2]


def dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip().rstrip("/") for line in lines if line.strip() and not line.startswith("#")]


def dockerignored(relpath: str) -> bool:
    """Whether a .dockerignore pattern leaves ``relpath`` out of the image (Docker's rule: a pattern matches the
    path or one of its parent folders; ``**`` matches any number of folders)."""
    parts = Path(relpath).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in dockerignore():
        if pattern.startswith("!"):
            raise AssertionError(f".dockerignore: exceptions ({pattern}) are not modelled by this test")
        for prefix in prefixes:
            if fnmatch.fnmatchcase(prefix, pattern) or (
                pattern.startswith("**/") and fnmatch.fnmatchcase(prefix.split("/")[-1], pattern[3:])
            ):
                return True
    return False


def in_image(relpath: str) -> bool:
    """Whether the Dockerfile's ``COPY . .`` copies ``relpath``: it exists here and .dockerignore keeps it."""
    return (REPO / relpath).exists() and not dockerignored(relpath)


def script_of(args: Sequence[str]) -> int:
    """The index of the training script in a command's arguments: the first ``.py`` argument."""
    return next(i for i, a in enumerate(args) if a.endswith(".py"))


def check_script(script: Path, args: Sequence[str], extras: Sequence[str], requirements: Sequence[str] = ()) -> None:
    """The script exists, the install gives every module it imports, and it defines every flag it is given."""
    assert script.is_file(), f"{script} does not exist"
    assert needs.missing_imports(script, extras, requirements) == [], (
        f"{script} imports what elastrain[{','.join(extras)}] {' '.join(requirements)} does not install"
    )
    assert needs.unknown_options(script, args) == [], f"{script} does not take these flags"


def check_image_script(args: Sequence[str]) -> None:
    """A container's script, run from the image's working directory (the checkout the Dockerfile copies)."""
    i = script_of(args)
    assert in_image(args[i]), f"{args[i]} is not in the image (missing here, or left out by .dockerignore)"
    check_script(REPO / args[i], args[i + 1 :], image.EXTRAS)
