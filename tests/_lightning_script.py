"""Lightning DDP on CPU (gloo, 2 processes); run by tests/test_frameworks_lightning.py (not a test).

Usage: _lightning_script.py MODE OUT_DIR. Every rank writes ``OUT_DIR/<run>_<rank>.json``: the
sample ids of each training step, by epoch. Modes:

* ``ddp``: one script, several fits in the same two processes (Lightning's launcher re-runs this
  script for rank 1): torch's loader passed to fit(); kuat's loader passed to fit() (built before
  the process group exists) with a mid-epoch checkpoint at step 7; kuat's loader built in
  ``train_dataloader()``; then the fit resumed from the mid-epoch checkpoint.
* ``spawn``: kuat's loader passed to fit() with ``strategy="ddp_spawn"`` (the loader is pickled).
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

N, BATCH, SEED = 50, 5, 3


class Recorder(pl.LightningModule):
    def __init__(self, out_dir: str, run: str, loader_factory=None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.out_dir, self.run, self.loader_factory = out_dir, run, loader_factory
        self.seen: dict[int, list[list[int]]] = {}

    def training_step(self, batch, batch_idx):
        self.seen.setdefault(self.current_epoch, []).append(batch.tolist())
        return (self.w * batch.float()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return self.loader_factory()

    def on_train_end(self):
        with open(os.path.join(self.out_dir, f"{self.run}_{self.global_rank}.json"), "w") as f:
            json.dump({str(k): v for k, v in self.seen.items()}, f)


def kuat_loader():
    return kuat.DataLoader(list(range(N)), batch_size=BATCH, shuffle=True, seed=SEED, num_workers=2)


def trainer(strategy: str = "ddp", **kwargs) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, **kwargs)


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "spawn":
        loader = kuat_loader()
        trainer("ddp_spawn", enable_checkpointing=False).fit(Recorder(out, "spawn"), train_dataloaders=loader)
        return
    torch_loader = TorchLoader(list(range(N)), batch_size=BATCH, shuffle=True)
    loader = kuat_loader()  # before the process group exists
    trainer(enable_checkpointing=False).fit(Recorder(out, "torch"), train_dataloaders=torch_loader)
    ckpt = ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), every_n_train_steps=7, save_top_k=-1,
                           filename="{step}")
    trainer(callbacks=[ckpt]).fit(Recorder(out, "kuat"), train_dataloaders=loader)
    trainer(enable_checkpointing=False).fit(Recorder(out, "hook", kuat_loader))
    resumed = Recorder(out, "resumed")
    trainer(enable_checkpointing=False).fit(resumed, train_dataloaders=kuat_loader(),
                                            ckpt_path=os.path.join(out, "ckpt", "step=7.ckpt"))


if __name__ == "__main__":
    main()
