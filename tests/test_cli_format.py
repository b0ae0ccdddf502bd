"""kuat convert / inspect / verify / merge from the command line."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from PIL import Image

import kuat
from kuat.cli import main


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "imgs"
    for c, n in (("b", 3), ("a", 2)):
        (root / c).mkdir(parents=True)
        for i in range(n):
            buf = io.BytesIO()
            Image.new("RGB", (40 + i, 30), (i * 40, 0, 0)).save(buf, "JPEG")
            (root / c / f"{i}.jpg").write_bytes(buf.getvalue())
    return root


def test_convert_inspect_verify_merge(tree, tmp_path, capsys):
    out = tmp_path / "out.kuat"
    assert main(["convert", str(tree), str(out), "--workers", "2", "--no-progress"]) == 0
    assert "wrote 5 rows" in capsys.readouterr().out
    ds = kuat.open(out)
    assert [ds.raw(i)["label"] for i in range(5)] == [0, 0, 1, 1, 1]

    assert main(["inspect", str(out), "-n", "2"]) == 0
    text = capsys.readouterr().out
    assert "rows          5" in text and "label  int64  (2 names: a, b)" in text
    assert "[1] image=<jpeg 41x30" in text

    assert main(["verify", str(out), "--images", "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith("OK")

    assert main(["convert", str(tree), str(out), "--no-progress"]) == 1
    assert "overwrite" in capsys.readouterr().err

    assert main(["merge", str(out), str(out), "-o", str(tmp_path / "twice")]) == 0
    assert "10 rows" in capsys.readouterr().out
    assert len(kuat.open(tmp_path / "twice")) == 10


def test_verify_exit_status_names_bad_shard(tree, tmp_path, capsys):
    out = tmp_path / "out.kuat"
    assert main(["convert", str(tree), str(out), "--shard-bytes", "1k", "--no-progress"]) == 0
    ds = kuat.open(out)
    bad = ds.shard_paths[1]
    data = bytearray(open(bad, "rb").read())
    data[len(data) // 2] ^= 1
    open(bad, "wb").write(bytes(data))
    capsys.readouterr()
    assert main(["verify", str(out), "--no-progress"]) == 1
    text = capsys.readouterr().out
    assert f"BAD {bad}" in text and "checksum mismatch" in text and "FAILED" in text


def test_convert_resize_and_skip(tree, tmp_path, capsys):
    (tree / "a" / "broken.jpg").write_bytes(b"nope")
    out = tmp_path / "r.kuat"
    rc = main(
        [
            "convert",
            str(tree),
            str(out),
            "--resize-shorter",
            "15",
            "--quality",
            "80",
            "--on-error",
            "skip",
            "--no-progress",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "skipped 1 unreadable sample(s)" in text and "broken.jpg" in text
    ds = kuat.open(out)
    assert len(ds) == 5
    assert all(ds.raw(i)["image"].height == 15 for i in range(5))
    assert ds[0]["image"].shape == (15, 20, 3)


def test_convert_errors_exit_1(tmp_path, capsys):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.jpg").write_bytes(b"nope")
    (tmp_path / "bad" / "c").mkdir()
    (tmp_path / "bad" / "c" / "x.jpg").write_bytes(b"nope")
    assert main(["convert", str(tmp_path / "bad"), str(tmp_path / "o"), "--no-progress"]) == 1
    assert "x.jpg" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "missing.parquet"), str(tmp_path / "o2")]) == 1
    assert main(["inspect", str(tmp_path / "o3")]) == 1
    assert "not a kuat dataset" in capsys.readouterr().err


def test_convert_numpy_with_format_flag(tmp_path, capsys):
    np.save(tmp_path / "arr.bin", np.arange(12, dtype=np.int16).reshape(4, 3))
    src = tmp_path / "arr.bin.npy"
    assert (
        main(["convert", str(src), str(tmp_path / "o"), "--format", "numpy", "--no-progress"]) == 0
    )
    ds = kuat.open(tmp_path / "o")
    np.testing.assert_array_equal(ds[3]["arr.bin"], [9, 10, 11])
    assert os.path.isdir(tmp_path / "o")


def test_help_is_plain_text_and_bad_flags_name_the_flag(tmp_path, capsys):
    for cmd in ("convert", "inspect", "verify", "merge"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        text = capsys.readouterr().out
        assert "``" not in text and "::" not in text, text
    for flag, value in (
        ("--workers", "0"),
        ("--resize-shorter", "-1"),
        ("--quality", "101"),
        ("--shard-bytes", "2G"),
        ("--shard-bytes", "lots"),
    ):
        with pytest.raises(SystemExit):
            main(["convert", str(tmp_path), str(tmp_path / "o"), flag, value])
        err = capsys.readouterr().err
        assert f"argument {flag}:" in err and "_size" not in err, err


def test_cli_messages_say_the_flag_and_print_each_thing_once(tree, tmp_path, capsys, caplog):
    (tree / "a" / "bad.jpg").write_bytes(b"not a jpeg")
    out = str(tmp_path / "o")
    args = ["convert", str(tree), out, "--no-progress", "--on-error", "skip"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert captured.out.count("bad.jpg") == 1 and "bad.jpg" not in captured.err
    assert not [r for r in caplog.records if "bad.jpg" in r.getMessage()]  # not logged too
    assert "wrote 5 rows" in captured.out and "wrote kuat dataset" not in captured.err
    assert main(args) == 1
    assert "--overwrite" in capsys.readouterr().err
    caplog.clear()
    assert main(["merge", out, "-o", str(tmp_path / "m")]) == 0
    assert "merged 1 datasets" in capsys.readouterr().out
    assert not [r for r in caplog.records if "merged" in r.getMessage()]  # printed once
    assert main(["merge", out, "-o", str(tmp_path / "m")]) == 1
    assert "--overwrite" in capsys.readouterr().err
    shard = kuat.open(out).shard_paths[0]
    with open(shard, "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    assert main(["verify", out]) == 1
    bad = [line for line in capsys.readouterr().out.splitlines() if line.startswith("BAD")]
    assert len(bad) == 1 and bad[0].count(shard) == 1 and "checksum mismatch" in bad[0]


def test_output_into_a_closed_pipe_is_quiet(tree, tmp_path):
    # `kuat inspect ds | head -3` printed a BrokenPipeError traceback
    import subprocess
    import sys

    out = tmp_path / "out.kuat"
    kuat.convert.from_imagefolder(tree, out, progress=False)
    r, w = os.pipe()
    os.close(r)  # the reader has gone before kuat writes anything
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kuat.cli", "inspect", str(out)],
            stdout=w, stderr=subprocess.PIPE, text=True, timeout=120,
        )  # fmt: skip
    finally:
        os.close(w)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 1


def test_a_mistyped_option_is_reported_with_the_commands_own_usage_and_not_abbreviated(capsys):
    from kuat.cli import main

    for typo in ("--wokers", "--worker"):  # (argparse would take --worker for --workers)
        with pytest.raises(SystemExit) as e:
            main(["convert", typo, "2", "/nonexistent-src", "/nonexistent-dst.kuat"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: kuat convert") and f"unrecognized arguments: {typo}" in err


def test_python_dash_m_kuat_is_the_kuat_command():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kuat", "--version"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and kuat.__version__ in out.stdout + out.stderr, out
