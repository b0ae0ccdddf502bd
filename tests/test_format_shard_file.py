"""The shard file path: deferred data buffers and the checksum computed while writing give
exactly the bytes (and checksum) of pyarrow's own IPC writer on joined buffers."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import kuat
from kuat import format as kf
from kuat.format.manifest import file_checksum
from kuat.format.shard_file import DEFER_MIN_BYTES, deferring_works


def _pyarrow_stream(path) -> bytes:
    """The shard's batch re-written by pyarrow alone (every buffer joined in memory)."""
    with pa.memory_map(str(path)) as f:
        reader = pa.ipc.open_stream(f)
        batches = [pa.RecordBatch.from_pylist(b.to_pylist(), schema=b.schema) for b in reader]
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, reader.schema) as w:
            for b in batches:
                w.write_batch(b)
    return sink.getvalue().to_pybytes()


def test_deferred_shards_are_pyarrows_bytes_and_checksum(tmp_path):
    rng = np.random.default_rng(0)
    # variable-length values well past DEFER_MIN_BYTES per shard, of odd sizes (padding)
    blobs = [rng.bytes(int(n)) for n in rng.integers(1, 200_000, 40)]
    texts = ["é" * int(n) for n in rng.integers(0, 60_000, 40)]
    assert sum(map(len, blobs)) > 2 * DEFER_MIN_BYTES
    assert deferring_works()  # the pinned pyarrow hands buffers through: the fast path runs
    schema = {"blob": kf.binary(), "text": kf.string(), "label": kf.int64()}
    with kuat.Writer(tmp_path / "d", schema, shard_bytes=3 * DEFER_MIN_BYTES) as w:
        for i, (b, t) in enumerate(zip(blobs, texts)):
            w.write({"blob": b, "text": t, "label": i})
    manifest = kf.read_manifest(tmp_path / "d")
    assert len(manifest.shards) >= 2
    for shard in manifest.shards:
        path = tmp_path / "d" / shard.file
        data = path.read_bytes()
        assert data == _pyarrow_stream(path)
        assert shard.checksum == file_checksum(path)
        assert shard.bytes == len(data)
    ds = kuat.open(tmp_path / "d")
    assert [ds[i]["blob"] for i in range(len(ds))] == blobs
    assert [ds[i]["text"] for i in range(len(ds))] == texts


def test_a_failed_shard_write_is_raised_and_leaves_no_dataset(tmp_path, monkeypatch):
    """Shards are written on the Writer's shard thread: its error (a full disk) reaches the
    caller at the next shard or at close, the write is aborted, and nothing is left."""
    import errno
    import os

    from kuat.format import shard_file

    real = os.writev
    files = set()

    def full_disk(fd, buffers):
        files.add(os.readlink(f"/proc/self/fd/{fd}"))
        if len(files) > 1:  # the first shard goes through; the second fails
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, buffers)

    monkeypatch.setattr(shard_file.os, "writev", full_disk)
    schema = {"blob": kf.binary()}
    with pytest.raises(OSError, match="writing shard 1 of .* failed.*No space left") as e:
        with kuat.Writer(tmp_path / "d", schema, shard_bytes=1000) as w:
            for _ in range(50):
                w.write({"blob": bytes(600)})
    assert e.value.errno == errno.ENOSPC
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == []


def test_shards_join_their_values_where_pyarrow_copies_buffers(tmp_path, monkeypatch):
    """On a pyarrow that would not hand buffers through, nothing is deferred: same shards."""
    from kuat.format import builder

    monkeypatch.setattr(builder, "deferring_works", lambda: False)
    blobs = [bytes([i]) * 300_000 for i in range(10)]
    with kuat.Writer(tmp_path / "d", {"blob": kf.binary()}) as w:
        for b in blobs:
            w.write({"blob": b})
    (shard,) = kf.read_manifest(tmp_path / "d").shards
    path = tmp_path / "d" / shard.file
    assert path.read_bytes() == _pyarrow_stream(path)
    assert shard.checksum == file_checksum(path)
    ds = kuat.open(tmp_path / "d")
    assert [ds[i]["blob"] for i in range(len(ds))] == blobs
