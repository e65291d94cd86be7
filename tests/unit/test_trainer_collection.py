"""The collections at a Trainer's live move (elastrain/integrations/trainer/collection.py): the old wrapper collected
once when only a collection frees it (none when its reference count does), the survivors frozen until the new
world's model is wrapped, and nothing frozen while the old wrapper lives."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from elastrain.integrations.trainer.collection import MoveCollection


@pytest.fixture
def accelerator() -> Iterator[Accelerator]:
    AcceleratorState._reset_state(True)
    yield Accelerator(cpu=True)
    gc.unfreeze()
    AcceleratorState._reset_state(True)


class Wrapper(torch.nn.Module):
    """Stands for DDP's wrapper: in a reference cycle, as DDP is (its reducer's hooks refer back to it)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.me = self


def test_the_old_wrapper_is_collected_once_and_the_survivors_stay_frozen_until_the_new_one_is_made(
    accelerator: Accelerator,
) -> None:
    model = torch.nn.Linear(4, 4)
    wrapper = Wrapper(model)
    gone = weakref.ref(wrapper)
    collection = MoveCollection()
    del wrapper  # the world's references go with it: leave() is given a weak one
    collection.leave(accelerator, gone)
    gc.collect()  # the Trainer's collection: the cycle made before the freeze...
    assert gone() is None  # ... was collected by leave(), before anything was frozen
    assert gc.get_freeze_count() > 0 and model.weight is not None
    collection.wrapped()
    assert gc.get_freeze_count() == 0
    collection.wrapped()  # again: a no-op


def test_nothing_is_frozen_while_something_still_holds_the_old_wrapper(accelerator: Accelerator) -> None:
    held = Wrapper(torch.nn.Linear(4, 4))  # a collective failure's traceback, say
    collection = MoveCollection()
    collection.leave(accelerator, weakref.ref(held))
    assert gc.get_freeze_count() == 0
    del held
    gc.collect()  # the next train()'s collection frees it then


def test_a_move_after_one_whose_train_never_wrapped_a_model_unfreezes_first(accelerator: Accelerator) -> None:
    collection = MoveCollection()
    collection.leave(accelerator, None)
    assert gc.get_freeze_count() > 0
    collection.leave(accelerator, None)  # train() failed before it wrapped: the earlier freeze is released first
    collection.wrapped()
    assert gc.get_freeze_count() == 0


class Cycle:
    """Garbage in a reference cycle, which only a collection frees."""

    def __init__(self) -> None:
        self.me = self


def test_a_wrapper_freed_by_its_reference_count_costs_no_full_collection(accelerator: Accelerator) -> None:
    model = torch.nn.Linear(4, 4)
    wrapper = torch.nn.Sequential(model)  # no cycle: DDP's wrapper after the first of a process
    gone = weakref.ref(wrapper)
    accelerator._models.append(wrapper)  # accelerate's reference, which free_memory() drops
    canary = weakref.ref(Cycle())  # garbage made before the move: no collection at the move walks it
    del wrapper
    collection = MoveCollection()
    collection.leave(accelerator, gone)
    assert gone() is None and gc.get_freeze_count() > 0
    gc.collect()  # the Trainer's collection in the next train()
    assert canary() is not None
    collection.wrapped()
    gc.collect()
    assert canary() is None
