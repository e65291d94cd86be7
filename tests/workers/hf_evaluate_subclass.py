"""A Hugging Face Trainer script whose Trainer subclass evaluates and predicts its own way, as transformers'
question-answering example does (``trainer_qa.py``): ``evaluate()`` and ``predict()`` are overridden, build their
DataLoader (``get_eval_dataloader``, ``get_test_dataloader``) and run ``evaluation_loop`` themselves, with the
metrics turned off in the loop and computed after it. It evaluates a model without training it (``--do_eval``,
``--do_predict``), on local files. It imports nothing from elastrain.

Run it as its users would: ``elastrain-run ... hf_evaluate_subclass.py --model_name_or_path gpt2 --validation_file
validation.txt --output_dir out --do_eval --do_predict``.
"""

import math
from dataclasses import dataclass, field

import numpy as np
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
    validation_file: str = field(metadata={"help": "a .txt file"})
    block_size: int = field(default=32, metadata={"help": "tokens per sample"})


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    """Next-token accuracy, as the post-processing of a question-answering script would score its spans."""
    predicted = logits[:, :-1].argmax(-1)
    return float((predicted == labels[:, 1:]).mean())


class ScoringTrainer(Trainer):
    """Evaluation and prediction in the style of ``QuestionAnsweringTrainer``."""

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):  # type: ignore[no-untyped-def]
        dataloader = self.get_eval_dataloader(eval_dataset)
        compute_metrics, self.compute_metrics = self.compute_metrics, None
        try:
            output = self.evaluation_loop(dataloader, description="Evaluation", metric_key_prefix=metric_key_prefix)
        finally:
            self.compute_metrics = compute_metrics
        metrics = {f"{metric_key_prefix}_loss": float(output.metrics[f"{metric_key_prefix}_loss"])}
        metrics[f"{metric_key_prefix}_accuracy"] = accuracy(output.predictions, output.label_ids)
        metrics[f"{metric_key_prefix}_samples"] = int(output.num_samples)
        self.log(metrics)
        return metrics

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix="test"):  # type: ignore[no-untyped-def]
        dataloader = self.get_test_dataloader(test_dataset)
        output = self.evaluation_loop(dataloader, description="Prediction", metric_key_prefix=metric_key_prefix)
        return output.predictions, output.label_ids


def main() -> None:
    script_args, training_args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
    raw = load_dataset("text", data_files={"validation": script_args.validation_file})
    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path)
    size = script_args.block_size

    def to_blocks(batch: dict) -> dict:
        tokens = [t for ids in tokenizer(batch["text"])["input_ids"] for t in ids]
        blocks = [tokens[i : i + size] for i in range(0, len(tokens) - size + 1, size)]
        return {"input_ids": blocks, "attention_mask": [[1] * size for _ in blocks], "labels": blocks}

    with training_args.main_process_first(desc="tokenize into blocks"):
        data = raw.map(to_blocks, batched=True, remove_columns=["text"])

    trainer = ScoringTrainer(
        model=model,
        args=training_args,
        eval_dataset=data["validation"],
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )
    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["perplexity"] = math.exp(metrics["eval_loss"])
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    if training_args.do_predict:
        logits, labels = trainer.predict(data["validation"])
        metrics = {"predict_samples": len(logits), "predict_accuracy": accuracy(logits, labels)}
        trainer.log_metrics("predict", metrics)
        trainer.save_metrics("predict", metrics)
        if trainer.is_world_process_zero():
            print(f"PREDICTED {len(logits)} accuracy {metrics['predict_accuracy']:.6f}", flush=True)


if __name__ == "__main__":
    main()
