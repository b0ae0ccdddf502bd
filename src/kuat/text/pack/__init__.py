"""``kuat.pack``: documents packed on the fly into fixed-length rows, resumable from a small state.

Strategies (what each packs and where it comes from; pure functions over lengths in
``_strategies.py``):

* ``"concat"``: concatenate the documents and cut every ``seq_len`` tokens (torchtitan's and
  Megatron's pretraining packing); a document may continue in the next row. No padding but in
  the last row of the epoch.
* ``"first_fit"``: read ``buffer_size`` documents, put each, in arrival order, into the first
  row with room (greedy first-fit; torchtune's ``PackedDataset`` is the one-open-row variant).
* ``"best_fit"``: best-fit decreasing over the same buffer: longest first, each into the row it
  fills most tightly (TRL's ``pack_dataset(strategy="bfd")``, over a bounded buffer instead of
  the whole table).

In both fit strategies the emptiest row of a buffer is not emitted but carried into the next
buffer (except at the end of the epoch), so padding stays near the bin-packing optimum without
holding more than one buffer. Documents longer than ``seq_len`` are split into ``seq_len`` pieces
or dropped (``too_long=``), counted in :meth:`Packed.stats`.

Each row (Hugging Face's packed-row conventions, as ``DataCollatorWithFlattening`` produces):

* ``input_ids (L,) int64``; padding (only in fit strategies and the last row) is ``pad_id``;
* ``labels (L,) int64``: the document's labels, aligned with ``input_ids`` (the model shifts
  them), ``-100`` at the first token of every document piece (so no token predicts across a
  document boundary), on masked tokens and on padding;
* ``position_ids (L,) int64``: ``0, 1, ...`` restarting at every document piece (and at the
  padding, which is a segment of its own), which is how Hugging Face's flash-attention path finds
  document boundaries;
* ``document_lengths (D,) int32``: the lengths of the row's document pieces, in order (padding
  not included).

Who packs what: with the documents' lengths (a kuat dataset, or ``lengths=``), every consumer
(each rank's each loader worker) computes the same *plan* from the lengths alone and reads and
builds only its own rows: ``concat`` rows are token ranges of the epoch, found by arithmetic;
the fit strategies run the bin choice over every buffer's lengths (no tokens read), once per
process: the thread workers of one loader read one plan, each buffer's bin choice made by the
first worker to need it. Without lengths (iterable sources, other map-style sources) each
consumer reads and packs the whole epoch and keeps its rows.

How rows are built: a group of rows (a buffer's, or a chunk of ``concat`` rows) is one
``(R, L)`` block per field, filled by one gather over the documents' flat tokens (position ids
are ``arange - repeat(segment starts)``, the token index is the piece's start plus that); the
rows are views of these blocks.

Resume: through ``kuat.DataLoader``, its ``kuat_iter_from(epoch, batches_served)`` hook starts
each worker at the first batch not yet served: with a plan this costs the plan up to there
(``concat``: one binary search; fit strategies: the bin choice over the lengths before it),
no reading. On its own, :meth:`Packed.iter_rows` returns an iterator whose ``state_dict()`` is a
handful of integers (``concat``: the document and token offset where the next row starts; fit
strategies: the first document of the current buffer, the ``(document, piece)`` keys of the
carried row, and rows already emitted from the buffer). Resuming from it refetches one buffer
and repacks it: the cost is that of one buffer, independent of the position in the epoch (for
map-style sources; an iterable source is re-read, not repacked, up to the buffer).

Files, from the face down (each imports only those below it):

| module | what it owns |
|---|---|
| ``_api.py`` | ``pack()`` (the arguments checked), ``Packed`` (the stream: which path finds this iteration's rows, the loader's resume hooks ``kuat_state_at`` / ``kuat_iter_from``, pickling and the holders its thread workers' copies share), ``PackIterator`` (one epoch's rows with a resumable state) |
| ``_plan.py`` | who packs what: ``Share`` (a consumer's rows: rank x worker x batches served), the plan from lengths (``concat``: arithmetic; fit: the bin choice per buffer), ``SharedPlan`` (one fit plan per process for a loader's thread workers), the assembly of planned rows (read by ordinal, checked against the lengths) |
| ``_inorder.py`` | rows decided while reading in order: concat-split, and the fit strategies buffer after buffer with the emptiest row carried (``fit_buffers``, which the plan runs over lengths alone) |
| ``_rows.py`` | how rows are built: document pieces in flat token buffers (``Items``), one gather into ``(R, L)`` blocks per field |
| ``_strategies.py`` | the bin-packing strategies as pure functions over lengths: ``ConcatSplit``, ``first_fit``, ``best_fit`` |
| ``_stats.py`` | ``PackStats``, the counters of one pass (``Packed.stats()``) |

The documents themselves (order, shuffle, fetching by ordinal, flat token blocks) are
``kuat/text/_docs.py``.
"""

from kuat.text.pack._api import Packed, PackIterator, pack
from kuat.text.pack._stats import PackStats as PackStats  # (re-exported: was a name here)
from kuat.text.pack._strategies import STRATEGIES

__all__ = ["pack", "Packed", "PackIterator", "STRATEGIES"]
