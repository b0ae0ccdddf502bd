"""Small Parquet streams for the Hugging Face stream tests (test_hf_split*.py), written locally."""

from __future__ import annotations

import numpy as np
import pytest

B = 8  # the tests' batch size


def rows_collate(rows):
    return rows  # the samples themselves, in order


def batches(rows, drop_last=False):
    """``rows`` cut into batches of :data:`B`, as a loader over them gives."""
    out = [rows[i:i + B] for i in range(0, len(rows), B)]
    return out[:-1] if drop_last and out and len(out[-1]) < B else out


def loader(ds, workers, wtype=None, **kw):
    """A kuat loader of ``ds`` giving the samples themselves, batches of :data:`B`."""
    import kuat

    return kuat.DataLoader(ds, batch_size=B, num_workers=workers, worker_type=wtype,
                           collate_fn=rows_collate, timeout=60 if wtype == "process" else 0, **kw)


class Worker0of2:  # what torch.utils.data.get_worker_info() gives worker 0 of 2
    id, num_workers = 0, 2


def write_parts(out, *, seed: int, sizes, max_ids: int, vocab: int, row_group_size: int) -> list[str]:
    """One Parquet file per entry of ``sizes`` (rows) in ``out``: ``n`` (int64: row + 100 * file),
    ``ids`` (int32 lists of 1 to ``max_ids - 1`` values below ``vocab``), ``text`` ("r{file}-{row}");
    returns their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    paths = []
    for f, n in enumerate(sizes):
        ids = [rng.integers(0, vocab, int(k)).tolist() for k in rng.integers(1, max_ids, n)]
        table = pa.table({"n": pa.array(np.arange(n) + 100 * f, pa.int64()),
                          "ids": pa.array(ids, pa.list_(pa.int32())),
                          "text": [f"r{f}-{i}" for i in range(n)]})
        p = out / f"part-{f}.parquet"
        pq.write_table(table, p, row_group_size=row_group_size)
        paths.append(str(p))
    return paths


def load(files):
    """``files`` as a streaming ``datasets.IterableDataset``."""
    import datasets

    return datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)


@pytest.fixture(autouse=True)
def no_shutdown_sleep(monkeypatch):
    """datasets sleeps 5 s when an iteration over shards that used its thread pool ends."""
    import datasets

    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)
