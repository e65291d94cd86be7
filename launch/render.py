"""Manifests to YAML: block style, keys in the order the builders wrote them, several documents per file."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import yaml


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # no &id001 anchors: each manifest reads on its own
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # Long commands read better folded; everything else stays plain.
    style = ">" if len(value) > 100 and "\n" not in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(docs: Sequence[dict[str, Any]], header: str = "") -> str:
    body = yaml.dump_all(list(docs), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)
    comment = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines()) if header else ""
    return comment + body


def from_yaml(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def examples_command(write: bool, write_all: Callable[[], list[str]], stale: Callable[[], list[str]], cli: str) -> int:
    """``python -m CLI examples [--write]``: rewrite the rendered examples, or fail if any is out of date."""
    if write:
        for path in write_all():
            print(f"wrote {path}")
        return 0
    bad = stale()
    for path in bad:
        print(f"stale: {path} (run python -m {cli} examples --write)", file=sys.stderr)
    return 1 if bad else 0
