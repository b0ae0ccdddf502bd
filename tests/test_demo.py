"""The demo's slice through the system: the same images reach the consumer exactly once per
epoch through torch's loader and kuat's, with the same labels, shapes and dtypes."""

import collections
import json
import os

import pytest
import torch

import kuat
import kuat.convert
from kuat import vision as kv
from kuat._memory import KINDS
from kuat.cli import main
from kuat.demo_data import build_demo_imagefolder


@pytest.fixture(scope="module")
def demo_tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    src = build_demo_imagefolder(root, num_images=40, seed=5, progress=False)
    dst = root / "demo.kuat"
    kuat.convert.from_imagefolder(src, dst, num_workers=2, progress=False, include_path=True)
    return src, dst


def _expected(src):
    from torchvision import datasets

    folder = datasets.ImageFolder(str(src))
    return collections.Counter(
        (os.path.relpath(path, src), label) for path, label in folder.samples
    )


def test_torch_loader_sees_every_demo_image_once(demo_tree):
    from torchvision import datasets
    from torchvision.transforms import v2

    src, _ = demo_tree
    tf = v2.Compose([v2.RandomResizedCrop(224), v2.RandomHorizontalFlip(), v2.PILToTensor()])
    folder = datasets.ImageFolder(str(src), transform=tf)

    class WithPath(torch.utils.data.Dataset):
        def __len__(self):
            return len(folder)

        def __getitem__(self, i):
            image, label = folder[i]
            return image, label, os.path.relpath(folder.samples[i][0], src)

    loader = torch.utils.data.DataLoader(WithPath(), batch_size=16, shuffle=True, num_workers=2)
    for _ in range(2):
        seen = collections.Counter()
        for images, labels, paths in loader:
            assert images.dtype == torch.uint8 and images.shape[1:] == (3, 224, 224)
            seen.update(zip(paths, labels.tolist()))
        assert seen == _expected(src)


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_kuat_loader_sees_every_demo_image_once(demo_tree, worker_type):
    src, dst = demo_tree
    ds = kuat.open(dst).with_transform(
        {"image": kv.Compose([kv.RandomResizedCrop(224), kv.RandomHorizontalFlip()])}
    )
    loader = kuat.DataLoader(
        ds, batch_size=16, shuffle=True, num_workers=2, worker_type=worker_type, seed=1
    )
    for _ in range(2):
        seen = collections.Counter()
        for batch in loader:
            images, labels = batch["image"], batch["label"]
            assert images.dtype == torch.uint8 and images.shape[1:] == (3, 224, 224)
            assert labels.dtype == torch.int64 and labels.shape == (images.shape[0],)
            seen.update(zip(batch["path"], labels.tolist()))
        assert seen == _expected(src)


def test_kuat_demo_command_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo.json"
    status = main(
        [
            "demo",
            "--num-images", "24",
            "--batch-size", "8",
            "--workers", "2",
            "--train-seconds", "3",
            "--cache-dir", str(tmp_path),
            "--json", str(out),
        ]
    )
    assert status == 0
    printed = capsys.readouterr().out
    assert "torch DataLoader + ImageFolder" in printed and "kuat.DataLoader" in printed
    result = json.loads(out.read_text())
    for name in ("torch", "kuat"):
        r, m = result["loaders"][name], result["memory"][name]
        assert r["images"] == m["images"] == 24
        assert r["images_per_s"] > 0 and r["first_batch_s"] > 0
        assert "added_mib" not in r  # the timed run samples no memory
        assert set(m["added_mib"]) == set(KINDS) and m["peak_mib"] > 0
        assert "images_per_s" not in m  # the memory run's times are not reported
        assert sum(r["label_counts"]) == 24
    assert result["train"]["steps"] >= 1
    assert 0.0 <= result["train"]["data_wait_fraction"] <= 1.0


def test_demo_measures_after_importing_both_sides(demo_tree, monkeypatch):
    """The memory baseline (and the clock) start only once torchvision and kuat are imported,
    so neither side's imports count against it."""
    import sys

    from kuat import _memory
    from kuat.cli import demo

    seen = {}
    enter = _memory.PeakMemory.__enter__

    def spy(self):
        seen.update({m: m in sys.modules for m in ("torchvision.datasets", "kuat.vision")})
        seen["before"] = set(sys.modules)
        return enter(self)

    monkeypatch.setattr(_memory.PeakMemory, "__enter__", spy)
    src, dst = demo_tree
    out = demo._measure("kuat", str(dst), workers=0, batch_size=8, seed=0, memory=True)
    before = seen.pop("before")
    assert seen == {"torchvision.datasets": True, "kuat.vision": True}
    # nothing the epoch needs is imported on the clock (kuat.open's kuat.format and pyarrow were)
    late = sorted(m for m in set(sys.modules) - before if m.split(".")[0] in ("kuat", "pyarrow"))
    assert not late, late
    assert out["images"] == 40 and out["added_mib"]["pss"] == pytest.approx(
        sum(out["added_mib"][k] for k in ("anon", "file", "shmem")), abs=1.0
    )


@pytest.mark.parametrize("text", [False, True])
@pytest.mark.parametrize(
    "bad", [["--workers", "-1"], ["--batch-size", "0"], ["--train-seconds", "-1"], ["--seq-len", "1"]]
)
def test_demo_rejects_bad_options_in_one_line(tmp_path, bad, text):
    argv = ["demo", "--cache-dir", str(tmp_path), *bad] + (["--text"] if text else [])
    with pytest.raises(SystemExit) as info:  # before any work: nothing built, no traceback
        main(argv)
    message = str(info.value.code)
    assert message.startswith("kuat demo: need") and f"{bad[0]} {bad[1]}" in message
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("text", [False, True])
@pytest.mark.parametrize("via", ["--cache-dir", "KUAT_CACHE"])
def test_demo_names_an_unusable_cache_in_one_line(tmp_path, monkeypatch, capsys, text, via):
    """A cache root under a file (or, alike, read-only): one line naming the path, exit 1,
    as ``kuat convert`` answers an unwritable destination; no traceback."""
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    root = blocker / "cache"
    argv = ["demo", "--num-images", "12", "--batch-size", "4", "--train-seconds", "0"]
    if via == "KUAT_CACHE":
        monkeypatch.setenv("KUAT_CACHE", str(root))
    else:
        argv += ["--cache-dir", str(root)]
    assert main(argv + (["--text"] if text else [])) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kuat demo: error: [Errno 20]")
    assert str(root / "demo") in err[0]


def test_cli_raises_an_oserror_that_names_no_path(monkeypatch):
    """Only a file-system error naming a path is the user's; any other keeps its traceback."""
    import argparse

    from kuat import cli

    def fail(args):
        raise OSError(5, "Input/output error")

    ns = argparse.Namespace(command="x", verbose=False, _run=fail)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", lambda self, argv: (ns, []))
    with pytest.raises(OSError, match="Input/output"):
        cli.main([])
