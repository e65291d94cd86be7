"""Manifests to YAML (block style, keys in the order the builders wrote them), and the rendered examples.

Every platform renders its examples from parameters kept in its ``example_specs`` module into
``launch/<platform>/`` at the top of the source checkout: data for people to read and copy, never
imported. CI checks that each file equals its rendering (``python -m elastrain.platforms.<platform>
examples`` exits 1 when one is stale; ``--write`` renders them again).
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

# elastrain/platforms/render.py -> the checkout holding elastrain/ (and launch/, in a source checkout)
_CHECKOUT = Path(__file__).resolve().parents[2]


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # no &id001 anchors: each manifest reads on its own
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # Long commands read better folded; multi-line scripts as literal blocks; everything else stays plain.
    if "\n" in value:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")
    style = ">" if len(value) > 100 else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(docs: Sequence[Mapping[str, Any]], header: str = "") -> str:
    body = yaml.dump_all(list(docs), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)
    return comment(header) + body


def comment(header: str, prefix: str = "# ") -> str:
    """``header`` as a block of comment lines (empty for an empty header)."""
    return "".join(f"{prefix}{line}".rstrip() + "\n" for line in header.splitlines()) if header else ""


def from_yaml(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def warnings_block(notes: Sequence[str]) -> str:
    """Warnings for an example's header: one wrapped bullet each (empty when there are none)."""
    if not notes:
        return ""
    return "\nWarnings:\n" + "\n".join(textwrap.fill(w, 96, initial_indent="- ", subsequent_indent="  ") for w in notes)


def examples_dir(platform: str) -> Path:
    """``launch/<platform>/`` of the source checkout this package runs from, else under the working directory."""
    root = _CHECKOUT if (_CHECKOUT / "launch").is_dir() else Path.cwd()
    return root / "launch" / platform


def stale_files(rendered: Mapping[str, str], directory: Path) -> list[str]:
    """Files in ``directory`` that differ from their rendering (or are missing)."""
    return [
        str(directory / name)
        for name, text in rendered.items()
        if not (directory / name).is_file() or (directory / name).read_text() != text
    ]


def write_files(rendered: Mapping[str, str], directory: Path) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in rendered.items():
        (directory / name).write_text(text)
    return [str(directory / name) for name in rendered]


def examples_command(write: bool, rendered: Callable[[], Mapping[str, str]], platform: str) -> int:
    """``python -m elastrain.platforms.PLATFORM examples [--write]``: rewrite the examples, or fail if one is stale."""
    directory = examples_dir(platform)
    if write:
        for path in write_files(rendered(), directory):
            print(f"wrote {path}")
        return 0
    bad = stale_files(rendered(), directory)
    for path in bad:
        print(f"stale: {path} (run python -m elastrain.platforms.{platform} examples --write)", file=sys.stderr)
    return 1 if bad else 0
