#!/usr/bin/env python
"""Fine-tune a sequence-to-sequence model on JSON lines of source/target pairs: transformers'
examples/pytorch/summarization/run_summarization.py, cut down to local files, with its
``predict_with_generate`` evaluation.
It imports nothing from elastrain: run it under elastrain-run as it is (examples/hf/README.md)."""

import logging
import os
import sys
from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "a model folder (from_pretrained)"})


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "JSON lines with source and target"})
    validation_file: str | None = field(default=None)
    max_source_length: int = field(default=48)
    max_target_length: int = field(default=16)


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, Seq2SeqTrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", handlers=[logging.StreamHandler(sys.stdout)]
    )

    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)

    set_seed(training_args.seed)
    data_files = {"train": data_args.train_file}
    if data_args.validation_file is not None:
        data_files["validation"] = data_args.validation_file
    raw_datasets = load_dataset("json", data_files=data_files)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_args.model_name_or_path)

    def preprocess_function(examples):
        model_inputs = tokenizer(examples["source"], max_length=data_args.max_source_length, truncation=True)
        labels = tokenizer(text_target=examples["target"], max_length=data_args.max_target_length, truncation=True)
        model_inputs["labels"] = labels["input_ids"]
        return model_inputs

    column_names = raw_datasets["train"].column_names
    with training_args.main_process_first(desc="train dataset map pre-processing"):
        processed = raw_datasets.map(preprocess_function, batched=True, remove_columns=column_names)

    train_dataset = processed["train"]
    callbacks = []
    if os.environ.get("LEDGER_DIR"):  # elastrain's sample ledger (bench/support/hf), not part of the recipe
        import ledger

        train_dataset, callbacks = ledger.wrap(train_dataset), [ledger.Callback()]

    data_collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    trainer = Seq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=processed["validation"] if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=data_collator,
        callbacks=callbacks,
    )

    if training_args.do_train:
        checkpoint = training_args.resume_from_checkpoint or last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        metrics = trainer.evaluate(max_length=data_args.max_target_length, metric_key_prefix="eval")
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
