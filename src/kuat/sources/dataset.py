"""The kuat source: what ``kuat.open`` returns, a kuat dataset read as samples and batches.

The storage underneath (manifest, shards, columnar gathers) is a :class:`kuat.format.Store`;
this module adds what turns rows into training samples:

- ``__getitems__(indices)`` (torch's batched fetch): one columnar gather per field
  (``Store.gather``), then per sample only what must be per sample: image decode (or a fused
  transform writing into one ``(B, 3, H, W)`` batch buffer: ``_images.py``) and user
  callables, each with its sample's generator (``kuat.sample_rng``) set;
- ``kuat_fetch_collated(indices)``: the same batch collated straight from the columns (a fused
  transform's batch buffer is returned as the batch it already is);
- ``with_transform``: per-field or whole-sample transforms, as views sharing one store;
- the loader hooks ``kuat_prefetch`` (remote shards in epoch order) and
  ``kuat_batch_transform`` (a fused transform's batch step, e.g. on-device ``Normalize``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from kuat.format.manifest import Manifest
from kuat.format.schema import Schema
from kuat.format.store import Store, open_store
from kuat.rng import map_samples
from kuat.sources._images import fill_batch, fills_batch, image_batch, image_values
from kuat.sources._routes import AS_IS, FILL, NUMBER, OTHER, TENSOR
from kuat.vision import protocol as vision_protocol

__all__ = ["Dataset", "open_dataset"]

_torch = None  # torch, once a view has decided its routes


class Dataset:
    """A kuat dataset opened for random access; map-style and torch-compatible.

    ``ds[i]`` returns ``{field: value}``:

    - image: ``(H, W, 3)`` uint8 RGB ``np.ndarray`` (decoded with
      ``kuat.vision.decode.decode_image``), or what the field's transform returns;
    - int/float/bool scalar: Python ``int``/``float``/``bool``;
    - tensor: ``np.ndarray`` of the declared ``shape`` and ``dtype``;
    - sequence: 1-D ``np.ndarray``; string: ``str``; bytes: ``bytes``.

    ``raw(i)`` returns the same without decoding (images as :class:`EncodedImage`),
    ``read_batch(indices)`` a column-wise batch with one gather per field, and
    ``__getitems__(indices)`` the list of sample dicts torch's ``DataLoader`` asks for.
    Indices behave like a Python sequence's (negative from the end, ``IndexError`` outside).

    Thread-safety: every read method may be called from many threads at once (shards are
    opened under a lock; mapped memory is read-only). Picklable (for process workers):
    the copy re-opens shards lazily.

    Raises:
        kuat.FormatError: on first access to a missing, truncated or corrupt shard, naming
            its path (opening checks only the manifest).
        kuat.DecodeError: an image cannot be decoded (names the sample index and shard).
    """

    # A batch depends only on its indices (and the loader's seed/epoch), never on which thread
    # fetches it: the loader may fetch cheap batches in the consumer thread (no hand-off).
    kuat_thread_agnostic = True

    @property
    def kuat_uses_sample_rng(self) -> bool:
        """Whether fetching draws randomness only from ``kuat.sample_rng``, never from the
        global generators (``kuat.sources.protocol.uses_sample_rng``: the loader then need not
        reseed and fingerprint them around each batch, ``isolate_global_rng=False`` by
        default): true with no transform or with only ``kuat.vision`` transforms per field
        (they draw from the sample's generator; decoding draws nothing). Any other callable,
        any whole-sample transform, and a ``kuat.vision.Compose`` with a user's step (a
        subclass of a kuat transform, whose draws are its own) may draw from ``random``, NumPy
        or torch: false. Assigning it (``ds.kuat_uses_sample_rng = True``, as the loader's
        advice says for a user transform drawing from ``kuat.sample_rng``) declares it for this
        view only."""
        if self._declared_uses_sample_rng is not None:
            return self._declared_uses_sample_rng
        return self._sample_transform is None and all(
            type(s).__module__.startswith("kuat.vision.")
            for t in self._field_transforms.values()
            for s in (t, *getattr(t, "transforms", ()))  # a Compose's steps too
        )

    @kuat_uses_sample_rng.setter
    def kuat_uses_sample_rng(self, value: bool) -> None:
        self._declared_uses_sample_rng = bool(value)

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        storage_options: Mapping | None = None,
        cache_dir: str | os.PathLike | None = None,
        cache_limit_bytes: int | None = None,
        prefetch_shards: int = 4,
        _store: Store | None = None,
    ):
        if _store is None:
            _store = open_store(
                path,
                storage_options=storage_options,
                cache_dir=cache_dir,
                cache_limit_bytes=cache_limit_bytes,
                prefetch_shards=prefetch_shards,
            )
        self._store = _store
        self._field_transforms: dict[str, Callable] = {}
        self._sample_transform: Callable | None = None
        self._declared_uses_sample_rng: bool | None = None  # kuat_uses_sample_rng assigned

    # -- description -----------------------------------------------------------------------
    @property
    def path(self) -> Path | str:
        """The dataset directory (a ``Path``), or its URL (a ``str``) for a remote dataset."""
        return self._store.path

    @property
    def schema(self) -> Schema:
        return self._store.schema

    @property
    def manifest(self) -> Manifest:
        return self._store.manifest

    @property
    def metadata(self) -> dict:
        """The user metadata kept in the manifest (class names, source, ...)."""
        return self._store.manifest.metadata

    @property
    def num_shards(self) -> int:
        return len(self._store.shard_paths)

    @property
    def shard_paths(self) -> list[str]:
        return list(self._store.shard_paths)

    def __len__(self) -> int:
        return self._store.num_rows

    def __repr__(self) -> str:
        return (
            f"kuat.Dataset({str(self.path)!r}, rows={len(self)}, shards={self.num_shards}, "
            f"schema={self.schema})"
        )

    # -- storage reads (the store's: no decoding, no transform) -----------------------------
    def locate(self, index: int) -> tuple[str, int]:
        """``(shard path, row within the shard)`` of sample ``index``."""
        return self._store.locate(index)

    def read_batch(self, indices: Sequence[int], fields: Sequence[str] | None = None) -> dict:
        """Column-wise read of rows ``indices``, nothing decoded and no transform applied
        (:meth:`kuat.format.Store.read_batch` documents each field's form)."""
        return self._store.read_batch(indices, fields)

    def read_flat(self, indices: Sequence[int], field: str) -> tuple[np.ndarray, np.ndarray]:
        """Sequence ``field`` of rows ``indices`` end to end, ``(lengths (B,), values (T,))``
        (:meth:`kuat.format.Store.read_flat`)."""
        return self._store.read_flat(indices, field)

    def sequence_lengths(self, field: str) -> np.ndarray:
        """``(N,) int64`` values of sequence ``field`` per row, from the shards' offsets
        (:meth:`kuat.format.Store.sequence_lengths`)."""
        return self._store.sequence_lengths(field)

    def raw(self, index: int) -> dict:
        """Sample ``index`` without decoding or transforms (images as
        :class:`kuat.format.EncodedImage` with ``bytes`` data)."""
        return self._store.raw(index)

    # -- samples ---------------------------------------------------------------------------
    def __getitem__(self, index: int) -> dict:
        return self._samples(np.array([self._store.index(index)], np.int64), batch_buffer=False)[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict]:
        """The samples ``indices`` as a list of dicts (torch's batched-fetch contract).

        With a fused image transform of fixed output size ``(H, W)``, each sample's image is
        ``buf[j]``, a view of one ``(B, 3, H, W)`` uint8 tensor, so collation is free.
        """
        return self._samples(self._store.indices(indices), batch_buffer=True)

    def kuat_fetch_collated(self, indices: Sequence[int]):
        """``kuat.default_collate(self.__getitems__(indices))``, without per-sample objects.

        What the loader calls when its collate is the default one (``kuat.default_collate``
        or torch's): the columnar gather goes straight to batch tensors. Same structures,
        dtypes and values as collating the samples: ``{field: batch}`` with int scalars as
        ``(B,)`` int64, float scalars ``(B,)`` float64, bools ``(B,)`` bool (as torch collates
        Python numbers), tensors ``(B, *shape)`` of their dtype (the gather's own copy, no
        second one), strings a list of B ``str``; an image field whose fused transform has a
        fixed output size gives its ``(B, 3, H, W)`` uint8 batch buffer itself (what collating
        its B views returns); other images, bytes, sequences and fields with a transform are
        built per sample and collated per field. With a whole-sample transform the samples are
        built and collated as they would be. Thread-safe (as ``__getitems__``).
        """
        names, own, routes, whole = self.__dict__.get("_routes") or self._collated_routes()
        if whole is not None:  # the batch in one C call (sources/_rows_fetch.py), if it takes it
            batch = whole(indices)
            if batch is not None:
                return batch
        idx = self._store.indices(indices)
        if self._sample_transform is not None or len(idx) == 0:
            from kuat.collate import default_collate

            return default_collate(self._samples(idx, batch_buffer=True))
        sid, cols = self._store.gather(idx, names, own)
        out = dict.fromkeys(names)  # the schema's order; filled in the routes' order
        index_list = None
        for name, route, arg in routes:
            c = cols[name]
            if route is TENSOR:
                out[name] = _torch.from_numpy(c)  # (B, *shape): the gather's fresh copy
            elif route is NUMBER:  # as torch.tensor(list of Python numbers): arg's dtype
                out[name] = _torch.from_numpy(c.astype(arg, copy=False))
            elif route is AS_IS:
                out[name] = c  # B str, as default_collate leaves strings
            elif route is FILL:  # a fused transform's batch buffer is the batch as it is
                out[name] = fill_batch(c, idx, sid, self._store.shard_paths,
                                       self._field_transforms[name], arg)
            else:
                if index_list is None:
                    index_list = idx.tolist()
                t = self._field_transforms.get(name)
                if arg == "image":
                    out[name] = image_batch(c, index_list, sid, self._store.shard_paths, t)
                else:
                    from kuat.collate import default_collate

                    f = self.schema[name]
                    out[name] = default_collate(self._field_values(f, c, index_list, sid, True))
        return out

    def _collated_routes(self) -> tuple[list, tuple, tuple, object]:
        """How :meth:`kuat_fetch_collated` builds each field, decided once per view (its
        transforms are fixed when it is made): ``(field names, image fields whose transform
        advises its own reads, ((name, route, arg), ...), the whole batch's one C call or
        None)`` (:func:`kuat.sources._rows_fetch.rows_fetcher`)."""
        routes = self.__dict__.get("_routes")
        if routes is None:
            global _torch  # imported when first needed, not with kuat
            import torch

            _torch = torch
            ft = self._field_transforms
            per = []
            for f in self.schema:
                kind, t = f.type.kind, ft.get(f.name)
                size = fills_batch(t) if kind == "image" else None
                if t is None and kind == "tensor":
                    per.append((f.name, TENSOR, None))
                elif t is None and kind in ("scalar", "bool") and f.type.np_dtype != np.uint64:
                    # collated as torch.tensor of Python numbers: (B,) int64, float64 or bool
                    want = (bool if kind == "bool"
                            else np.float64 if f.type.np_dtype.kind == "f" else np.int64)
                    per.append((f.name, NUMBER, np.dtype(want)))
                elif t is None and kind == "string":
                    per.append((f.name, AS_IS, None))
                elif size is not None:  # (with the transform's rows path, if it has one)
                    from kuat.vision._rows import rows_filler

                    per.append((f.name, FILL, (size, rows_filler(t))))
                else:
                    per.append((f.name, OTHER, kind))
            own = tuple(n for n, route, _ in per  # (their gather makes no codec names)
                        if route is FILL and vision_protocol.advises_reads(ft[n]))
            # the columns that cannot fail first: their Python runs before an image batch's
            # decode evicts the caches (it then costs several times its warm price); fields
            # that may raise keep the schema's order (the first one fails the batch)
            per.sort(key=lambda r: r[1] is FILL or r[1] is OTHER)
            whole = None
            if self._sample_transform is None:
                from kuat.sources._rows_fetch import rows_fetcher

                whole = rows_fetcher(self._store, self.schema.names, per, ft)
            routes = self._routes = (self.schema.names, own, tuple(per), whole)
        return routes

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def _samples(self, idx: np.ndarray, batch_buffer: bool) -> list[dict]:
        b = len(idx)
        if b == 0:
            return []
        sid, cols = self._store.gather(idx, self.schema.names)
        index_list = idx.tolist()
        per_field = [self._field_values(f, cols[f.name], index_list, sid, batch_buffer)
                     for f in self.schema]
        names = self.schema.names
        samples = [dict(zip(names, vals)) for vals in zip(*per_field)]
        st = self._sample_transform
        if st is not None:
            it = iter(samples)
            samples = map_samples(lambda _i: st(next(it)), index_list)
        return samples

    def _field_values(self, f, c, index_list: list, sid: np.ndarray, batch_buffer: bool) -> list:
        """The B per-sample values of field ``f`` from its gathered column ``c``."""
        kind, t = f.type.kind, self._field_transforms.get(f.name)
        if kind == "image":
            return image_values(c, index_list, sid, self._store.shard_paths, t, batch_buffer)
        if kind in ("scalar", "bool"):
            values = c.tolist()  # (B,) -> Python ints/floats/bools
        elif kind == "tensor":
            values = list(c)  # (B, *shape) -> B views of shape
        elif kind == "bytes":
            values = [bytes(v) for v in c]
        elif kind == "sequence":
            values = [np.array(v) for v in c]  # writable copies
        else:
            values = c
        if t is not None:
            it = iter(values)  # called in order: the j-th call gets the j-th value
            values = map_samples(lambda _i: t(next(it)), index_list)
        return values

    # -- transforms ------------------------------------------------------------------------
    def with_transform(self, transform: Mapping[str, Callable] | Callable | None) -> Dataset:
        """A view of this dataset that applies ``transform`` to each sample (shards shared).

        Args:
            transform: ``{field: callable}`` for per-field transforms; or one callable that
                gets each whole decoded sample dict and may return anything; or ``None``.
                It replaces this view's transform (it does not compose with it). For an
                image field:

                - an object with ``apply_encoded`` (``kuat.vision.protocol.FusedImageTransform``)
                  gets the encoded bytes, the stored width/height and the sample's generator
                  (``kuat.sample_rng(index).numpy``); with a fixed ``output_size()`` it writes
                  into one ``(B, 3, H, W)`` uint8 batch buffer;
                - any other callable gets a ``(3, H, W)`` uint8 ``torch.Tensor`` (so torchvision
                  v2 transforms work).

                ``kuat.sample_rng()`` works inside every user callable (the sample's index is set).

        Raises:
            ValueError: a key is not a field of the schema.
            TypeError: a transform is not callable / has no ``apply_encoded``, or a
                ``kuat.vision`` transform is given for the whole sample instead of for a field.
        """
        view = Dataset(self.path, _store=self._store)
        if transform is None:
            return view
        if isinstance(transform, Mapping):
            for name, t in transform.items():
                if name not in self.schema:
                    raise ValueError(f"with_transform: no field {name!r} in {self.schema}")
                if not (callable(t) or vision_protocol.is_fused(t)):
                    raise TypeError(
                        f"with_transform: the transform of field {name!r} is not callable: {t!r}"
                    )
                if vision_protocol.is_fused(t) and self.schema[name].type.kind != "image":
                    raise TypeError(
                        f"with_transform: field {name!r} is {self.schema[name].type.describe()}; "
                        "fused image transforms apply to image fields only"
                    )
            view._field_transforms = dict(transform)
        elif (vision_protocol.is_fused(transform)
              or type(transform).__module__.startswith("kuat.vision.")):
            # a kuat.vision transform would get the whole sample dict and fail at iteration
            images = [f.name for f in self.schema if f.type.kind == "image"] or ["image"]
            raise TypeError(
                f"with_transform: {type(transform).__name__} is an image transform, which "
                f"applies to one image field, not to the whole sample; pass it per field: "
                f"with_transform({{{images[0]!r}: ...}}) (image fields: {images})"
            )
        elif callable(transform):
            view._sample_transform = transform
        else:
            raise TypeError(
                f"with_transform takes a dict of field -> callable or a callable, got {transform!r}"
            )
        return view

    def kuat_prefetch(self, indices) -> None:
        """Loader hook, called once per epoch (on the loader's copy) with this rank's sample
        indices in the order the epoch reads them (a sequence of ints): a remote dataset starts
        fetching their shards into its cache in that order, ``prefetch_shards`` ahead of use.
        A local dataset does nothing. Returns at once; safe from any thread."""
        self._store.prefetch(indices)

    @property
    def has_transform(self) -> bool:
        """Whether samples pass through a transform (:meth:`with_transform`); when not,
        :meth:`read_batch` returns exactly the values ``__getitems__`` would."""
        return bool(self._field_transforms) or self._sample_transform is not None

    @property
    def kuat_splits_batches(self) -> bool:
        """Whether a batch fetch can use several threads (``kuat._parallel.width()``): an image
        field's fused transform fills the batch buffer in parts (``splits_batches``). The
        loader then gives an epoch's first batch all its workers' cores."""
        return any(vision_protocol.splits_batches(t) for t in self._field_transforms.values())

    @property
    def kuat_batch_transform(self) -> Callable | None:
        """Callable applying each fused image transform's ``batch_transform()`` to its field
        of the collated batch dict (the loader calls it after the device copy), or ``None``."""
        fns = {}
        for name, t in self._field_transforms.items():
            fn = vision_protocol.batch_transform(t)
            if fn is not None:
                fns[name] = fn
        if not fns:
            return None
        from kuat.device import FieldSteps  # the loader's device stage applies it

        return FieldSteps(fns)

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Drop this dataset's shard mappings (shared with its transformed views). Idempotent;
        a later read maps the shards again. Arrays returned earlier stay valid."""
        self._store.close()

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_dataset(
    path: str | os.PathLike,
    *,
    storage_options: Mapping | None = None,
    cache_dir: str | os.PathLike | None = None,
    cache_limit_bytes: int | None = None,
    prefetch_shards: int = 4,
) -> Dataset:
    """Open the kuat dataset at ``path`` (reads only the manifest; shards map lazily).

    Args:
        path: a local directory, a ``file://`` URL, or an fsspec URL (``s3://bucket/x.kuat``,
            ``gs://``, ``az://``, ``http(s)://``, ``memory://``).
        storage_options: fsspec options for a URL (``{"endpoint_url": ..., "key": ...,
            "secret": ...}`` for s3fs; see :mod:`kuat.format.fs`).
        cache_dir: where remote shards are cached; shared safely by every loader and process.
            Default: ``$KUAT_CACHE_DIR`` (the shard directory itself), else ``shards`` under
            kuat's cache root (``$KUAT_CACHE``, else ``$XDG_CACHE_HOME/kuat``, else
            ``~/.cache/kuat``).
        cache_limit_bytes: the cache's size limit in bytes (``KUAT_CACHE_LIMIT_BYTES``,
            default 50 GiB); least recently used shards are evicted beyond it.
        prefetch_shards: remote shards fetched ahead of use, in the epoch's order, when a
            ``kuat.DataLoader`` starts an epoch (0: none).

    Raises:
        kuat.FormatError: no manifest, not JSON, invalid or of an unknown version.
        kuat.format.fs.RemoteError: a remote manifest cannot be read after retries.
        ImportError: the URL scheme's fsspec backend is not installed (names the package).
        ValueError: ``storage_options`` given for a local path, or a bad cache setting.
    """
    return Dataset(
        path,
        storage_options=storage_options,
        cache_dir=cache_dir,
        cache_limit_bytes=cache_limit_bytes,
        prefetch_shards=prefetch_shards,
    )
