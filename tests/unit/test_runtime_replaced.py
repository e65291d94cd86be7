"""A live move drops the DDP wrapper; the session collects garbage only when something still refers to it
(elastrain/session/runtime.py ``Runtime.replaced_alive``). A plain wrapper module stands for DDP: no group."""

from __future__ import annotations

import gc

import torch

from elastrain.env import WorkerEnv
from elastrain.session.config import RuntimeConfig
from elastrain.session.runtime import Runtime
from elastrain.step_flags import StepFlags


class Wrapper(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner


def runtime() -> Runtime:
    env = WorkerEnv.from_environ({})
    return Runtime(torch.nn.Linear(2, 2), RuntimeConfig(device=torch.device("cpu")), env, StepFlags())


def test_a_wrapper_dropped_with_nothing_referring_to_it_is_gone() -> None:
    rt = runtime()
    rt.model = Wrapper(rt.module)
    rt.unwrap()
    assert rt.model is rt.module
    assert not rt.replaced_alive()


def test_a_wrapper_still_referred_to_is_alive_once_and_the_answer_is_reset() -> None:
    rt = runtime()
    held = Wrapper(rt.module)
    rt.model = held
    rt.unwrap()
    assert rt.replaced_alive()
    assert not rt.replaced_alive()  # asked again: nothing dropped since


def test_a_wrapper_in_a_reference_cycle_is_alive_until_collected() -> None:
    rt = runtime()
    gc.disable()  # no automatic collection between the drop and the question
    try:
        cyclic = Wrapper(rt.module)
        cyclic.__dict__["me"] = cyclic  # a traceback's frames hold a dropped wrapper this way
        rt.model = cyclic
        del cyclic
        rt.unwrap()
        assert rt.replaced_alive()
    finally:
        gc.enable()


def test_unwrapping_an_unwrapped_model_records_nothing() -> None:
    rt = runtime()
    rt.unwrap()
    assert not rt.replaced_alive()
