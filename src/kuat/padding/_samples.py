"""The batch behind a list of samples: :class:`Samples` carries, per field, the
:class:`BatchColumn` (one buffer, and offsets for sequences) that the samples' values are views
of, so that :func:`kuat.pad_collate` pads or collates the field in one operation instead of
touching each sample. Sources that gather a batch at once (kuat's Hugging Face source) return it.
"""

from __future__ import annotations

__all__ = ["BatchColumn", "Samples"]


class BatchColumn:
    """The batch-level data behind one field of a :class:`Samples` list.

    Attributes:
        values: ``(N,)`` tensor or NumPy array every sample's value is a view of.
        offsets: ``(B + 1,) int64`` NumPy array for a sequence field (sample ``i`` is
            ``values[offsets[i]:offsets[i + 1]]``), or ``None`` for a scalar field (sample ``i``
            is ``values[i]``, and ``N == B``).
        rows: the B per-sample objects handed out (checked by identity before use).
    """

    __slots__ = ("values", "offsets", "rows")

    def __init__(self, values, offsets, rows):
        self.values, self.offsets, self.rows = values, offsets, rows


class Samples(list):
    """A list of per-sample dicts (the ``__getitems__`` contract) that also carries, in
    ``kuat_columns`` (``{field: BatchColumn}``), the batch columns the samples' values are views
    of. :func:`pad_collate` then pads or collates those fields without touching each sample
    (after checking by identity that the samples still hold those views). Sources that gather a
    batch at once (kuat's Hugging Face source) return it; any other collate sees a plain list.
    """

    def __init__(self, samples=(), columns=None):
        super().__init__(samples)
        self.kuat_columns = columns or {}
