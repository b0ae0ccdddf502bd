"""Hugging Face ``datasets`` as kuat sources.

:class:`HFMapSource` reads a ``datasets.Dataset`` a batch at a time: the batch's row numbers
go through the dataset's indices mapping (left by ``shuffle``, ``select``, ``filter``) in one
NumPy lookup, then

* numeric columns and lists of numbers (no nulls, nothing to decode), in the ``None``,
  ``"numpy"`` and ``"torch"`` formats, are gathered straight from the Arrow buffers (see
  :mod:`kuat.sources._arrow`) and converted to the format's dtype with one cast per column;
  every sample's value is a view of that one batch buffer, and the list of samples is a
  :class:`kuat.padding.Samples` that carries those buffers, so :func:`kuat.pad_collate` pads
  and collates those fields without per-sample work;
* every other column, and every column when the dataset has a lazy transform
  (``set_transform``/``with_transform``) or another format (``"arrow"``, ``"pandas"``, ...), is
  gathered with ``datasets``' own ``Table.fast_gather`` and formatted by the dataset's own
  formatter (which runs the transform once on the whole batch).

Samples come out as indexing the dataset would give them: the same keys, order, types (``int``
/ ``list``, ``numpy`` scalars and arrays, 0-d and 1-d tensors, one-row ``pyarrow.Table``),
dtypes (``datasets``' int64 and float32 in the ``numpy`` and ``torch`` formats) and values.
:class:`HFIterableSource` wraps a streaming ``datasets.IterableDataset``: each epoch is the
dataset's own iteration for that epoch (``set_epoch``: its shard order and shuffle buffer), split
across ranks and workers by position (:mod:`kuat.sources.stream`), the split taken before the
per-row work (Arrow to Python, per-row ``map``) wherever that is exact
(:mod:`kuat.sources._hf_split`).
"""

from __future__ import annotations

import copy
import logging
import threading

import numpy as np
import torch

from kuat.collate import own_batch_buffer
from kuat.padding import BatchColumn, Samples
from kuat.sources import _hf_progress, _hf_rows
from kuat.sources._arrow import ListColumn, ScalarColumn, numeric_column, numeric_list_column
from kuat.sources.stream import Stream

__all__ = ["HFMapSource", "HFIterableSource", "is_hf_map_dataset", "is_hf_iterable_dataset"]

_log = logging.getLogger("kuat.sources.hf")
_COPY_LOCK = threading.Lock()
_PLAN_LOCK = threading.Lock()


def is_hf_map_dataset(obj) -> bool:
    """True when ``obj`` is a ``datasets.Dataset`` (checked without importing ``datasets``)."""
    return any(
        c.__module__ == "datasets.arrow_dataset" and c.__name__ == "Dataset"
        for c in type(obj).__mro__
    )


def is_hf_iterable_dataset(obj) -> bool:
    """True when ``obj`` is a ``datasets.IterableDataset`` (checked without importing it)."""
    return any(
        c.__module__ == "datasets.iterable_dataset" and c.__name__ == "IterableDataset"
        for c in type(obj).__mro__
    )


# What datasets' formatters turn numbers into (TorchFormatter._tensorize,
# NumpyFormatter._tensorize): integers -> int64, floats -> float32, in both formats.
def _format_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.int64) if dtype.kind in "iu" else np.dtype(np.float32)


