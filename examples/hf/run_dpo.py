#!/usr/bin/env python
"""Direct preference optimization with TRL's DPOTrainer (a Trainer subclass that trains on chosen and rejected
completions against a frozen reference copy of the model): TRL's trl/scripts/dpo.py, cut down to local files (a
dataset folder of JSON lines with prompt, chosen and rejected, a model folder).
It imports nothing from elastrain: run it under elastrain-run as it is (examples/hf/README.md)."""

import os

from datasets import load_dataset
from trl import DPOConfig, DPOTrainer, ModelConfig, ScriptArguments, TrlParser, get_peft_config


def main(script_args, training_args, model_args):
    dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)

    trainer = DPOTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        peft_config=get_peft_config(model_args),  # LoRA with --use_peft (needs peft)
    )
    if os.environ.get("LEDGER_DIR"):  # elastrain's sample ledger (bench/support/hf), not part of the recipe
        import ledger

        trainer.train_dataset = ledger.wrap(trainer.train_dataset)
        trainer.add_callback(ledger.Callback())

    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.end()


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, DPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config()
    main(script_args, training_args, model_args)
