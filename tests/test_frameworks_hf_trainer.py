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
