"""Logical field types of a kuat dataset and their Arrow storage.

A :class:`Schema` is an ordered list of :class:`Field` s; each field has a :class:`FieldType`
built with the constructors below (``image()``, ``int64()``, ``tensor((3, 4), "float32")``,
``sequence("int32")``, ...). The mapping to Arrow types is fixed by format version 1 and
spelled out in ``docs/format.md``:

=============  ==============================================================================
logical type   Arrow storage (one column per field, no nulls)
=============  ==============================================================================
image          ``struct<bytes: binary, width: int32, height: int32, codec: string>``
int/uint/float the matching primitive type (``int8`` ... ``uint64``, ``float16/32/64``)
bool           ``bool``
string         ``string`` (UTF-8)
bytes          ``binary``
tensor         ``fixed_size_list<dtype>[prod(shape)]``, row-major, so N rows are contiguous
sequence       ``list<dtype>`` (variable length, e.g. token ids)
strings        ``list<string>`` (a variable-length list of UTF-8 strings, e.g. word tokens)
=============  ==============================================================================

Nested variable-length lists (a list of lists) have no logical type: flatten or pad them.

Image ``width``/``height`` are the size ``kuat.vision.decode.decode_image`` returns, that is
after EXIF orientation (``kuat.vision.probe.probe_image``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pyarrow as pa

__all__ = [
    "EncodedImage",
    "FieldType",
    "Field",
    "Schema",
    "image",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "bool_",
    "string",
    "binary",
    "tensor",
    "sequence",
    "strings",
]

_INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
_FLOAT_DTYPES = ("float16", "float32", "float64")
NUMERIC_DTYPES = _INT_DTYPES + _FLOAT_DTYPES
_SIMPLE_KINDS = ("image", "bool", "string", "bytes", "strings")
# fixed-size list lengths and shard offsets are int32 in Arrow
_MAX_ELEMENTS = 2**31 - 1

IMAGE_STRUCT = pa.struct(
    [
        pa.field("bytes", pa.binary(), nullable=False),
        pa.field("width", pa.int32(), nullable=False),
        pa.field("height", pa.int32(), nullable=False),
        pa.field("codec", pa.string(), nullable=False),
    ]
)


class EncodedImage(NamedTuple):
    """An image as stored: encoded bytes plus its oriented size and codec.

    ``width``/``height`` are in pixels after EXIF orientation (what ``decode_image`` returns);
    ``codec`` is the lower-case Pillow format name (``"jpeg"``, ``"png"``, ...). ``data`` is
    ``bytes`` or a zero-copy ``memoryview`` into a memory-mapped shard.
    """

    data: bytes | memoryview
    width: int
    height: int
    codec: str


def _arrow_primitive(dtype: str) -> pa.DataType:
    return pa.from_numpy_dtype(np.dtype(dtype))


@dataclass(frozen=True)
class FieldType:
    """The logical type of a field.

    Attributes:
        kind: ``"image"``, ``"scalar"`` (a number of ``dtype``), ``"bool"``, ``"string"``,
            ``"bytes"``, ``"tensor"`` (fixed ``shape`` and ``dtype``), ``"sequence"``
            (variable-length 1-D of ``dtype``) or ``"strings"`` (a variable-length list of
            strings).
        dtype: NumPy dtype name for ``scalar``, ``tensor`` and ``sequence``, else ``None``.
        shape: the per-row shape of a ``tensor``, else ``None``.
    """

    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.kind in _SIMPLE_KINDS:
            if self.dtype is not None or self.shape is not None:
                raise ValueError(f"a {self.kind} field takes no dtype or shape, got {self}")
        elif self.kind in ("scalar", "sequence"):
            if self.dtype not in NUMERIC_DTYPES:
                raise ValueError(
                    f"{self.kind} dtype={self.dtype!r} is not one of {', '.join(NUMERIC_DTYPES)}"
                )
            if self.shape is not None:
                raise ValueError(f"a {self.kind} field takes no shape, got shape={self.shape!r}")
        elif self.kind == "tensor":
            if self.dtype not in NUMERIC_DTYPES:
                raise ValueError(
                    f"tensor dtype={self.dtype!r} is not one of {', '.join(NUMERIC_DTYPES)} "
                    "(store booleans as uint8)"
                )
            shape = self.shape
            if (
                not isinstance(shape, tuple)
                or not shape
                or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
                or not all(1 <= d <= _MAX_ELEMENTS for d in shape)
                or math.prod(shape) > _MAX_ELEMENTS
            ):
                raise ValueError(
                    f"tensor shape={shape!r} must be a non-empty tuple of positive ints with "
                    f"at most {_MAX_ELEMENTS} elements"
                )
        else:
            raise ValueError(f"unknown field kind {self.kind!r}")

    # -- derived properties -------------------------------------------------------------
    @property
    def numel(self) -> int:
        """Elements per row of a tensor (1 for scalars)."""
        return math.prod(self.shape) if self.shape else 1

    @property
    def np_dtype(self) -> np.dtype | None:
        return None if self.dtype is None else np.dtype(self.dtype)

    @property
    def arrow_type(self) -> pa.DataType:
        """The Arrow type this logical type is stored as (format version 1)."""
        if self.kind == "image":
            return IMAGE_STRUCT
        if self.kind == "bool":
            return pa.bool_()
        if self.kind == "string":
            return pa.string()
        if self.kind == "bytes":
            return pa.binary()
        if self.kind == "strings":
            return pa.list_(pa.field("item", pa.string(), nullable=False))
        prim = _arrow_primitive(self.dtype)
        if self.kind == "scalar":
            return prim
        if self.kind == "tensor":
            return pa.list_(pa.field("item", prim, nullable=False), self.numel)
        return pa.list_(pa.field("item", prim, nullable=False))

    @property
    def fixed_row_bytes(self) -> int:
        """Bytes per row of the fixed-size part of this type (for shard sizing)."""
        if self.kind == "scalar":
            return self.np_dtype.itemsize
        if self.kind == "tensor":
            return self.np_dtype.itemsize * self.numel
        if self.kind == "bool":
            return 1
        if self.kind == "image":
            return 4 + 4 + 4 + 4 + 4 + 8  # offsets, width, height, codec offsets + name
        return 4  # offsets of string/bytes/sequence/strings

    def describe(self) -> str:
        """Short human-readable name, e.g. ``tensor[3x4, uint8]``."""
        if self.kind == "scalar":
            return self.dtype
        if self.kind == "tensor":
            return f"tensor[{'x'.join(map(str, self.shape))}, {self.dtype}]"
        if self.kind == "sequence":
            return f"sequence[{self.dtype}]"
        if self.kind == "strings":
            return "sequence[string]"
        return self.kind

    def to_json(self) -> dict:
        if self.kind == "scalar":
            return {"type": self.dtype}
        out = {"type": self.kind}
        if self.dtype is not None:
            out["dtype"] = self.dtype
        if self.shape is not None:
            out["shape"] = list(self.shape)
        return out

    @classmethod
    def from_json(cls, obj: Mapping) -> FieldType:
        """Parse ``to_json`` output. Raises ``ValueError``/``TypeError`` on anything else."""
        if not isinstance(obj, Mapping):
            raise TypeError(f"a field type must be a JSON object, got {type(obj).__name__}")
        kind = obj.get("type")
        if not isinstance(kind, str):
            raise TypeError(f"field 'type' must be a string, got {kind!r}")
        if kind in NUMERIC_DTYPES:
            return cls("scalar", kind)
        dtype = obj.get("dtype")
        shape = obj.get("shape")
        if shape is not None:
            if not isinstance(shape, list):
                raise TypeError(f"field 'shape' must be a list, got {shape!r}")
            shape = tuple(shape)
        return cls(kind, dtype, shape)

    def __repr__(self) -> str:
        return f"FieldType({self.describe()})"


@dataclass(frozen=True)
class Field:
    """A named field of a :class:`Schema`.

    Attributes:
        name: the key of this field in every sample dict.
        type: its :class:`FieldType`.
        metadata: JSON-serialisable extras kept in the manifest, e.g. ``{"names": [...]}``
            for class labels (ImageFolder and Hugging Face ``ClassLabel``).
    """

    name: str
    type: FieldType
    metadata: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a field name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.type, FieldType):
            raise TypeError(
                f"field {self.name!r}: type must be a FieldType (e.g. kuat.format.int64()), "
                f"got {type(self.type).__name__}"
            )
        if not isinstance(self.metadata, dict):
            raise TypeError(f"field {self.name!r}: metadata must be a dict")

    def to_json(self) -> dict:
        out = {"name": self.name, **self.type.to_json()}
        if self.metadata:
            out["metadata"] = self.metadata
        return out


class Schema:
    """The ordered fields of a kuat dataset.

    Build it from a mapping ``{name: FieldType}`` or a sequence of :class:`Field`::

        Schema({"image": image(), "label": int64(), "emb": tensor((512,), "float16")})

    Immutable; equality compares names and types in order (not metadata).
    """

    __slots__ = ("_fields", "_by_name")

    def __init__(self, fields: Mapping[str, FieldType] | Iterable[Field]):
        if isinstance(fields, Schema):
            items = list(fields.fields)
        elif isinstance(fields, Mapping):
            items = [Field(name, ftype) for name, ftype in fields.items()]
        else:
            items = list(fields)
            for f in items:
                if not isinstance(f, Field):
                    raise TypeError(f"Schema takes Field objects, got {type(f).__name__}")
        if not items:
            raise ValueError("a schema needs at least one field")
        by_name = {}
        for f in items:
            if f.name in by_name:
                raise ValueError(f"duplicate field name {f.name!r} in schema")
            by_name[f.name] = f
        self._fields = tuple(items)
        self._by_name = by_name

    @property
    def fields(self) -> tuple[Field, ...]:
        return self._fields

    @property
    def names(self) -> list[str]:
        return [f.name for f in self._fields]

    def __getitem__(self, name: str) -> Field:
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self):
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schema):
            return NotImplemented
        return [(f.name, f.type) for f in self] == [(f.name, f.type) for f in other]

    def __hash__(self) -> int:
        return hash(tuple((f.name, f.type) for f in self))

    def __repr__(self) -> str:
        body = ", ".join(f"{f.name}: {f.type.describe()}" for f in self)
        return f"Schema({body})"

    def difference(self, other: Schema) -> str | None:
        """Why ``other`` differs from this schema (naming the field), or ``None`` if equal."""
        for a, b in zip(self, other):
            if a.name != b.name:
                return f"field {a.name!r} vs {b.name!r} at the same position"
            if a.type != b.type:
                return f"field {a.name!r} is {a.type.describe()} vs {b.type.describe()}"
        if len(self) != len(other):
            longer, shorter = (self, other) if len(self) > len(other) else (other, self)
            extra = longer.fields[len(shorter)].name
            return f"field {extra!r} is present in only one schema"
        return None

    def to_arrow(self) -> pa.Schema:
        """The Arrow schema of a shard (format version 1)."""
        return pa.schema([pa.field(f.name, f.type.arrow_type, nullable=False) for f in self])

    def to_json(self) -> dict:
        return {"fields": [f.to_json() for f in self]}

    @classmethod
    def from_json(cls, obj: Mapping) -> Schema:
        """Parse ``to_json`` output. Raises ``ValueError``/``TypeError`` on anything else."""
        if not isinstance(obj, Mapping) or not isinstance(obj.get("fields"), list):
            raise TypeError("schema must be an object with a 'fields' list")
        fields = []
        for f in obj["fields"]:
            if not isinstance(f, Mapping):
                raise TypeError(f"schema field must be an object, got {f!r}")
            metadata = f.get("metadata", {})
            if not isinstance(metadata, Mapping):
                raise TypeError(
                    f"field {f.get('name')!r}: 'metadata' must be an object, got "
                    f"{type(metadata).__name__}"
                )
            fields.append(Field(f.get("name"), FieldType.from_json(f), dict(metadata)))
        return cls(fields)


# -- constructors -------------------------------------------------------------------------
def image() -> FieldType:
    """An encoded image (JPEG, PNG, WebP, ...) with its oriented width/height and codec."""
    return FieldType("image")


def int8() -> FieldType:
    return FieldType("scalar", "int8")


def int16() -> FieldType:
    return FieldType("scalar", "int16")


def int32() -> FieldType:
    return FieldType("scalar", "int32")


def int64() -> FieldType:
    return FieldType("scalar", "int64")


def uint8() -> FieldType:
    return FieldType("scalar", "uint8")


def uint16() -> FieldType:
    return FieldType("scalar", "uint16")


def uint32() -> FieldType:
    return FieldType("scalar", "uint32")


def uint64() -> FieldType:
    return FieldType("scalar", "uint64")


def float16() -> FieldType:
    return FieldType("scalar", "float16")


def float32() -> FieldType:
    return FieldType("scalar", "float32")


def float64() -> FieldType:
    return FieldType("scalar", "float64")


def bool_() -> FieldType:
    return FieldType("bool")


def string() -> FieldType:
    """A UTF-8 string."""
    return FieldType("string")


def binary() -> FieldType:
    """Opaque bytes."""
    return FieldType("bytes")


def tensor(shape: Iterable[int], dtype: str | np.dtype = "float32") -> FieldType:
    """A fixed-shape array per row, e.g. ``tensor((3, 32, 32), "uint8")``.

    Rows are stored contiguously, so a batch of N rows is gathered with one copy into a
    ``(N, *shape)`` array.
    """
    if isinstance(shape, int):
        shape = (shape,)
    return FieldType("tensor", np.dtype(dtype).name, tuple(int(d) for d in shape))


def sequence(dtype: str | np.dtype = "int64") -> FieldType:
    """A variable-length 1-D array per row (token ids, for example)."""
    return FieldType("sequence", np.dtype(dtype).name)


def strings() -> FieldType:
    """A variable-length list of UTF-8 strings per row (word tokens, tags, ...): what
    ``datasets`` calls ``Sequence(Value("string"))``.

    A sample holds a ``list[str]``; a batch of them collates as torch's ``default_collate``
    collates lists of strings (transposed into ``L`` tuples of ``B`` strings, equal lengths
    required).
    """
    return FieldType("strings")