class _FastColumn:
    """One column read straight from Arrow and formatted the way ``datasets`` would."""

    __slots__ = ("name", "gather", "format_type")

    def __init__(self, name: str, gather: ScalarColumn | ListColumn, format_type: str | None):
        self.name = name
        self.gather = gather
        self.format_type = format_type  # None (python), "numpy" or "torch"

    def values(self, rows: np.ndarray) -> tuple[list, BatchColumn | None]:
        """The column's value for each of ``rows`` ``(B,) int64`` (a list of B objects), and
        the batch column they are views of (``None`` when they are not views)."""
        if isinstance(self.gather, ScalarColumn):
            col = self.gather.take(rows)  # (B,)
            if self.format_type is None:
                return col.tolist(), None
            col = col.astype(_format_dtype(col.dtype), copy=False)
            if self.format_type == "numpy":
                return list(col), None  # numpy scalars, as datasets' batch[col][i]
            t = own_batch_buffer(torch.from_numpy(col))  # a fresh gather: the batch's own
            out = t.unbind(0)  # 0-d views of one (B,) tensor
            return list(out), BatchColumn(t, None, out)
        offsets, flat = self.gather.take(rows)  # (B + 1,), (N,)
        bounds = offsets.tolist()
        if self.format_type is None:
            flat_list = flat.tolist()
            return [flat_list[bounds[i] : bounds[i + 1]] for i in range(len(rows))], None
        flat = flat.astype(_format_dtype(flat.dtype), copy=False)  # (N,) int64 | float32
        # Views of one (N,) buffer, consecutive in batch order: pad_collate pads them in one op.
        if self.format_type == "torch":
            flat = torch.from_numpy(flat)
            out = flat.split(np.diff(offsets).tolist())
        else:
            out = [flat[bounds[i] : bounds[i + 1]] for i in range(len(rows))]
        return list(out), BatchColumn(flat, offsets, out)


