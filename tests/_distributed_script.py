"""Run under ``torchrun --nproc_per_node=2`` by tests/test_distributed.py (not a test module).

Usage: _distributed_script.py DATA_DIR OUT_JSON. Each rank reads a kuat dataset, an HF map-style
dataset, an HF stream and two mixes through kuat.DataLoader with kuat's own sharding
(``shard=True``: rank and world size from torch.distributed), for 2 epochs with and without drop_last; rank 0 gathers every rank's batches
and writes them to OUT_JSON.
"""

from __future__ import annotations

import json
import sys

import datasets
import torch
import torch.distributed as dist

import kuat


def ids_of(batch) -> list[int]:
    return [int(x) for x in batch["id"]]


def collate(samples):
    return {"id": torch.tensor([int(s["id"]) for s in samples])}


def main() -> None:
    data_dir, out_path = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    kuat_ds = kuat.open(f"{data_dir}/ds.kuat")
    hf_map = datasets.load_from_disk(f"{data_dir}/hf").with_format("torch")
    hf_stream = datasets.load_from_disk(f"{data_dir}/hf2").to_iterable_dataset(num_shards=3)
    sources = {
        "kuat": kuat_ds,
        "hf_map": hf_map,
        "hf_stream": hf_stream,
        "mix_map": kuat.mix([kuat_ds, hf_map], stopping="all_exhausted", seed=1),
        "mix_stream": kuat.mix([hf_stream, kuat_ds], stopping="all_exhausted", seed=1),
    }
    result = {}
    for name, source in sources.items():
        iterable = isinstance(kuat.sources.as_source(source), torch.utils.data.IterableDataset)
        for drop_last in (False, True):
            loader = kuat.DataLoader(
                source,
                batch_size=6,
                shuffle=None if iterable else True,
                drop_last=drop_last,
                num_workers=2,
                collate_fn=collate,
                seed=5,
                shard=True,
            )
            assert (loader.rank, loader.world_size) == (rank, world)
            epochs = [[ids_of(b) for b in loader] for _ in range(2)]
            gathered = [None] * world
            dist.all_gather_object(gathered, epochs)
            result[f"{name}/drop_last={drop_last}"] = gathered
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
