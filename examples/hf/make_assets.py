"""Tiny Hugging Face models, tokenizers and data in local files, for the Trainer scripts (no downloads).

    python make_assets.py OUT

writes, from the standard library's own source text:

* ``OUT/text/{train,validation}.txt`` and ``OUT/gpt2`` (a 4-layer GPT-2 and a byte-level BPE tokenizer);
* ``OUT/pairs/{train,validation}.json`` (code line -> its first words) and ``OUT/t5`` (a 2+2-layer T5);
* ``OUT/labels/{train,validation}.json`` (is the line code or prose?) and ``OUT/bert`` (a 2-layer BERT);
* ``OUT/sft/{train,test}.jsonl`` (prompt: a code line; completion: its first words), for TRL's SFT with the GPT-2;
* ``OUT/prefs/{train,test}.jsonl`` (prompt: a code line; chosen: its first words; rejected: another line's), for
  TRL's DPO with the GPT-2.

Every model is built from a config with dropout off (so runs at different world sizes can be compared) and
saved with ``save_pretrained``; the scripts load them with ``from_pretrained`` as they would a hub model.
"""

from __future__ import annotations

import inspect
import json
import random
import sys
from pathlib import Path


def corpus() -> list[str]:
    import argparse
    import ast
    import collections
    import inspect as insp
    import json as js
    import os
    import random as rnd
    import textwrap

    lines: list[str] = []
    for mod in (js, collections, argparse, ast, textwrap, insp, rnd, os):
        lines.extend(line.strip() for line in inspect.getsource(mod).splitlines() if len(line.strip()) > 20)
    random.Random(0).shuffle(lines)
    return lines


def bpe(texts: list[str], specials: list[str], vocab: int = 512):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=specials[-1]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials))
    return tok


def main(out: Path) -> None:
    import torch
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2LMHeadModel,
        PreTrainedTokenizerFast,
        T5Config,
        T5ForConditionalGeneration,
    )

    lines = corpus()
    train, valid = lines[:3000], lines[3000:3300]

    text = out / "text"
    text.mkdir(parents=True, exist_ok=True)
    (text / "train.txt").write_text("\n".join(train) + "\n")
    (text / "validation.txt").write_text("\n".join(valid) + "\n")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe(train, ["<|endoftext|>"]),
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        model_max_length=128,
    )
    tok.save_pretrained(out / "gpt2")
    torch.manual_seed(0)
    gpt2 = GPT2Config(
        vocab_size=len(tok), n_positions=128, n_embd=64, n_layer=4, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    GPT2LMHeadModel(gpt2).save_pretrained(out / "gpt2")

    pairs = out / "pairs"
    pairs.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train[:1200]), ("validation", valid[:64])):
        records = [{"source": line, "target": " ".join(line.split()[:3])} for line in rows]
        (pairs / f"{name}.json").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    sft = out / "sft"
    sft.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train[:1600]), ("test", valid[:64])):
        records = [{"prompt": line + "\n", "completion": " ".join(line.split()[:3])} for line in rows]
        (sft / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    prefs = out / "prefs"
    prefs.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train[:1600]), ("test", valid[:64])):
        first_words = [" ".join(line.split()[:3]) for line in rows]
        records = [
            {"prompt": line + "\n", "chosen": first_words[i], "rejected": first_words[(7 * i + 3) % len(rows)]}
            for i, line in enumerate(rows)
        ]
        (prefs / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    t5tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe(train, ["<pad>", "</s>", "<unk>"]),
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=64,
    )
    t5tok.save_pretrained(out / "t5")
    torch.manual_seed(0)
    t5 = T5Config(
        vocab_size=len(t5tok), d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
        dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    T5ForConditionalGeneration(t5).save_pretrained(out / "t5")

    labels = out / "labels"
    labels.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train[:1600]), ("validation", valid[:128])):
        records = [{"sentence": line, "label": int(any(c in line for c in "()=:"))} for line in rows]
        (labels / f"{name}.json").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    btok = PreTrainedTokenizerFast(
        tokenizer_object=bpe(train, ["[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]"]),
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        unk_token="[UNK]",
        model_max_length=64,
    )
    btok.save_pretrained(out / "bert")
    torch.manual_seed(0)
    bert = BertConfig(
        vocab_size=len(btok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64, num_labels=2,
        pad_token_id=0,
    )  # fmt: skip
    BertForSequenceClassification(bert).save_pretrained(out / "bert")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
