#!/usr/bin/env python
"""Fine-tune a sequence classifier on JSON lines of sentence/label: transformers'
examples/pytorch/text-classification/run_glue.py, cut down to local files.
It imports nothing from elastrain: run it under elastrain-run as it is (examples/hf/README.md)."""

import logging
import os
import sys
from dataclasses import dataclass, field

import numpy as np
from datasets import load_dataset
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    EvalPrediction,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "a model folder (from_pretrained)"})


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "JSON lines with sentence and label"})
    validation_file: str | None = field(default=None)
    max_seq_length: int = field(default=48)


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
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
    label_list = sorted(set(raw_datasets["train"]["label"]))
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_args.model_name_or_path, num_labels=len(label_list)
    )

    def preprocess_function(examples):
        return tokenizer(examples["sentence"], max_length=data_args.max_seq_length, truncation=True)

    with training_args.main_process_first(desc="dataset map pre-processing"):
        raw_datasets = raw_datasets.map(preprocess_function, batched=True, remove_columns=["sentence"])

    train_dataset = raw_datasets["train"]
    callbacks = []
    if os.environ.get("LEDGER_DIR"):  # elastrain's sample ledger (bench/support/hf), not part of the recipe
        import ledger

        train_dataset, callbacks = ledger.wrap(train_dataset), [ledger.Callback()]

    def compute_metrics(p: EvalPrediction):
        preds = np.argmax(p.predictions, axis=1)
        return {"accuracy": float((preds == p.label_ids).mean())}

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=raw_datasets["validation"] if training_args.do_eval else None,
        compute_metrics=compute_metrics,
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
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
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
