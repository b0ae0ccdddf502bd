"""Fuzz the reader with mutated manifests and shard bytes: only kuat errors may escape.

Each example copies a small valid dataset, mutates it, then opens it and reads every row
(raw, decoded and as a batch). A crash, a hang or any exception that is not a
``kuat.KuatError`` fails the test. Example counts are kept small (about 10 s in total);
``derandomize`` makes the examples the same on every run.
"""

from __future__ import annotations

import io
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kuat  # noqa: E402
from kuat import format as kf  # noqa: E402
from kuat.errors import KuatError  # noqa: E402

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((3, 4, 3), seed, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


_BASE = None


def _base() -> Path:
    global _BASE
    if _BASE is None:
        root = Path(tempfile.mkdtemp(prefix="kuat-fuzz-"))
        schema = {
            "image": kf.image(),
            "label": kf.int64(),
            "text": kf.string(),
            "emb": kf.tensor((2, 2), "float32"),
            "ids": kf.sequence("int32"),
            "flag": kf.bool_(),
        }
        with kuat.Writer(root / "ds", schema, shard_bytes=300) as w:
            for i in range(6):
                w.write(
                    {
                        "image": _png(i),
                        "label": i,
                        "text": f"t{i}",
                        "emb": np.full((2, 2), i, np.float32),
                        "ids": np.arange(i, dtype=np.int32),
                        "flag": bool(i % 2),
                    }
                )
        _BASE = root / "ds"
    return _BASE


def _read_everything(path: Path) -> None:
    try:
        ds = kuat.open(path)
        n = len(ds)
        idx = list(range(min(n, 50)))
        ds.read_batch(idx)
        for i in idx:
            ds.raw(i)
            ds[i]
        ds.__getitems__(idx[::-1])
        kf.verify(path)
    except KuatError:
        pass


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=12)
    | st.sampled_from(
        ["image", "tensor", "int64", "uint8", "sequence", "../x", "/", "shard-00000.arrow"]
    ),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=6,
)


def _targets(manifest: dict) -> list[tuple]:
    """Paths (tuples of keys) of every container slot in the manifest."""
    out = []

    def walk(obj, path):
        if isinstance(obj, dict):
            for k, v in obj.items():
                out.append(path + (k,))
                walk(v, path + (k,))
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                out.append(path + (i,))
                walk(v, path + (i,))

    walk(manifest, ())
    return out


@SETTINGS
@given(data=st.data())
def test_mutated_manifest(data):
    base = _base()
    manifest = json.loads((base / "manifest.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ds"
        shutil.copytree(base, path)
        mode = data.draw(st.sampled_from(["set", "delete", "text"]))
        if mode == "text":
            text = bytearray((base / "manifest.json").read_bytes())
            for pos, byte in data.draw(
                st.lists(
                    st.tuples(st.integers(0, len(text) - 1), st.integers(0, 255)),
                    min_size=1,
                    max_size=4,
                )
            ):
                text[pos] = byte
            (path / "manifest.json").write_bytes(bytes(text))
        else:
            targets = _targets(manifest)
            target = data.draw(st.sampled_from(targets))
            parent = manifest
            for k in target[:-1]:
                parent = parent[k]
            if mode == "delete":
                del parent[target[-1]]
            else:
                parent[target[-1]] = data.draw(json_values)
            (path / "manifest.json").write_text(json.dumps(manifest))
        _read_everything(path)


@SETTINGS
@given(data=st.data())
def test_mutated_shard_bytes(data):
    base = _base()
    manifest = json.loads((base / "manifest.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ds"
        shutil.copytree(base, path)
        k = data.draw(st.integers(0, len(manifest["shards"]) - 1))
        shard = path / manifest["shards"][k]["file"]
        raw = bytearray(shard.read_bytes())
        mode = data.draw(st.sampled_from(["replace", "replace-header", "truncate", "insert"]))
        if mode == "truncate":
            raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
        elif mode == "insert":
            pos = data.draw(st.integers(0, len(raw)))
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
        else:
            hi = min(len(raw), 600) if mode == "replace-header" else len(raw)
            for pos, byte in data.draw(
                st.lists(
                    st.tuples(st.integers(0, hi - 1), st.integers(0, 255)), min_size=1, max_size=6
                )
            ):
                raw[pos] = byte
        shard.write_bytes(bytes(raw))
        # keep the manifest's size right so that the Arrow reader itself sees the damage
        manifest["shards"][k]["bytes"] = len(raw)
        (path / "manifest.json").write_text(json.dumps(manifest))
        _read_everything(path)
