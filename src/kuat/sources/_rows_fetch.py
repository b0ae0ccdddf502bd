"""A kuat dataset's batch in one C call, from the sampler's list of indices to its tensors.

What ``Dataset.kuat_fetch_collated`` tries first when a view's fields are fixed-size (scalars,
bools and tensors that collate as they are stored) plus one image field whose transform takes
the rows path (:func:`kuat.vision._rows.rows_filler`: ``RandomResizedCrop`` then flips, fixed
output size): ``_roijpeg.c``'s ``fetch_rows`` checks the B indices, locates their shards,
gathers the fixed fields and plans and decodes the images into the batch buffer, with the GIL
released once, for the decodes. An epoch's first batch, given a width of several threads
(:mod:`kuat._parallel`), has its decodes shared by helper threads the C call starts and joins
without the GIL: no Python thread is started for it (starting and joining one took about
230 us of the calling thread's CPU after a 10 ms wait, 2026-12-03, this 2-core host: more
than three steady batches' Python).

Why: a thread worker's Python between two batch decodes is what its batches cost the
interpreter lock (issue 31), and it runs with cold caches (a batch of 64 decodes evicts them),
where each Python call costs several microseconds instead of a fraction of one, and the first
NumPy or torch call tens. Measured with timestamps in one thread worker (batch 64,
``RandomResizedCrop(224)`` + flip, 2026-12-02, docs/benchmarks.md): the general path's Python
from ``ctx.fetch`` to its return (index checks, shard location, the gather, the label tensor,
the buffer, the rows call) took about 258 us per batch; this path about 65 (the batch's
tensors come ready from the loader's pool, :meth:`kuat._buffers.BufferPool.take_array`).

The same batches as the general path (tests/test_rows_fetch.py compares them): the same
``{field: tensor}`` in the schema's order, the same pixels (the C planner is the one the rows
path calls), the same errors. Whatever this path does not take, it leaves to the general path
by returning ``None`` with nothing kept: indices that are not a list of in-range Python ints
(the general path then raises or wraps them as a sequence does), a shard not mapped yet (the
general path maps it), ``exact_resize``. Samples the C planner
leaves (not a JPEG the ROI decoder takes, EXIF-rotated, over ``max_pixels``, a failed decode)
go through the per-image path afterwards, as on the rows path (:func:`kuat.vision._rows._rest`).

Thread-safety: as the dataset's reads (nothing is written but the batch's own buffers).
Pickles without its C function (looked up again when unpickled, in a process worker).
"""

from __future__ import annotations

import numpy as np
import torch

from kuat import _native, _parallel
from kuat._buffers import new_batch_array, thread_state
from kuat.format.gather import ImageRows, native
from kuat.rng import current_epoch
from kuat.sources._routes import FILL, NUMBER, TENSOR
from kuat.vision._rows import _rest
from kuat.vision.decode import roi_function
from kuat.vision.steps import rrc_params

__all__ = ["rows_fetcher"]

_MASK64 = (1 << 64) - 1
# this thread's batch scope (its pool) and fetch width, read as attributes of their
# threading.local objects
_owned, _PAR = thread_state(), _parallel.thread_state()


def rows_fetcher(store, names: list, routes: list, transforms: dict):
    """``fetch(indices) -> dict | None`` for a view whose ``routes`` (``Dataset``'s
    ``(name, route, arg)``) it can take, else ``None``: every field but the image on the
    general path's tensor route, or on its number route where the stored dtype is the
    collated one (a field with a transform, a uint64 scalar or a float32 one are not), and
    exactly one image field on the fill route with a rows path. ``transforms``: the view's
    field transforms.
    """
    if native() is None or roi_function("fetch_rows") is None:
        return None
    image, fixed = None, []
    for name, route, arg in routes:
        if route is FILL:  # (size, the transform's rows path or None)
            if image is not None or arg[1] is None:
                return None
            image = name
            continue
        if route is not TENSOR and route is not NUMBER:
            return None
        ftype = store.schema[name].type
        dt = np.dtype(bool) if ftype.kind == "bool" else ftype.np_dtype  # as stored
        if route is NUMBER and dt != arg:  # (arg: the collated dtype)
            return None
        fixed.append((name, tuple(ftype.shape or ()), dt))
    if image is None:
        return None
    return RowsFetch(store, names, image, tuple(fixed), transforms[image])


