"""Data for the T5 example: code → docstring pairs from the Python standard library, offline and deterministic.

Every function in the standard library that has a docstring gives one pair: its source with the
docstring removed (the input) and the first paragraph of the docstring (the target). That is about
6k pairs, the same on every machine with the same Python, with nothing to download.

The pairs and the BPE tokenizer are written once to a directory beside the checkpoints, so every
rank and every restart sees the same examples and the same token ids. Also importable by the
DeepSpeed and HF Trainer variants (``build_dataset``, ``train_tokenizer``, ``load_tokenizer``).
"""

from __future__ import annotations

import ast
import json
import os
import random
import sysconfig
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

PAIRS_FILE = "pairs.json"
TOKENIZER_FILE = "tokenizer.json"
PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
# The task prefix T5 expects in front of every input.
PREFIX = "summarize: "

_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class Pair:
    id: int
    source: str
    target: str


# -- building the pairs ---------------------------------------------------------------------------
def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's own ``.py`` files in a fixed order, without its tests and tools."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("test"))
        out.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py") and not f.startswith("test"))
    return sorted(out)


def first_paragraph(docstring: str) -> str:
    """The docstring's first paragraph on one line."""
    para = docstring.strip().split("\n\n", 1)[0]
    return " ".join(para.split())


def pairs_from_source(text: str, max_source_chars: int = 2000) -> Iterator[tuple[str, str]]:
    """(source without docstring, first paragraph of docstring) for every documented function in ``text``."""
    tree = ast.parse(text)
    lines = text.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or node.end_lineno is None:
            continue
        target = first_paragraph(doc)
        first = node.body[0]
        if not 8 <= len(target) <= 300 or first.end_lineno is None or len(node.body) < 2:
            continue
        start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        body = lines[start - 1 : first.lineno - 1] + lines[first.end_lineno : node.end_lineno]
        source = textwrap.dedent("\n".join(body)).strip()
        if source and len(source) <= max_source_chars:
            yield source, target


def build_pairs(root: Path | None = None) -> list[Pair]:
    """Every pair from the standard library, de-duplicated, in a fixed seeded order."""
    seen: set[tuple[str, str]] = set()
    found: list[tuple[str, str]] = []
    for path in stdlib_files(root):
        try:
            text = path.read_text(encoding="utf-8")
            for pair in pairs_from_source(text):
                if pair not in seen:
                    seen.add(pair)
                    found.append(pair)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
    random.Random(0).shuffle(found)
    return [Pair(i, s, t) for i, (s, t) in enumerate(found)]


def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


def _wait_for(path: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f}s: did rank 0 fail while building it?")
        time.sleep(0.2)


def load_pairs(data_dir: str | os.PathLike[str], rank: int = 0) -> list[Pair]:
    """The pairs cached in ``data_dir``, built there by rank 0 on first use (other ranks wait for the file)."""
    path = Path(data_dir) / PAIRS_FILE
    if not path.exists():
        if rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            pairs = build_pairs()
            rows = [[p.source, p.target] for p in pairs]
            _write_atomic(path, lambda tmp: tmp.write_text(json.dumps(rows)))
        else:
            _wait_for(path)
    rows = json.loads(path.read_text())
    return [Pair(i, s, t) for i, (s, t) in enumerate(rows)]


def split(pairs: Sequence[Pair], eval_size: int, limit: int | None = None) -> tuple[list[Pair], list[Pair]]:
    """A fixed held-out set (the last ``eval_size`` pairs) and the training pairs (at most ``limit``)."""
    if not 0 < eval_size < len(pairs):
        raise ValueError(f"--eval-size must be between 1 and {len(pairs) - 1}, got {eval_size}")
    train, held_out = list(pairs[:-eval_size]), list(pairs[-eval_size:])
    return (train[:limit] if limit else train), held_out


# -- tokenizer ------------------------------------------------------------------------------------
def train_tokenizer(texts: Sequence[str], vocab_size: int = 4096) -> Any:
    """A byte-level BPE tokenizer trained on ``texts`` (about a second), wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, EOS, UNK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, tok.token_to_id(EOS))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK)


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(path), pad_token=PAD, eos_token=EOS, unk_token=UNK)


def tokenizer_for(
    data_dir: str | os.PathLike[str], pairs: Sequence[Pair], rank: int = 0, vocab_size: int = 4096
) -> Any:
    """The run's tokenizer: trained by rank 0 on the training pairs once, then loaded from ``data_dir``."""
    path = Path(data_dir) / TOKENIZER_FILE
    if not path.exists():
        if rank == 0:
            tok = train_tokenizer([PREFIX + p.source for p in pairs] + [p.target for p in pairs], vocab_size)
            _write_atomic(path, lambda tmp: tok.backend_tokenizer.save(str(tmp)))
        else:
            _wait_for(path)
    return load_tokenizer(path)


