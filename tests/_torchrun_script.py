"""Run under ``torchrun --nproc_per_node=2`` by tests/test_frameworks_torchrun.py (not a test).

Usage: _torchrun_script.py OUT_JSON. Each rank builds kuat's and torch's loaders *before*
``init_process_group`` and reads 2 epochs: kuat's default loader (no sharding: every sample,
as torch's) and one built with ``shard=True`` (kuat's own sharding, from RANK/WORLD_SIZE until
the process group exists, then from torch.distributed); then prepares loaders with Accelerate
and reads one epoch. Rank 0 writes every rank's sample ids to OUT_JSON.
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
    data = list(range(N))
    plain = kuat.DataLoader(data, batch_size=BATCH, num_workers=2)  # before the process group
    sharded = kuat.DataLoader(data, batch_size=BATCH, shuffle=True, seed=1, num_workers=2, shard=True)
    env_share = (sharded.rank, sharded.world_size)  # from RANK/WORLD_SIZE: no process group yet
    result = {"env_share": env_share, "plain": [ids(plain)], "sharded": [ids(sharded)],
              "torch_plain": ids(TorchLoader(data, batch_size=BATCH))}
    dist.init_process_group("gloo")
    result["plain"].append(ids(plain))
    result["sharded"].append(ids(sharded))
    sampler = DistributedSampler(data, shuffle=False)
    result["torch_sharded"] = ids(TorchLoader(data, batch_size=BATCH, sampler=sampler))
    result["kuat_sharded_unshuffled"] = ids(kuat.DataLoader(data, batch_size=BATCH, shard=True))

    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    prepared = accelerator.prepare(kuat.DataLoader(data, batch_size=BATCH, shuffle=True, seed=1, num_workers=2))
    result["accelerate_kuat"] = ids(prepared)
    result["accelerate_kuat_is_kuat"] = isinstance(prepared, kuat.DataLoader)
    result["accelerate_torch"] = ids(accelerator.prepare(TorchLoader(data, batch_size=BATCH, shuffle=True)))
    result["accelerate_kuat_unshuffled"] = ids(accelerator.prepare(kuat.DataLoader(data, batch_size=BATCH)))
    result["accelerate_torch_unshuffled"] = ids(accelerator.prepare(TorchLoader(data, batch_size=BATCH)))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
