"""elastrain's side of a Trainer holds it weakly (elastrain.integrations.trainer.weak_trainer): a Trainer the script
drops is freed by its reference count, as under torchrun, not left to a garbage collection."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elastrain.integrations.trainer.weak_trainer import WeakTrainer


class Holder:
    trainer = WeakTrainer()

    def __init__(self, trainer: object) -> None:
        self.trainer = trainer


class Target:
    pass


@pytest.fixture
def no_collection() -> Iterator[None]:
    """Only reference counts free anything in the test."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_the_attribute_gives_the_object_back_while_something_else_holds_it(no_collection: None) -> None:
    target = Target()
    holder = Holder(target)
    assert holder.trainer is target
    other = Target()
    holder.trainer = other
    assert holder.trainer is other
    assert isinstance(Holder.trainer, WeakTrainer)


def test_the_holder_keeps_nothing_alive_and_names_itself_once_the_object_is_gone(no_collection: None) -> None:
    target = Target()
    holder = Holder(target)
    vars(target)["holder"] = holder  # the Trainer keeps elastrain's side: a cycle, were the reference strong
    ref = weakref.ref(target)
    del target
    assert ref() is None
    with pytest.raises(ReferenceError, match="Trainer of this Holder was freed"):
        _ = holder.trainer


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 1)

    def forward(self, x: torch.Tensor, labels: Any = None) -> dict[str, torch.Tensor]:
        return {"loss": self.net(x).sum()}


def test_a_trainer_with_elastrains_side_attached_is_freed_as_the_script_drops_it(
    tmp_path: Path, no_collection: None
) -> None:
    transformers = pytest.importorskip("transformers")
    from elastrain.integrations.trainer.driver import ElasticTrainer, driver_of

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    trainer = transformers.Trainer(model=Tiny(), args=args)
    ElasticTrainer(trainer, None)  # restart mode: what every Trainer gets under elastrain-run without --live
    assert driver_of(trainer) is not None
    freed, model = weakref.ref(trainer), weakref.ref(trainer.model)
    del trainer
    assert freed() is None and model() is None