def prepare(data_dir: str | os.PathLike[str], eval_size: int = 256) -> None:
    """Build the pairs and the tokenizer in ``data_dir`` ahead of a run (the first run would do it otherwise)."""
    train, _ = split(load_pairs(data_dir), eval_size)
    tokenizer_for(data_dir, train)


# -- the dataset ----------------------------------------------------------------------------------
class CodeDocstringDataset(Dataset[dict[str, Any]]):
    """Pre-tokenized pairs; item ``i`` carries its sample id so a test can audit exactly-once use."""

    def __init__(self, pairs: Sequence[Pair], tokenizer: Any, max_source_len: int = 128, max_target_len: int = 32):
        enc = tokenizer([PREFIX + p.source for p in pairs], max_length=max_source_len, truncation=True)
        dec = tokenizer([p.target for p in pairs], max_length=max_target_len, truncation=True)
        self.ids = [p.id for p in pairs]
        self.targets = [p.target for p in pairs]
        self.input_ids: list[list[int]] = enc["input_ids"]
        self.labels: list[list[int]] = dec["input_ids"]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"id": self.ids[i], "input_ids": self.input_ids[i], "labels": self.labels[i]}


def collate(pad_id: int) -> Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]]:
    """Pad a list of items into tensors; padded label positions are -100 (ignored by the loss)."""

    def fn(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        src = max(len(x["input_ids"]) for x in items)
        tgt = max(len(x["labels"]) for x in items)
        input_ids = torch.full((len(items), src), pad_id, dtype=torch.long)
        labels = torch.full((len(items), tgt), -100, dtype=torch.long)
        for row, x in enumerate(items):
            input_ids[row, : len(x["input_ids"])] = torch.tensor(x["input_ids"])
            labels[row, : len(x["labels"])] = torch.tensor(x["labels"])
        return {
            "ids": torch.tensor([x["id"] for x in items]),
            "input_ids": input_ids,
            "attention_mask": (input_ids != pad_id).long(),
            "labels": labels,
        }

    return fn


def hub_pairs(
    name: str, source_key: str | None = None, target_key: str | None = None, limit: int = 20000
) -> list[Pair]:
    """Pairs from a Hugging Face dataset (``--dataset``, e.g. ``cnn_dailymail``); needs ``datasets`` and a network."""
    try:
        import datasets
    except ImportError:
        raise SystemExit("--dataset needs the `datasets` package: pip install datasets") from None
    known = {"cnn_dailymail": ("3.0.0", "article", "highlights"), "xsum": (None, "document", "summary")}
    config, src_key, tgt_key = known.get(name, (None, source_key or "document", target_key or "summary"))
    ds = datasets.load_dataset(name, config, split="train")
    rows = ds.select(range(min(limit, len(ds))))
    return [Pair(i, str(r[source_key or src_key]), str(r[target_key or tgt_key])) for i, r in enumerate(rows)]


def build_dataset(
    data_dir: str | os.PathLike[str],
    tokenizer: Any | None = None,
    *,
    rank: int = 0,
    eval_size: int = 256,
    limit: int | None = None,
    dataset: str | None = None,
    max_source_len: int = 128,
    max_target_len: int = 32,
) -> tuple[CodeDocstringDataset, CodeDocstringDataset, Any]:
    """(train set, held-out set, tokenizer); the tokenizer is trained here unless one is given."""
    pairs = hub_pairs(dataset) if dataset else load_pairs(data_dir, rank)
    train_all, eval_pairs = split(pairs, eval_size)
    tok = tokenizer if tokenizer is not None else tokenizer_for(data_dir, train_all, rank)
    train_pairs = train_all[:limit] if limit else train_all
    return (
        CodeDocstringDataset(train_pairs, tok, max_source_len, max_target_len),
        CodeDocstringDataset(eval_pairs, tok, max_source_len, max_target_len),
        tok,
    )


# -- evaluation -----------------------------------------------------------------------------------
def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 on whitespace tokens, with a plain longest-common-subsequence table."""
    a, b = prediction.split(), reference.split()
    if not a or not b:
        return 0.0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(a), lcs / len(b)
    return 2 * precision * recall / (precision + recall)


if __name__ == "__main__":
    import argparse

    cli = argparse.ArgumentParser(description="Build the pairs and the tokenizer in DATA_DIR ahead of a run.")
    cli.add_argument("data_dir")
    cli.add_argument("--eval-size", type=int, default=256, help="held-out pairs (train.py's --eval-size)")
    given = cli.parse_args()
    prepare(given.data_dir, eval_size=given.eval_size)