class HFMapSource(torch.utils.data.Dataset):
    """A ``datasets.Dataset`` read one batch per call (see the module docstring).

    Args:
        dataset: the ``datasets.Dataset``, with any indices mapping, format and transform.

    ``__getitems__(indices)`` returns a list of B samples for B indices (negative indices count
    from the end, as in ``datasets``), as ``datasets.Dataset.__getitems__`` does;
    ``__getitem__(i)`` is ``dataset[i]`` (in the ``"pandas"`` format a one-row frame).
    The plan is rebuilt when the dataset's format changes in place (``set_format``,
    ``set_transform``: the next batch has the new format, as in torch).
    Thread-safety: reads are thread-safe (the gather plan is read-only once built; a transform
    must itself be thread-safe to be run by several thread workers). Picklable: the plan is
    rebuilt after unpickling (memory-mapped tables are reopened by path).

    Raises:
        IndexError: an index is outside ``[-len(dataset), len(dataset))``.
    """

    def __init__(self, dataset):
        if not is_hf_map_dataset(dataset):
            raise TypeError(f"HFMapSource wraps a datasets.Dataset, got {type(dataset).__name__}")
        self.dataset = dataset
        self._build_plan()

    # ----------------------------------------------------------------------------- plan
    def _build_plan(self) -> None:
        from datasets.features.features import require_decoding
        from datasets.formatting import get_format_type_from_alias, get_formatter

        ds = self.dataset
        self._plan_key = _hf_rows.format_key(ds)
        self._format_type = get_format_type_from_alias(ds._format_type)
        self._formatter = get_formatter(
            ds._format_type, features=ds._info.features, **(ds._format_kwargs or {})
        )
        self._indices = None if ds._indices is None else numeric_column(ds._indices.table.column(0))
        table_columns = ds._data.column_names
        fmt_cols = ds._format_columns
        formatted = [c for c in table_columns if fmt_cols is None or c in fmt_cols]
        extra = [c for c in table_columns if c not in formatted] if ds._output_all_columns else []
        # Output key order of datasets' format_table: formatted columns, then the others.
        self._keys = formatted + extra
        self._fast: list[_FastColumn] = []
        fast_formats = (None, "numpy", "torch")
        if self._format_type in fast_formats:
            for name in self._keys:
                col_format = self._format_type if name in formatted else None
                if col_format is not None and ds._format_kwargs:
                    continue  # user dtype/device kwargs: let datasets apply them
                feature = ds._info.features.get(name) if ds._info.features else None
                if feature is None or require_decoding(feature):
                    continue
                column = ds._data.table.column(name)
                gather = numeric_column(column) or numeric_list_column(column)
                if gather is not None:
                    self._fast.append(_FastColumn(name, gather, col_format))
        fast_names = {c.name for c in self._fast}
        self._slow = [c for c in table_columns if c not in fast_names]
        _log.debug(
            "HF source: %d rows, format %s, fast columns %s, datasets-formatted %s",
            len(ds),
            self._format_type,
            sorted(fast_names),
            self._slow,
        )

    def __getstate__(self):
        return {"dataset": self.dataset}

    def __setstate__(self, state):
        self.dataset = state["dataset"]
        self._build_plan()

    # ---------------------------------------------------------------------------- reads
    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return self._fetch([index], single=True)[0]

    def _refresh(self) -> None:
        """Rebuild the plan when the dataset's format was changed in place (``set_format``,
        ``set_transform``, ``reset_format``: torch's DataLoader reads the dataset live)."""
        if not _hf_rows.same_format(self._plan_key, _hf_rows.format_key(self.dataset)):
            with _PLAN_LOCK:
                self._build_plan()

    def _rows(self, indices) -> np.ndarray:
        """Table row numbers ``(B,) int64`` of dataset ``indices`` (bounds-checked)."""
        keys = np.asarray(indices, dtype=np.int64).reshape(-1)  # (B,)
        n = len(self.dataset)
        if len(keys) and (keys.min() < -n or keys.max() >= n):
            bad = int(keys[(keys < -n) | (keys >= n)][0])
            raise IndexError(f"index {bad} is out of range for a dataset of {n} rows")
        keys = keys % n if n else keys
        if self._indices is None:
            return keys
        return self._indices.take(keys).astype(np.int64)  # (B,) uint64 -> int64

    def __getitems__(self, indices) -> list:
        """The samples of ``indices``, as ``datasets.Dataset.__getitems__`` gives them (what
        torch's DataLoader fetches with a batch size): one dict per row in every format
        (``"pandas"`` too), except ``"arrow"`` (one-row tables, where datasets fails)."""
        return self._fetch(indices)

    def _fetch(self, indices, single: bool = False) -> list:
        from datasets.formatting.formatting import format_table

        self._refresh()
        rows = self._rows(indices)
        n = len(rows)
        if n == 0:
            return []
        columns: dict[str, object] = {}
        batch = None
        if self._slow:
            sub = self.dataset._data.fast_gather(rows).select(self._slow)  # pyarrow.Table (B rows)
            batch = format_table(
                sub,
                range(n),
                formatter=self._formatter,
                format_columns=self.dataset._format_columns,
                output_all_columns=self.dataset._output_all_columns,
            )
        if not self._fast:
            return _hf_rows.split_rows(batch, n, self.dataset, indices, single)
        batch_columns = {}
        for col in self._fast:
            columns[col.name], info = col.values(rows)
            if info is not None:
                batch_columns[col.name] = info
        if batch is not None:
            columns.update(batch)
        keys = [k for k in self._keys if k in columns]
        per_key = [columns[k] for k in keys]
        samples = [dict(zip(keys, vals, strict=True)) for vals in zip(*per_key, strict=True)]
        return Samples(samples, batch_columns)


    def kuat_fetch_collated(self, indices):
        """``default_collate(self.__getitems__(indices))``, built column by column from the
        gathered Arrow rows when the dataset is in the Python format (no ``with_format``, no
        transform) and decodes nothing (:mod:`kuat.sources.hf_columnar`), else through the
        rows. Same structures, dtypes and values; raises what that collate raises."""
        from kuat.collate import default_collate

        ds = self.dataset
        if ds._format_type is not None or ds._format_columns is not None or not len(indices):
            return default_collate(self.__getitems__(indices))
        from kuat.sources import hf_columnar

        if not hf_columnar.plain_features(ds._info.features):
            return default_collate(self.__getitems__(indices))
        self._refresh()  # (the plan's indices mapping; __getitems__ refreshes itself)
        table = ds._data.fast_gather(self._rows(indices))  # pyarrow.Table, B rows
        return hf_columnar.ColumnarCollate(default_collate, None)(table)


