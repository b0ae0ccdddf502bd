"""Arrow IPC messages of a shard, checked before pyarrow allocates anything for them.

pyarrow decompresses LZ4/ZSTD record-batch bodies into buffers of the size the file states,
so a crafted shard of a few KiB could ask for terabytes (a decompression bomb), and a
dictionary batch could be replaced mid-stream. kuat writes neither (``docs/format.md``,
section 3: uncompressed buffers, no dictionaries), so :func:`check_messages` refuses both by
reading each message's flatbuffer header (zero-copy; nothing is decompressed) before the
batches are read.
"""

from __future__ import annotations

import struct

import pyarrow as pa

from kuat.errors import FormatError

__all__ = ["check_messages"]

# Flatbuffer field ids (arrow/format/Message.fbs): Message.header is field 2; RecordBatch's
# compression (a BodyCompression table) is field 3.
_MESSAGE_HEADER = 2
_RECORD_BATCH_COMPRESSION = 3


def _read(fmt: str, buf: bytes, pos: int) -> int:
    if pos < 0 or pos + struct.calcsize(fmt) > len(buf):
        raise ValueError(f"flatbuffer offset {pos} outside its {len(buf)}-byte message header")
    return struct.unpack_from(fmt, buf, pos)[0]


def _field(buf: bytes, table: int, field_id: int) -> int:
    """Absolute position of a flatbuffer table's field, or 0 when the field is absent."""
    vtable = table - _read("<i", buf, table)
    vtable_size = _read("<H", buf, vtable)
    slot = 4 + 2 * field_id
    if slot + 2 > vtable_size:
        return 0
    offset = _read("<H", buf, vtable + slot)
    return table + offset if offset else 0


def _is_compressed(header: bytes) -> bool:
    root = _read("<I", header, 0)
    pos = _field(header, root, _MESSAGE_HEADER)
    if not pos:
        raise ValueError("the record batch message has no header")
    batch = pos + _read("<I", header, pos)
    return _field(header, batch, _RECORD_BATCH_COMPRESSION) != 0


def check_messages(stream: pa.Buffer, path: str) -> None:
    """Refuse an IPC stream that holds anything but one schema and uncompressed record batches.

    Args:
        stream: the IPC stream's bytes (a zero-copy slice of the memory-mapped shard).
        path: the shard path, for errors.

    Raises:
        kuat.FormatError: a compressed record batch, a dictionary batch, or an unreadable
            message (names ``path`` and the message index).

    Thread-safety: safe (reads ``stream`` only).
    """
    try:
        for i, message in enumerate(pa.ipc.MessageReader.open_stream(stream)):
            kind = message.type
            if kind == "schema" and i == 0:
                continue
            if kind != "record batch":
                raise FormatError(
                    f"shard {path}: IPC message {i} is a {kind} message; a kuat shard holds one "
                    "schema and record batches only",
                    path=path,
                )
            if _is_compressed(message.metadata.to_pybytes()):
                raise FormatError(
                    f"shard {path}: record batch (IPC message {i}) has compressed buffers; kuat "
                    "shards are uncompressed (a compressed body states its own decompressed "
                    "size, which kuat does not trust)",
                    path=path,
                )
    except (pa.ArrowException, OSError, ValueError) as e:
        raise FormatError(f"shard {path} is not a readable Arrow IPC stream: {e}", path=path) from e