class RowsFetch:
    """:func:`rows_fetcher`'s callable (module docstring)."""

    __slots__ = ("_store", "_names", "_image", "_fixed", "_t", "_c", "_params")

    def __init__(self, store, names: list, image: str, fixed: tuple, t):
        self._store, self._names, self._image, self._fixed, self._t = store, names, image, fixed, t
        self._c, self._params = roi_function("fetch_rows"), (None, None)

    def __getstate__(self):
        return self._store, self._names, self._image, self._fixed, self._t

    def __setstate__(self, state):
        self._store, self._names, self._image, self._fixed, self._t = state
        self._c, self._params = roi_function("fetch_rows"), (None, None)

    def __call__(self, indices) -> dict | None:
        """The collated batch of rows ``indices`` (``{field: tensor}``: fixed fields ``(B,
        *shape)`` of their dtype, the image ``(B, 3, H, W)`` uint8), or ``None`` where the
        general path takes it (module docstring).

        Raises:
            kuat.DecodeError: a sample cannot be decoded (the lowest such one).
            ValueError: a sample's stored size is not positive, or rows that do not fit their
                shards' columns.
        """
        t = self._t
        if type(indices) is not list or not indices or t.exact_resize:
            return None
        store, image = self._store, self._image
        tables = store._tables  # (per field, the C gather's table: read, never written, here)
        b = len(indices)
        h, w = t._output_size
        buf, out = new_batch_array((b, 3, h, w))  # (B, 3, H, W) uint8 tensor and array
        # the batch is made before the decode, which evicts the caches (a torch.from_numpy
        # costs about 45 us after it, 3 us beside another one); inside the loader the tensors
        # come ready-made from its pool (BufferPool.take_array), with no torch call here
        pool = _owned.pool
        batch = dict.fromkeys(self._names)  # the schema's order
        batch[image] = buf
        fixed = []
        for name, shape, dt in self._fixed:
            if pool is not None:
                col_t, col = pool.take_array((b, *shape), dt)  # (B, *shape)
            else:
                col = np.empty((b, *shape), dt)
                col_t = torch.from_numpy(col)
            batch[name] = col_t  # (views the array C fills)
            fixed.append((tables.get(name) or store._native_table(name), col))
        table = tables.get(image) or store._native_table(image)
        mp, params = self._params
        if mp is not t.max_pixels or params is None:  # (the planner's parameters, once)
            mp = t.max_pixels
            self._params = mp, (params := rrc_params(*t._c_plan, mp))
        seed, epoch = current_epoch()
        res = self._c(indices, store.num_rows, store.starts, fixed, table, out, h, w, *params,
                      seed & _MASK64, epoch & _MASK64, _PAR.width)  # (width > 1: in C threads)
        if type(res) is not tuple:  # not taken (None), or a shard to map first (its id)
            return None
        unplanned, failed, wall, cpu, helper_s, helper_cpu = res
        _native.add(wall, cpu)  # kernel seconds for stats()["busy_s"]["native"]
        if helper_s:  # the helpers' decodes (all native), as run_parts counts its parts'
            _parallel.add_helper_times(helper_s, helper_cpu, helper_s, helper_cpu)
        if unplanned or failed:  # (their rows, as the general path's gather has them)
            idx = store.indices(indices)
            sid, local = store._rows(idx, native()[2])
            _rest(t, ImageRows(store, image, table, sid, local, idx), out, unplanned, failed,
                  store.shard_paths)
        return batch
