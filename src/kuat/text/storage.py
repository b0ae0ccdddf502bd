"""Bytes a kuat dataset spends per stored token, split into what each part costs.

A token-sequence field is an Arrow ``list<uint16>`` (or ``uint8`` / ``uint32``, see
:func:`kuat.text.tokenize.token_dtype`) column: the tokens end to end (``itemsize`` bytes
each), plus one int32 offset per row and one more per shard (``large_list``: int64). The rest
of a shard file is Arrow IPC framing (schema and record-batch messages, 8-byte padding) and
the other columns. For comparison, per document: nanoGPT's ``train.bin`` stores no index (a
flat ``uint16`` array, documents separated only by their end-of-text token); Megatron's
indexed dataset stores in its ``.idx`` an int32 length and an int64 byte pointer per sequence
and an int64 document index per document (20 bytes per one-sequence document), beside the
``uint16`` tokens of its ``.bin`` (``megatron/core/datasets/indexed_dataset.py``,
``_IndexWriter.write``).
"""

from __future__ import annotations

import os

__all__ = ["MEGATRON_INDEX_BYTES_PER_DOCUMENT", "token_storage"]

# Megatron-LM's .idx per document of one sequence: sequence_lengths int32 + sequence_pointers
# int64 + document_indices int64 (plus a 34-byte header and one sentinel document index)
MEGATRON_INDEX_BYTES_PER_DOCUMENT = 4 + 8 + 8


def token_storage(path: str | os.PathLike, field: str = "input_ids") -> dict:
    """What the local kuat dataset at ``path`` stores for its token field ``field``.

    Returns a dict of integers (bytes and counts, summed over the shards): ``documents``
    (rows), ``tokens``, ``shards``, ``token_bytes`` (the token values: ``tokens * itemsize``),
    ``index_bytes`` (the field's list offsets, ``rows + 1`` per shard, and its validity bitmap
    if it has one), ``file_bytes`` (every shard file, as on disk; the manifest not included)
    and ``other_bytes`` (``file_bytes`` minus the two parts: framing and other columns). Reads
    the shards' Arrow metadata through a memory map (no token is copied).

    Raises:
        kuat.format.FormatError: no valid manifest at ``path``.
        ValueError: ``path`` is a URL (only local datasets are measured), or ``field`` is not
            a token-sequence field of the dataset (names the fields it has).
    """
    import numpy as np
    import pyarrow as pa

    from kuat.format.fs import is_url
    from kuat.format.manifest import member_path, read_manifest

    if is_url(path):
        raise ValueError(f"token_storage measures local datasets, got the URL {path}")
    manifest = read_manifest(path)
    ftype = manifest.schema[field].type if field in manifest.schema else None
    if ftype is None or ftype.kind != "sequence":
        names = [f.name for f in manifest.schema if f.type.kind == "sequence"]
        raise ValueError(f"{field!r} is not a token-sequence field of {path} (those: {names})")
    itemsize = np.dtype(ftype.np_dtype).itemsize
    out = dict.fromkeys(("documents", "tokens", "token_bytes", "index_bytes", "file_bytes"), 0)
    out["shards"] = len(manifest.shards)
    for info in manifest.shards:
        file = member_path(path, info.file)
        out["file_bytes"] += os.path.getsize(file)
        with pa.memory_map(file) as source:
            for batch in pa.ipc.open_stream(source):
                col = batch.column(field)
                offsets = 8 if pa.types.is_large_list(col.type) else 4
                out["documents"] += len(col)
                out["tokens"] += len(col.values)
                out["token_bytes"] += len(col.values) * itemsize
                out["index_bytes"] += (len(col) + 1) * offsets
                if col.buffers()[0] is not None:  # a validity bitmap (nulls allowed)
                    out["index_bytes"] += col.buffers()[0].size
    out["other_bytes"] = out["file_bytes"] - out["token_bytes"] - out["index_bytes"]
    return out
