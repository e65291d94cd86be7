"""SessionConfig: every setting validated before anything starts, refused with one line naming it."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from elastrain.data import EpochEnd
from elastrain.env import WorkerEnv
from elastrain.errors import ScalingError
from elastrain.scaling import Policy
from elastrain.session import Session, SessionConfig, SessionConfigError


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"global_batch": 4}, "max_steps"),  # neither max_steps nor epochs
        ({"max_steps": -1}, "max_steps"),
        ({"max_steps": 2.5}, "max_steps"),
        ({"epochs": 0}, "epochs"),
        ({"max_steps": 1, "num_workers": -1}, "num_workers"),
        ({"max_steps": 1, "save_every_steps": 0}, "save_every_steps"),
        ({"max_steps": 1, "save_every_seconds": 0}, "save_every_seconds"),
        ({"max_steps": 1, "keep_last": 0}, "keep_last"),
        ({"max_steps": 1, "on_save_error": "ignore"}, "on_save_error"),
        ({"max_steps": 1, "policy": "quadratic"}, "policy"),
        ({"max_steps": 1, "epoch_end": "pad"}, "epoch_end"),
        ({"max_steps": 1, "collate_fn": 3}, "collate_fn"),
        ({"max_steps": 1, "token_count": "tokens"}, "token_count"),
        ({"max_steps": 1, "lr_schedule": 0.5}, "lr_schedule"),
        ({"max_steps": 1, "device": "gpu:zero"}, "device"),
        ({"max_steps": 1, "save_every_step": 5}, "save_every_step"),  # a typo
        # values of the wrong type: one line naming the setting, never a raw TypeError nor a silent coercion
        ({"max_steps": 1, "save_every_seconds": "10"}, "save_every_seconds"),
        ({"max_steps": 1, "save_every_seconds": True}, "save_every_seconds"),
        ({"max_steps": 1, "seed": "x"}, "seed"),
        ({"max_steps": 1, "seed": 1.5}, "seed"),
        ({"max_steps": 1, "shuffle": "no"}, "shuffle"),
        ({"max_steps": 1, "pin_memory": 1}, "pin_memory"),
        ({"max_steps": 1, "async_save": "true"}, "async_save"),
        ({"max_steps": 1, "ddp": "false"}, "ddp"),
        ({"max_steps": 1, "checkpoint_dir": 5}, "checkpoint_dir"),
        ({"max_steps": 1, "checkpoint_dir": "file://otherhost/ckpt"}, "checkpoint_dir"),
        ({"max_steps": 1, "metrics_dir": ["runs"]}, "metrics_dir"),
        ({"max_steps": 1, "ddp_kwargs": "find_unused_parameters"}, "ddp_kwargs"),
        ({"max_steps": 1, "global_batch": "64"}, "global_batch"),
        ({"max_steps": 1, "micro_batch": 2.0}, "micro_batch"),
        ({"max_steps": 1, "num_workers": "2"}, "num_workers"),
        ({"max_steps": "100"}, "max_steps"),
    ],
)
def test_a_bad_setting_is_refused_naming_it(settings: dict[str, Any], named: str) -> None:
    with pytest.raises(SessionConfigError) as err:
        SessionConfig.of(**{"global_batch": 4, **settings})
    assert err.value.setting == named
    assert str(err.value).startswith(f"Session({named}=...): ")
    assert "\n" not in str(err.value)


def test_a_typo_gets_the_setting_it_meant() -> None:
    with pytest.raises(SessionConfigError, match=r"did you mean save_every_steps\?"):
        SessionConfig.of(max_steps=1, save_every_step=5)  # type: ignore[call-arg]


def test_batch_settings_are_checked_by_the_scaling_config() -> None:
    with pytest.raises(ScalingError, match="micro_batch must be >= 1"):
        SessionConfig.of(max_steps=1, global_batch=4, micro_batch=0)


def test_keywords_become_the_parts_of_one_frozen_config() -> None:
    cfg = SessionConfig.of(
        global_batch=8,
        micro_batch=2,
        policy="sqrt",
        epochs=2,
        epoch_end="drop",
        checkpoint_dir="/ckpt",
        save_every_steps=5,
        metrics_dir="",
        ddp_kwargs={"find_unused_parameters": True},
        device="cpu",
    )
    assert cfg.scaling.policy is Policy.SQRT and cfg.scaling.global_batch == 8 and cfg.scaling.micro_batch == 2
    assert cfg.data.epoch_end is EpochEnd.DROP and cfg.epochs == 2 and cfg.max_steps is None
    assert cfg.checkpoint.directory == "/ckpt" and cfg.checkpoint.save_every_steps == 5
    assert cfg.output.metrics_dir is None  # "" means: next to the checkpoints
    assert cfg.runtime.device == torch.device("cpu") and dict(cfg.runtime.ddp_kwargs) == {
        "find_unused_parameters": True
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_steps = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.runtime.ddp_kwargs["broadcast_buffers"] = False  # type: ignore[index]


def test_a_session_takes_the_config_or_keywords_not_both() -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.zeros(4, 2))
    env = WorkerEnv.from_environ({})
    cfg = SessionConfig.of(global_batch=2, max_steps=1)
    assert Session(model, opt, data, cfg, env=env).config is cfg
    assert Session(model, opt, data, env=env, global_batch=2, max_steps=1).config == cfg
    with pytest.raises(SessionConfigError, match=r"^Session\(config=\.\.\.\): give config= or keyword settings"):
        Session(model, opt, data, cfg, env=env, max_steps=2)


def test_well_typed_values_pass_and_file_urls_are_local_paths() -> None:
    cfg = SessionConfig.of(
        global_batch=4,
        max_steps=1,
        save_every_seconds=10,  # an int is a number of seconds too
        seed=-3,
        checkpoint_dir="file:///mnt/ckpt",
        metrics_dir=Path("/mnt/metrics"),
        tensorboard_dir="file://localhost/mnt/tb",
    )
    assert cfg.checkpoint.save_every_seconds == 10 and cfg.data.seed == -3
    assert cfg.checkpoint.directory == "/mnt/ckpt"
    assert cfg.output.metrics_dir == "/mnt/metrics" and cfg.output.tensorboard_dir == "/mnt/tb"
    assert SessionConfig.of(global_batch=4, max_steps=1, save_every_seconds=math.inf).checkpoint.save_every_seconds
