"""A Hugging Face Trainer script that evaluates the model it starts from, fine-tunes it, and evaluates it again: the
style of transformers' examples, on local files. It imports nothing from elastrain.

Run it as its users would: ``elastrain-run ... hf_evaluate_first.py --model_name_or_path gpt2 --train_file train.txt
--validation_file validation.txt --output_dir out --do_train --max_steps 100``. With ``LEDGER_DIR`` set it notes the
samples of every step (bench/support/hf/ledger.py, the tests' instrument).
"""

import math
import os
from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
)


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "a model folder (from_pretrained)"})
    train_file: str = field(metadata={"help": "a .txt file"})
    validation_file: str = field(metadata={"help": "a .txt file"})
    block_size: int = field(default=32, metadata={"help": "tokens per sample"})


def main() -> None:
    script_args, training_args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
    files = {"train": script_args.train_file, "validation": script_args.validation_file}
    raw = load_dataset("text", data_files=files)
    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path)
    size = script_args.block_size

    def to_blocks(batch: dict) -> dict:
        tokens = [t for ids in tokenizer(batch["text"])["input_ids"] for t in ids]
        blocks = [tokens[i : i + size] for i in range(0, len(tokens) - size + 1, size)]
        return {"input_ids": blocks, "attention_mask": [[1] * size for _ in blocks], "labels": blocks}

    with training_args.main_process_first(desc="tokenize into blocks"):
        data = raw.map(to_blocks, batched=True, remove_columns=["text"])

    train_dataset, callbacks = data["train"], []
    if os.environ.get("LEDGER_DIR"):  # the tests' sample ledger, not part of the recipe
        import ledger

        train_dataset, callbacks = ledger.wrap(train_dataset), [ledger.Callback()]

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=data["validation"],
        processing_class=tokenizer,
        data_collator=default_data_collator,
        callbacks=callbacks,
    )
    before = trainer.evaluate(metric_key_prefix="base")
    trainer.log_metrics("base", before)
    trainer.save_metrics("base", before)
    if training_args.do_train:
        trainer.train()
        trainer.save_model()
    after = trainer.evaluate()
    trainer.log_metrics("eval", after)
    trainer.save_metrics("eval", after)
    if trainer.is_world_process_zero():
        print(f"PERPLEXITY {math.exp(before['base_loss']):.4f} -> {math.exp(after['eval_loss']):.4f}", flush=True)


if __name__ == "__main__":
    main()
