"""``pad_collate``: batch variable-length sequences by padding them to the longest in the batch.

The usual way (a Python loop that copies each row into a padded tensor) costs a few microseconds
of interpreter work per row and per field. Here the common cases take one NumPy operation per
field and batch:

* **views of one buffer**: a source that gathers a batch in one go (kuat's Hugging Face source
  and kuat datasets) hands each sample a 1-d view of one batch buffer; the rows' positions in
  that buffer give the offsets, and one masked copy fills the ``(B, L)`` result;
* **Arrow tables**: samples that are one-row ``pyarrow.Table`` (a ``datasets.Dataset`` in the
  ``"arrow"`` format), or a whole batch as one table, are padded from the list columns' offsets
  and values;
* **Python lists of numbers** are flattened into one tensor, then padded the same way.

Anything else (separately allocated tensors or arrays, rows of shape ``(L, *F)``) is padded
row by row, with the same result. Outputs are exactly those of the per-row loop:
``torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad_value)``.

The package, one idea per module:

* :mod:`kuat.padding._samples`: :class:`Samples` and :class:`BatchColumn`, what a source that
  gathers a batch at once hands the collate (the batch buffers behind the samples' views);
* :mod:`kuat.padding._rows`: padding rows into ``(B, L, *F)`` (:func:`pad_rows`): the one-op
  paths (views of one buffer, offsets and values), the row-by-row fallback, the pad value's
  dtype check and the width rule;
* :mod:`kuat.padding._collate`: :func:`pad_collate` and the callable it returns, which decides
  per field of a batch (mappings, sequences, Arrow tables) what is padded and what collated.
"""

from kuat.padding._collate import PadCollate, pad_collate
from kuat.padding._rows import pad_rows  # noqa: F401  (public as before, not in __all__)
from kuat.padding._samples import BatchColumn, Samples

__all__ = ["pad_collate", "PadCollate", "Samples", "BatchColumn"]
