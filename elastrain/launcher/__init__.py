"""elastrain-run: torchrun's parser and agent, with elastic defaults and elastrain's own options."""
