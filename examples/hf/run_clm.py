#!/usr/bin/env python
"""Fine-tune a causal language model on a text file: transformers' examples/pytorch/language-modeling/run_clm.py,
cut down to local files.
It imports nothing from elastrain: run it under elastrain-run as it is (examples/hf/README.md)."""

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from itertools import chain

from datasets import load_dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "a model folder (from_pretrained)"})


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "a .txt file"})
    validation_file: str | None = field(default=None, metadata={"help": "a .txt file"})
    block_size: int = field(default=32, metadata={"help": "tokens per training sample"})
    streaming: bool = field(default=False, metadata={"help": "read the files as they train (an IterableDataset)"})


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", handlers=[logging.StreamHandler(sys.stdout)]
    )
    logger.warning(f"Process rank: {training_args.local_process_index}, device: {training_args.device}")

    # Detecting last checkpoint.
    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
        if last_checkpoint is not None and training_args.resume_from_checkpoint is None:
            logger.info(f"Checkpoint detected, resuming training at {last_checkpoint}.")

    set_seed(training_args.seed)
    data_files = {"train": data_args.train_file}
    if data_args.validation_file is not None:
        data_files["validation"] = data_args.validation_file
    raw_datasets = load_dataset("text", data_files=data_files, streaming=data_args.streaming)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)

    features = raw_datasets["train"].features  # None for a stream whose files are not read yet
    column_names = list(features) if features is not None else ["text"]

    def tokenize_function(examples):
        return tokenizer(examples["text"])

    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized_datasets = raw_datasets.map(tokenize_function, batched=True, remove_columns=column_names)

    block_size = data_args.block_size

    def group_texts(examples):
        concatenated_examples = {k: list(chain(*examples[k])) for k in examples}
        total_length = len(concatenated_examples[next(iter(examples.keys()))])
        total_length = (total_length // block_size) * block_size
        result = {
            k: [t[i : i + block_size] for i in range(0, total_length, block_size)]
            for k, t in concatenated_examples.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    with training_args.main_process_first(desc="grouping texts together"):
        lm_datasets = tokenized_datasets.map(group_texts, batched=True)

    train_dataset = lm_datasets["train"]
    callbacks = []
    if os.environ.get("LEDGER_DIR"):  # elastrain's sample ledger (bench/support/hf), not part of the recipe
        import ledger

        train_dataset, callbacks = ledger.wrap(train_dataset), [ledger.Callback()]

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=lm_datasets["validation"] if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=default_data_collator,
        callbacks=callbacks,
    )

    if training_args.do_train:
        checkpoint = None
        if training_args.resume_from_checkpoint is not None:
            checkpoint = training_args.resume_from_checkpoint
        elif last_checkpoint is not None:
            checkpoint = last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        if not data_args.streaming:
            metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["perplexity"] = math.exp(metrics["eval_loss"])
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
