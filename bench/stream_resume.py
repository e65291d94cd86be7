"""Iterable-set bench: what it costs a Trainer worker to reach position ``p`` of an iterable training set.

    python bench/stream_resume.py                        # positions 1000 and 8000, plain and buffer-shuffled
    python bench/stream_resume.py --positions 20000

The set is ``run_clm.py --streaming``'s pipeline: a local text file read as a ``datasets`` stream, tokenized and
grouped into 32-token blocks by lazy ``map`` (the tiny GPT-2 tokenizer and text of ``examples/hf/make_assets.py``,
built once under ``runs/``). Side by side, in one run and one process: the baseline reads the stream again from
its start up to ``p`` (what a restart of transformers' own resume of an iterable set does, and what elastrain
does for a set that keeps no place), elastrain resumes the set from the place a reader noted at ``p``
(:class:`~elastrain.integrations.trainer.iterable.IterableStream`, ``datasets``' ``state_dict``) and reads its
first eight samples. Every line checks that both give the same samples; a shuffle buffer is not kept in a
``datasets`` state, so there the resume is refused by its check and the set is read again (and the ratio is ~1).
"""

from __future__ import annotations

import argparse
import sys
import time
from itertools import chain
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from elastrain.integrations.trainer.iterable import IterableStream  # noqa: E402


def pipeline(assets: Path, shuffled: bool) -> Any:
    from datasets import load_dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets / "gpt2")
    data = load_dataset("text", data_files={"train": str(assets / "text" / "train.txt")}, streaming=True)["train"]
    data = data.map(lambda ex: tokenizer(ex["text"]), batched=True, remove_columns=["text"])

    def group(ex: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        joined = {k: list(chain(*v)) for k, v in ex.items()}
        n = len(joined["input_ids"]) // 32 * 32
        return {k: [t[i : i + 32] for i in range(0, n, 32)] for k, t in joined.items()}

    data = data.map(group, batched=True)
    return data.shuffle(seed=3, buffer_size=200) if shuffled else data


def measure(assets: Path, position: int, shuffled: bool) -> str:
    ahead = IterableStream(pipeline(assets, shuffled), lookback=64, mark_every=8)
    started = time.monotonic()
    ahead.seek(position)
    reread = time.monotonic() - started
    mark = ahead.mark(position)
    want = [ahead[p]["input_ids"] for p in range(position, position + 8)]
    assert mark is not None, "no mark noted"
    joiner = IterableStream(pipeline(assets, shuffled), lookback=64, mark_every=8)
    started = time.monotonic()
    resumed = joiner.resume(mark)
    if not resumed:
        joiner.seek(position)
    got = [joiner[p]["input_ids"] for p in range(position, position + 8)]
    took = time.monotonic() - started
    kind = "buffer-shuffled" if shuffled else "plain"
    return (
        f"{kind:>15}  position {position:>6} (pass {mark['pass']}): read again {reread:6.2f} s, "
        f"{'resumed' if resumed else 'refused, read again'} {took:6.2f} s, ratio {reread / max(took, 1e-6):6.1f}x, "
        f"same samples: {got == want}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, nargs="+", default=[1000, 8000])
    parser.add_argument("--assets", type=Path, default=REPO / "runs" / "hf-assets")
    args = parser.parse_args()
    if not (args.assets / "done").exists():
        import subprocess

        subprocess.run([sys.executable, str(REPO / "examples" / "hf" / "make_assets.py"), str(args.assets)], check=True)
        (args.assets / "done").write_text("ok")
    for shuffled in (False, True):
        for position in args.positions:
            print(measure(args.assets, position, shuffled), flush=True)


if __name__ == "__main__":
    main()
