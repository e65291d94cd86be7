"""The DDP settings a live Trainer world hands accelerate (elastrain/integrations/trainer/ddp_args.py)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import pytest
import torch
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

from elastrain.integrations.trainer.ddp_args import tune_ddp


@dataclass
class Accelerator:
    ddp_handler: DistributedDataParallelKwargs | None


@pytest.mark.parametrize(
    ("handler", "in_sync", "kwargs"),
    [
        (  # the Trainer's own: find_unused_parameters for a PreTrainedModel, the script's bucket size
            DistributedDataParallelKwargs(find_unused_parameters=True, bucket_cap_mb=10),
            True,
            {"find_unused_parameters": True, "bucket_cap_mb": 10, "init_sync": False, "bucket_cap_mb_list": [10]},
        ),
        (  # a world restored from a checkpoint: DDP broadcasts rank 0's model as always
            DistributedDataParallelKwargs(broadcast_buffers=False),
            False,
            {"broadcast_buffers": False, "bucket_cap_mb_list": [25]},
        ),
        (None, True, {"init_sync": False, "bucket_cap_mb_list": [25]}),
    ],
)
def test_the_settings_are_kept_and_the_two_added(
    handler: DistributedDataParallelKwargs | None, in_sync: bool, kwargs: dict[str, object]
) -> None:
    accelerator = Accelerator(handler)
    tune_ddp(accelerator, in_sync)
    assert accelerator.ddp_handler is not None
    assert accelerator.ddp_handler.to_kwargs() == kwargs
    tune_ddp(accelerator, in_sync)  # the next world's: the same, not added twice
    assert accelerator.ddp_handler.to_kwargs() == kwargs
    # Every keyword is one of DDP's (accelerate passes them as they are).
    assert set(kwargs) <= set(inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters)


def test_a_comm_hook_the_script_asked_for_is_still_registered() -> None:
    accelerator = Accelerator(DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16))
    tune_ddp(accelerator, in_sync=True)
    assert accelerator.ddp_handler is not None and accelerator.ddp_handler.comm_hook == DDPCommunicationHookType.FP16
