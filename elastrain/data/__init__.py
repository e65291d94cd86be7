"""Elastic data: a world-size independent sample order with a saved global cursor."""

from elastrain.data.cursor import EpochEnd, Position, StepRange, step_range
from elastrain.data.sampler import ElasticSampler, RankStep, epoch_order

__all__ = ["ElasticSampler", "EpochEnd", "Position", "RankStep", "StepRange", "epoch_order", "step_range"]
