"""kuat.DataLoader as the HF Trainer's train loader, resumed mid-epoch in epoch 1 (issue #10).

The Trainer resumes by calling Accelerate's ``skip_first_batches`` on the loader and then
``set_epoch(epoch)``: the batches after resume must equal those of an uninterrupted run.
"""

import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader

import kuat

transformers = pytest.importorskip("transformers")

N, BATCH = 20, 4  # 5 steps per epoch; checkpoint at step 7 = epoch 1 after 2 batches


class Recorder(torch.nn.Module):
    def __init__(self, seen: list):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen = seen

    def forward(self, x):
        self.seen.append(x.tolist())
        return {"loss": (self.w * x.float()).sum()}


class Items:
    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"x": torch.tensor(i)}


def _train(tmp_path, make_loader, resume_from=None) -> list:
    seen: list = []

    class Trainer(transformers.Trainer):
        def get_train_dataloader(self):
            return make_loader()

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), num_train_epochs=2, save_strategy="steps", save_steps=7,
        report_to="none", use_cpu=True, logging_strategy="no", disable_tqdm=True,
        learning_rate=0.0, per_device_train_batch_size=BATCH,
    )
    Trainer(model=Recorder(seen), args=args).train(resume_from_checkpoint=resume_from)
    return seen


@pytest.mark.slow
def test_trainer_resumed_in_epoch_one_sees_the_uninterrupted_batches(tmp_path):
    def kuat_loader():
        return kuat.DataLoader(Items(), batch_size=BATCH, shuffle=True, seed=4, num_workers=2)

    full = _train(tmp_path / "kuat", kuat_loader)
    assert len(full) == 10 and full[:5] != full[5:]  # two epochs, in different orders
    resumed = _train(tmp_path / "kuat", kuat_loader, resume_from=str(tmp_path / "kuat" / "checkpoint-7"))
    assert resumed == full[7:]
    # the Trainer's skip_first_batches reached kuat (kuat.integrations.accelerate), not torch
    import transformers.trainer

    assert getattr(transformers.trainer.skip_first_batches, "__kuat_dispatch__", False)
    assert sorted(x for b in full[5:7] + resumed for x in b) == list(range(N))  # all of epoch 1

    # torch's loader through the same path, unshuffled (its shuffled order is not reproducible
    # across processes without a generator): skip_first_batches gives the same remaining batches
    def torch_loader():
        return TorchLoader(Items(), batch_size=BATCH)

    torch_full = _train(tmp_path / "torch", torch_loader)
    torch_resumed = _train(tmp_path / "torch", torch_loader, resume_from=str(tmp_path / "torch" / "checkpoint-7"))
    assert torch_resumed == torch_full[7:]


# --- 2 ranks (gloo, forked): the Trainer's own loader against a kuat one swapped in (#28) ------
TRAIN, EVAL = 24, 14


class Sized:
    """Items of lengths 1..7 (``input_ids``, what LengthGroupedSampler groups by) and an id."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)  # (LengthGroupedSampler iterates the dataset)
        return {"input_ids": [0] * (1 + (i * 5) % 7), "x": i, "labels": i}


def _collate(features):
    return {"x": torch.tensor([f["x"] for f in features]), "labels": torch.tensor([f["labels"] for f in features])}


class IdModel(torch.nn.Module):
    def __init__(self, seen: list):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen = seen

    def forward(self, x, labels=None):
        if self.training:
            self.seen.append(x.tolist())
        logits = (self.w * x.float()).unsqueeze(-1) + x.float().unsqueeze(-1)
        return {"loss": (self.w * x.float()).sum(), "logits": logits}


class KuatTrainer(transformers.Trainer):
    """The swap a user makes: the Trainer's loaders built by kuat, with the Trainer's own
    sampler, and prepared by its Accelerator as the Trainer prepares its own."""

    def get_train_dataloader(self):
        return self.accelerator.prepare(kuat.DataLoader(
            self.train_dataset, batch_size=self._train_batch_size, sampler=self._get_train_sampler(),
            collate_fn=self.data_collator, drop_last=self.args.dataloader_drop_last))

    def get_eval_dataloader(self, eval_dataset=None):
        ds = self.eval_dataset
        return self.accelerator.prepare(kuat.DataLoader(
            ds, batch_size=self.args.eval_batch_size, sampler=self._get_eval_sampler(ds),
            collate_fn=self.data_collator, drop_last=self.args.dataloader_drop_last))


def _trainer_ranks(rank, world_size, out_dir):
    results = {}
    for name, cls in (("torch", transformers.Trainer), ("kuat", KuatTrainer)):
        seen, evaluated = [], []

        def metrics(prediction, evaluated=evaluated):
            evaluated.extend(int(i) for i in prediction.label_ids)
            return {}

        args = transformers.TrainingArguments(
            output_dir=f"{out_dir}/{name}", num_train_epochs=1, per_device_train_batch_size=4,
            per_device_eval_batch_size=2, train_sampling_strategy="group_by_length",
            report_to="none", use_cpu=True, logging_strategy="no", save_strategy="no",
            disable_tqdm=True, learning_rate=0.0, remove_unused_columns=False, seed=42,
        )
        trainer = cls(model=IdModel(seen), args=args, train_dataset=Sized(TRAIN),
                      eval_dataset=Sized(EVAL), data_collator=_collate, compute_metrics=metrics)
        trainer.train()
        trainer.evaluate()
        results[name] = {"train": seen, "eval": evaluated,
                         "world": trainer.accelerator.num_processes}
    return results


@pytest.mark.slow
def test_trainer_group_by_length_and_eval_with_a_kuat_loader_on_two_ranks(tmp_path):
    """group_by_length (LengthGroupedSampler) on 2 ranks: kuat's loader reads torch's batches
    (12 / 12, disjoint; before: 24 / 24 each); evaluation gathers each of the 14 samples once."""
    from tests._gloo import run_ranks

    results = run_ranks(_trainer_ranks, 2, args=(str(tmp_path),), timeout=300)
    for r in results:
        assert r["torch"]["world"] == r["kuat"]["world"] == 2
        assert r["kuat"]["train"] == r["torch"]["train"]
        assert r["kuat"]["eval"] == r["torch"]["eval"]
        assert sorted(r["kuat"]["eval"]) == list(range(EVAL))
    shares = [[x for b in r["kuat"]["train"] for x in b] for r in results]
    assert sorted(shares[0] + shares[1]) == list(range(TRAIN))
