"""Writes the DCP checkpoint whose .metadata is fsdp2-adamw-2ranks.metadata here (torch 2.13, 2 gloo ranks).

FSDP2 (DTensor) parameters, AdamW state, non-tensor entries stored as bytes, several dtypes, channels_last:
``python -m torch.distributed.run --nproc-per-node=2 make_fsdp2_metadata.py OUT`` and copy ``OUT/.metadata``.
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
model(torch.randn(2, 4)).sum().backward()
opt.step()
msd, osd = get_state_dict(model, [opt])
extra = {
    "n": 3,
    "s": "x",
    "bf16": torch.ones(2, dtype=torch.bfloat16),
    "i32": torch.arange(3, dtype=torch.int32),
    "bool": torch.tensor([True]),
    "f8": torch.zeros(2, dtype=torch.float8_e4m3fn),
    "cl": torch.ones(1, 2, 2, 2).to(memory_format=torch.channels_last),
}
dcp.save({"model": msd, "optim": osd, "extra": extra}, checkpoint_id=sys.argv[1])
dist.destroy_process_group()