def _shared_memo() -> dict:
    """``copy.deepcopy`` memo entries for what every copy of a dataset must share, not copy:
    ``huggingface_hub``'s process-wide filesystem cache, which a ``datasets.IterableDataset``
    references (deep-copying it re-creates cached filesystems, which re-enter that cache while
    it is being iterated)."""
    try:
        from huggingface_hub import HfFileSystem
    except ImportError:
        return {}
    cache = getattr(HfFileSystem, "_cache", None)
    return {} if cache is None else {id(cache): cache}


class HFIterableSource(Stream):
    """A streaming ``datasets.IterableDataset`` as a kuat stream.

    ``samples(epoch)`` calls the dataset's ``set_epoch(epoch)`` and yields exactly what iterating
    it in the main process gives (its shuffle, ``map``, format), ignoring the worker split that
    ``datasets`` applies inside torch workers: kuat splits the stream itself, by position, so
    that every rank gets the same number of samples and a resumed run is exact whatever the
    number of workers (see :mod:`kuat.sources.stream` for the cost: each rank and worker reads
    every shard; :mod:`kuat.sources._hf_split` for what it skips: other workers' rows are not
    turned into Python rows nor mapped by a per-row ``map`` wherever the stream allows,
    assuming, as ``datasets`` and torch do, that a ``map`` function's output for a row depends
    on that row only). A dataset already split with ``datasets.distributed.split_dataset_by_node`` is
    read as given, and not split across ranks again.

    ``split="shards"`` reads each example once instead: ranks take shards as
    ``datasets.distributed.split_dataset_by_node`` assigns them, and each worker the shards
    ``datasets`` gives it through ``torch.utils.data.get_worker_info()`` (kuat's thread workers
    answer it per thread). Shards differ in size, so ranks may then get different numbers of
    batches (end the epoch together yourself, e.g. with ``torch.distributed``'s ``Join``), and
    batches depend on ``num_workers``, so resume is exact only with the same worker count.

    Args:
        dataset: the ``datasets.IterableDataset``.
        split: ``"position"`` (default: equal shares, exact resume with any worker count) or
            ``"shards"`` (each example read once).

    Raises:
        TypeError: ``dataset`` is not a ``datasets.IterableDataset``.
        ValueError: an unknown ``split``.

    Thread-safety: several workers may iterate at once: each iteration works on its own
    ``copy.deepcopy`` of the dataset object (``datasets`` keeps iteration state on it; without
    workers the user's object follows the copy's progress, as under torch:
    :mod:`kuat.sources._hf_progress`). A deep copy never pickles (lambdas and local functions
    work without workers and in threads, as with torch); Arrow tables are shared, not copied.
    Only process workers started by ``spawn``/``forkserver`` pickle the dataset, and an
    unpicklable one then fails with pickle's own error, as in torch.
    """

    def __init__(self, dataset, split: str = "position"):
        super().__init__()
        if not is_hf_iterable_dataset(dataset):
            raise TypeError(
                f"HFIterableSource wraps a datasets.IterableDataset, got {type(dataset).__name__}"
            )
        if split not in ("position", "shards"):
            raise ValueError(f"split should be 'position' or 'shards', got {split=!r}")
        self.dataset = dataset
        self.split = split
        self._seen_epoch = 0  # the user's dataset.epoch the loader last saw (datasets starts at 0)
        self._seen_state = self._resumed = None  # last loaded state seen; kuat_resumed's epoch
        # what workers copy: a private snapshot that nothing else reads or writes (the user's
        # object may be touched while a worker copies; datasets sets attributes lazily)
        self._prototype = copy.deepcopy(dataset, _shared_memo() | _hf_progress.memo(dataset))
        if getattr(dataset, "_distributed", None) is not None:
            _log.info("the datasets.IterableDataset is already split by node; kuat keeps its split")

    @property
    def kuat_unequal_shares(self) -> str | None:
        """Why ranks may get unequal numbers of examples (``Stream.kuat_unequal_shares``)."""
        if getattr(self.dataset, "_distributed", None) is not None:
            return ("the datasets.IterableDataset is already split by split_dataset_by_node, "
                    "whose shares may differ by rank; give kuat the unsplit dataset")
        if self.split == "shards":
            return ("split='shards' gives each rank whole shards, whose sizes may differ; use "
                    "split='position'")
        return None

    def kuat_epoch_request(self) -> int | None:
        """The epoch the user's dataset was set to by its own ``set_epoch`` (or of a state
        given to its ``load_state_dict``) since the last call, else ``None``: the loader
        starts it next, as torch's DataLoader re-reading the dataset would (details:
        :func:`kuat.sources._hf_progress.epoch_request`). Called by the loader (main process)
        at each epoch start, ``set_epoch`` and ``load_state_dict``."""
        return _hf_progress.epoch_request(self)

    def kuat_resumed(self, epoch: int, resumed: bool) -> None:  # the loader resumes it?
        self._resumed = epoch if resumed else None

    def kuat_set_distributed(self, rank: int, world_size: int) -> None:
        if getattr(self.dataset, "_distributed", None) is not None:
            return  # split_dataset_by_node already took this rank's share
        super().kuat_set_distributed(rank, world_size)

    def _rank_and_world(self) -> tuple[int, int]:
        if getattr(self.dataset, "_distributed", None) is not None:
            return 0, 1
        return super()._rank_and_world()

    def _copy(self, epoch: int):
        """A private deep copy of the dataset at ``epoch`` (datasets keeps iteration progress
        on it: two workers iterating one object would disturb each other), of the snapshot
        taken at construction, one copy at a time. The state given to the dataset's own
        ``load_state_dict`` is read from the dataset itself, as torch's DataLoader would
        (also after the loader was built), unless the loader resumes ``epoch`` from its own
        state (:meth:`kuat_resumed`: the position is taken once, as torchdata takes it)."""
        resumed = self._resumed == epoch
        start = None if resumed else getattr(self.dataset, "_starting_state_dict", None)
        with _COPY_LOCK:
            ds = copy.deepcopy(self._prototype, _shared_memo())
            ds._starting_state_dict = copy.deepcopy(start)
        ds.set_epoch(epoch)
        return ds

    def __iter__(self):
        if self.split == "position":
            return self._position_share()
        from datasets.distributed import split_dataset_by_node

        ds = self._copy(self._epoch)
        rank, world_size = self._rank_and_world()
        if world_size > 1:
            ds = split_dataset_by_node(ds, rank=rank, world_size=world_size)
        # datasets shards by worker itself (get_worker_info); its own iteration: live state
        return _hf_progress.following(self, ds, iter(ds), live=True)

    def _position_share(self):
        """``split="position"``: this rank's and worker's share of the epoch, taken before the
        per-row work wherever that is exact (:mod:`kuat.sources._hf_split`), else of the whole
        stream (a generator: nothing is read before the first ``next``)."""
        from kuat.sources import _hf_split

        ds = self._copy(self._epoch)
        owned = _hf_split.owned_examples(self, ds)
        rows = self._share(self._examples(ds)) if owned is None else owned
        yield from _hf_progress.following(self, ds, rows, live=owned is None)

    def kuat_iter_collated(self, collate_fn, batch_size: int, drop_last: bool):
        """This worker's batches of the current epoch, read as Arrow record batches and
        collated column by column (:mod:`kuat.sources.hf_columnar`): ``(rows, batch)`` pairs,
        ``batch`` exactly ``collate_fn`` of the rows :meth:`__iter__` gives this worker for
        that batch (same samples, same order, same split by rank and worker). ``None`` when
        the columnar path cannot give that (a collate other than ``kuat.default_collate``,
        torch's or a ``kuat.pad_collate``; a ``map``/``filter`` of Python rows; a format or a
        feature that decodes): the caller then iterates rows. Called by the loader's workers
        at each epoch start, after ``set_epoch``."""
        from kuat.sources import _hf_arrow, hf_columnar

        collate = hf_columnar.columnar_collate(collate_fn)
        if collate is None or not batch_size:
            return None
        if self.split == "position" and (self._batch_size or 1) != batch_size:
            return None  # workers would not split by these batches
        start = getattr(self, "_start", None)
        if start is not None and start[0] == self._epoch:
            return None  # an epoch resumed part-way (Stream.start_at): the row path skips
        ds = self._copy(self._epoch)
        fmt = ds._formatting
        if (fmt is not None and fmt.format_type not in (None, "python")) or (
                _hf_arrow.resumed_inside(ds)):  # ds.load_state_dict: datasets' own iteration
            return None
        if not hf_columnar.plain_features(ds.features):
            return None
        info = torch.utils.data.get_worker_info()
        if self.split == "position":
            ex = ds._prepare_ex_iterable_for_iteration()
            _hf_arrow.stateless(ex)
            tables = _hf_arrow.arrow_tables(ex)
            if tables is None:
                return None
            rank, world_size = self._rank_and_world()
            rows = tables()
            if world_size > 1:
                rows = _hf_arrow.position_share(rows, rank, world_size, self._drop_last)
            w, n = (info.id, info.num_workers) if info is not None else (0, 1)
            batches = _hf_arrow.batches_of(rows, batch_size, drop_last, w, n)
        else:
            tables = self._shard_tables(ds, info)
            if tables is None:
                return None
            batches = _hf_arrow.batches_of(tables(), batch_size, drop_last)
        _log.debug("HF stream read as Arrow batches (columnar collate %s)", collate_fn)
        pairs = ((b.num_rows, collate(b)) for b in batches)
        if not _hf_progress.follows(self):  # (else the user's ds.state_dict() follows)
            return pairs
        return _hf_progress.Replayed(self, self._epoch).counted(pairs, batch_size)

    def _shard_tables(self, ds, info):
        """``split="shards"``: this rank's and worker's Arrow tables, split as ``datasets``
        splits them (``split_dataset_by_node``, then ``IterableDataset._iter_pytorch``'s
        ``shard_data_sources`` and ``shift_ex_examples_rngs`` per worker), or None."""
        from datasets.distributed import split_dataset_by_node
        from datasets.iterable_dataset import shift_ex_examples_rngs

        from kuat.sources import _hf_arrow

        rank, world_size = self._rank_and_world()
        if world_size > 1:
            ds = split_dataset_by_node(ds, rank=rank, world_size=world_size)
        ex = ds._prepare_ex_iterable_for_iteration()
        if info is not None and isinstance(ds, torch.utils.data.IterableDataset):
            if not ex.split_shard_indices_by_worker(info.num_workers, info.id, contiguous=False):
                return lambda: iter(())  # more workers than shards: this one reads nothing
            ex = ex.shard_data_sources(num_shards=info.num_workers, index=info.id, contiguous=False)
            ex = shift_ex_examples_rngs(ex_iterable=ex, value=info.id)
        _hf_arrow.stateless(ex)
        return _hf_arrow.arrow_tables(ex)

    def samples(self, epoch: int):
        """The dataset's examples for ``epoch``, as ``iter(dataset)`` gives them in the main
        process (mirrors ``datasets`` 5.2 ``IterableDataset.__iter__`` without its torch-worker
        branch)."""
        return self._examples(self._copy(epoch))

    @staticmethod
    def _examples(ds):
        from datasets.formatting import get_formatter

        ex_iterable = ds._prepare_ex_iterable_for_iteration()
        if ds._formatting and (ex_iterable.iter_arrow or ds._formatting.is_table):
            formatter = get_formatter(ds._formatting.format_type, features=ds.features)
            for _key, pa_table in ex_iterable.iter_arrow():
                yield formatter.format_row(pa_table)
            return
        for _key, example in ex_iterable:
            yield example

    def __repr__(self) -> str:
        return f"HFIterableSource({self.dataset!r:.80})"
