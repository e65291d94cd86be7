"""The T5 example's data helpers: pairs from source, ROUGE-L, collation (pure and fast: no stdlib scan)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"t5_{name}", REPO / "examples" / "t5" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


data = _load("data")

SOURCE = '''
import functools

def plain(x):
    """Double a number.

    Longer explanation that is not part of the target.
    """
    return 2 * x

class Box:
    @functools.cache
    def method(self, y):
        """Add   y to the box
        and return it."""
        self.v += y
        return self.v

def undocumented():
    return 1

def only_docstring():
    """Nothing else here."""
'''


def test_pairs_from_source_strips_the_docstring_and_keeps_its_first_paragraph():
    pairs = list(data.pairs_from_source(SOURCE))
    assert pairs == [
        ("def plain(x):\n    return 2 * x", "Double a number."),
        (
            "@functools.cache\ndef method(self, y):\n    self.v += y\n    return self.v",
            "Add y to the box and return it.",
        ),
    ]


def test_first_paragraph_joins_lines():
    assert data.first_paragraph("  One\n  two.\n\n  Three.") == "One two."


@pytest.mark.parametrize(
    ("pred", "ref", "expected"),
    [
        ("a b c", "a b c", 1.0),
        ("", "a", 0.0),
        ("x y", "a b", 0.0),
        ("a x b", "a b", 2 * (2 / 3) * 1.0 / (2 / 3 + 1.0)),
        ("return the value", "Return the cached value", 2 * (2 / 3) * (2 / 4) / (2 / 3 + 2 / 4)),
    ],
)
def test_rouge_l(pred, ref, expected):
    assert data.rouge_l(pred, ref) == pytest.approx(expected)


def test_split_holds_out_the_last_pairs():
    pairs = [data.Pair(i, f"s{i}", f"t{i}") for i in range(10)]
    train, held_out = data.split(pairs, eval_size=3, limit=4)
    assert [p.id for p in train] == [0, 1, 2, 3]
    assert [p.id for p in held_out] == [7, 8, 9]
    with pytest.raises(ValueError, match="--eval-size"):
        data.split(pairs, eval_size=10)


def test_collate_pads_inputs_and_masks_labels():
    fn = data.collate(pad_id=0)
    batch = fn([{"id": 5, "input_ids": [3, 4, 1], "labels": [7, 1]}, {"id": 9, "input_ids": [6, 1], "labels": [1]}])
    assert batch["ids"].tolist() == [5, 9]
    assert batch["input_ids"].tolist() == [[3, 4, 1], [6, 1, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[7, 1], [1, -100]]


def test_stdlib_files_skip_tests(tmp_path):
    for rel in ("a.py", "pkg/b.py", "test/c.py", "tests/d.py", "pkg/test_e.py", "idlelib/f.py", "notes.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert [p.relative_to(tmp_path).as_posix() for p in data.stdlib_files(tmp_path)] == ["a.py", "pkg/b.py"]


def test_tokenizer_round_trip_and_dataset(tmp_path):
    pairs = [data.Pair(i, f"def f{i}(x):\n    return x + {i}", f"Add {i} to x.") for i in range(40)]
    tok = data.tokenizer_for(tmp_path, pairs, vocab_size=300)
    assert (tmp_path / data.TOKENIZER_FILE).exists()
    again = data.tokenizer_for(tmp_path, pairs)  # loaded, not retrained
    assert again("Add 3 to x.")["input_ids"] == tok("Add 3 to x.")["input_ids"]
    assert tok.decode(tok("Add 3 to x.")["input_ids"], skip_special_tokens=True) == "Add 3 to x."
    ds = data.CodeDocstringDataset(pairs, tok, max_source_len=8, max_target_len=4)
    item = ds[7]
    assert item["id"] == 7
    assert len(item["input_ids"]) <= 8 and len(item["labels"]) <= 4
    assert item["labels"][-1] == tok.eos_token_id or len(item["labels"]) == 4
