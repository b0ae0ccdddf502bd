"""Run under ``torchrun --nproc_per_node=2`` by tests/test_frameworks_torchrun.py (not a test).

Usage: _torchrun_script.py OUT_JSON. Each rank builds kuat's and torch's loaders *before*
``init_process_group`` (kuat reads RANK/WORLD_SIZE, then torch.distributed at each epoch start),
reads 2 epochs, then prepares both with Accelerate and reads one more; rank 0 writes every
rank's sample ids to OUT_JSON.
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import DistributedSampler

import kuat

N, BATCH = 40, 4


def ids(loader) -> list[int]:
    return [int(x) for batch in loader for x in batch]


def main() -> None:
    out = sys.argv[1]
    ours = kuat.DataLoader(list(range(N)), batch_size=BATCH, shuffle=True, seed=1, num_workers=2)
    env_rank = (ours.rank, ours.world_size)  # from RANK/WORLD_SIZE: no process group yet
    first = ids(ours)  # epoch 0 before the process group exists
    dist.init_process_group("gloo")
    sampler = DistributedSampler(list(range(N)), shuffle=True, seed=1)
    theirs = TorchLoader(list(range(N)), batch_size=BATCH, sampler=sampler)
    result = {"env_rank": env_rank, "kuat": [first, ids(ours)], "torch": []}
    for epoch in range(2):
        sampler.set_epoch(epoch)
        result["torch"].append(ids(theirs))

    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    kuat_prepared = accelerator.prepare(
        kuat.DataLoader(list(range(N)), batch_size=BATCH, shuffle=True, seed=1, num_workers=2))
    torch_prepared = accelerator.prepare(TorchLoader(list(range(N)), batch_size=BATCH, shuffle=True))
    result["accelerate_kuat"] = ids(kuat_prepared)
    result["accelerate_torch"] = ids(torch_prepared)
    result["accelerate_kuat_is_kuat"] = isinstance(kuat_prepared, kuat.DataLoader)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
