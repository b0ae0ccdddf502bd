"""Lightning DDP and Fabric on CPU (gloo, 2 processes); run by tests/test_frameworks_lightning.py
(not a test).

Usage: _lightning_script.py MODE OUT_DIR. Every rank writes ``OUT_DIR/<run>_<rank>.json``:
``{"epochs": {epoch: [batch ids, ...]}, "predicted": [...], "meta": {...}}``. Modes:

* ``ddp``: one script, several Trainer runs in the same two processes (Lightning's launcher
  re-runs this script for rank 1). ``fit`` with Lightning's DistributedSampler injected
  (``use_distributed_sampler=True``): torch's loader (``torch``), kuat's passed to fit() and
  built before the process group, unshuffled, with a mid-epoch checkpoint at step 7
  (``kuat``), kuat's shuffled with ``seed=`` built in ``train_dataloader()`` (``hook``), the
  ``kuat`` fit resumed from its checkpoint (``resumed``); ``use_distributed_sampler=False``
  with each rank's own 20 samples (``own_torch``, ``own_kuat``); ``predict`` over 25 samples
  (Lightning's unrepeated sampler): torch's loader, kuat's built before the process group,
  kuat's built in ``predict_dataloader()`` after it (``predict_*``).
* ``spawn``: kuat's loader passed to fit() with ``strategy="ddp_spawn"`` (the loader is pickled).
* ``fabric``: ``Fabric(strategy="ddp").setup_dataloaders`` with its DistributedSampler
  (torch's and kuat's, unshuffled) and with ``use_distributed_sampler=False`` (own 20 each).
"""

from __future__ import annotations

import json
import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader as TorchLoader

import kuat

N, BATCH, SEED, OWN, PREDICT = 50, 5, 3, 20, 25


def _write(out_dir: str, run: str, rank: int, record: dict) -> None:
    with open(os.path.join(out_dir, f"{run}_{rank}.json"), "w") as f:
        json.dump(record, f)


class Recorder(pl.LightningModule):
    def __init__(self, out_dir: str, run: str, loader_factory=None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.out_dir, self.run, self.loader_factory = out_dir, run, loader_factory
        self.seen: dict[int, list[list[int]]] = {}
        self.meta: dict = {}

    def training_step(self, batch, batch_idx):
        self.seen.setdefault(self.current_epoch, []).append(batch.tolist())
        return (self.w * batch.float()).sum()

    def predict_step(self, batch, batch_idx):
        return batch.tolist()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return self.loader_factory(self.global_rank)

    def predict_dataloader(self):
        return self.loader_factory(self.global_rank)

    def on_train_start(self):
        loader = self.trainer.train_dataloader
        self.meta = {"loader": type(loader).__name__, "sampler": type(loader.sampler).__name__,
                     "kuat_served": isinstance(loader, kuat.DataLoader)}

    def on_train_end(self):
        _write(self.out_dir, self.run, self.global_rank, {"epochs": self.seen, "meta": self.meta})


def kuat_loader(**kw):
    return kuat.DataLoader(list(range(N)), batch_size=BATCH, num_workers=2, **kw)


def own_data(cls, rank: int):  # each rank its own 20 samples (use_distributed_sampler=False)
    return cls(list(range(rank * OWN, (rank + 1) * OWN)), batch_size=BATCH)


def trainer(strategy: str = "ddp", **kwargs) -> pl.Trainer:
    kwargs.setdefault("enable_checkpointing", False)
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, **kwargs)


def predict(out: str, run: str, loader=None, factory=None) -> None:
    t = trainer()
    predicted = t.predict(Recorder(out, run, factory), dataloaders=loader)
    _write(out, run, t.global_rank, {"predicted": [x for batch in predicted for x in batch]})


def fabric_mode(out: str) -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    rank = fabric.global_rank
    loaders = {  # (loader, use_distributed_sampler)
        "fabric_torch": (TorchLoader(list(range(N)), batch_size=BATCH), True),
        "fabric_kuat": (kuat_loader(), True),
        "fabric_shuffled_torch": (TorchLoader(list(range(N)), batch_size=BATCH, shuffle=True), True),
        "fabric_shuffled_kuat": (kuat_loader(shuffle=True), True),
        "fabric_own_torch": (own_data(TorchLoader, rank), False),
        "fabric_own_kuat": (own_data(kuat.DataLoader, rank), False),
    }
    for run, (loader, use) in loaders.items():
        prepared = fabric.setup_dataloaders(loader, use_distributed_sampler=use)
        _write(out, run, rank, {"epochs": {0: [b.tolist() for b in prepared]},
                                "meta": {"sampler": type(prepared.sampler).__name__,
                                         "kuat_served": isinstance(prepared._dataloader, kuat.DataLoader)}})
    fabric.barrier()


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "spawn":
        trainer("ddp_spawn").fit(Recorder(out, "spawn"), train_dataloaders=kuat_loader())
        return
    if mode == "fabric":
        fabric_mode(out)
        return
    torch_loader = TorchLoader(list(range(N)), batch_size=BATCH, shuffle=True)
    loader = kuat_loader()  # before the process group exists (unshuffled: torch's exact shares)
    early_predict = kuat.DataLoader(list(range(PREDICT)), batch_size=4)
    trainer().fit(Recorder(out, "torch"), train_dataloaders=torch_loader)
    ckpt = ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), every_n_train_steps=7, save_top_k=-1,
                           filename="{step}")
    trainer(callbacks=[ckpt], enable_checkpointing=True).fit(Recorder(out, "kuat"), train_dataloaders=loader)
    trainer().fit(Recorder(out, "hook", lambda rank: kuat_loader(shuffle=True, seed=SEED)))
    # shuffle=True without seed= is torch's RandomSampler: Lightning injects the same sampler
    trainer().fit(Recorder(out, "kuat_shuffled"), train_dataloaders=kuat_loader(shuffle=True))
    trainer().fit(Recorder(out, "resumed"), train_dataloaders=kuat_loader(),
                  ckpt_path=os.path.join(out, "ckpt", "step=7.ckpt"))
    for run, cls in (("own_torch", TorchLoader), ("own_kuat", kuat.DataLoader)):
        trainer(use_distributed_sampler=False).fit(
            Recorder(out, run, lambda rank, cls=cls: own_data(cls, rank)))
    predict(out, "predict_torch", TorchLoader(list(range(PREDICT)), batch_size=4))
    predict(out, "predict_kuat_before", early_predict)
    predict(out, "predict_kuat_after",
            factory=lambda rank: kuat.DataLoader(list(range(PREDICT)), batch_size=4))


if __name__ == "__main__":
    main()
