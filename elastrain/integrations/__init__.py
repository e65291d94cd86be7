"""Integrations with training frameworks: DeepSpeed (:mod:`.deepspeed`), the Hugging Face Trainer (:mod:`.hf_trainer`).

Import the submodule you need; each imports its framework lazily or on import of the submodule only,
so ``import elastrain.integrations`` costs nothing.
"""
