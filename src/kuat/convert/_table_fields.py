"""A unified Arrow column type -> a kuat field (:func:`arrow_field`), or a refusal naming the
column and saying what to do; and what a Hugging Face ``datasets`` schema adds to the fields
(``ClassLabel`` names, ``Image`` columns: :func:`hf_features_of`, :func:`hf_metadata`).
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from kuat.convert._table_types import is_image_struct, is_list, logical_type
from kuat.format import Field, FieldType
from kuat.format import schema as fs

__all__ = ["arrow_field", "hf_features_of", "hf_metadata"]


def arrow_field(
    name: str, t: pa.DataType, image: bool = False, metadata: dict | None = None
) -> Field:
    """The kuat :class:`Field` for a column of logical Arrow type ``t`` (see
    :func:`logical_type`; physical variants are folded first).

    integers/floats -> the same scalar type, bool -> bool, string -> string, binary -> bytes,
    list of numbers -> ``sequence``, list of strings (also dictionary-encoded) -> ``strings``,
    all-empty lists -> ``sequence[int64]``, fixed-size
    list(s) of numbers -> ``tensor``, ``struct<bytes, path>`` or a column named in
    ``image_fields`` -> image.

    Raises:
        ValueError: the type has no kuat equivalent; the message names the column and says
            what to do.
    """
    t = logical_type(t)
    md = dict(metadata or {})
    if image or is_image_struct(t):
        if pa.types.is_binary(t) or pa.types.is_string(t) or is_image_struct(t):
            return Field(name, fs.image(), md)
        raise ValueError(f"column {name!r} of type {t} cannot hold images (bytes or paths)")
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return Field(name, FieldType("scalar", np.dtype(t.to_pandas_dtype()).name), md)
    if pa.types.is_boolean(t):
        return Field(name, fs.bool_(), md)
    if pa.types.is_string(t):
        return Field(name, fs.string(), md)
    if pa.types.is_binary(t) or pa.types.is_fixed_size_binary(t):
        return Field(name, fs.binary(), md)
    if pa.types.is_null(t):
        raise ValueError(
            f"column {name!r} holds only nulls in the whole input; kuat fields are not "
            "nullable: drop the column or fill it before converting"
        )
    if pa.types.is_fixed_size_list(t):
        shape, inner = [], t
        while pa.types.is_fixed_size_list(inner):
            shape.append(inner.list_size)
            inner = inner.value_type
        if (pa.types.is_integer(inner) or pa.types.is_floating(inner)) and all(shape):
            dtype = np.dtype(inner.to_pandas_dtype()).name
            return Field(name, fs.tensor(tuple(shape), dtype), md)
        if pa.types.is_string(inner) and len(shape) == 1:  # fixed-length lists of strings
            return Field(name, fs.strings(), md)
    if is_list(t):
        inner = t.value_type
        if pa.types.is_null(inner):  # every list in the input is empty
            return Field(name, fs.sequence("int64"), md)
        if pa.types.is_integer(inner) or pa.types.is_floating(inner):
            return Field(name, fs.sequence(np.dtype(inner.to_pandas_dtype()).name), md)
        if pa.types.is_boolean(inner):
            return Field(name, fs.sequence("uint8"), md)
        if pa.types.is_string(inner):
            return Field(name, fs.strings(), md)
        if pa.types.is_binary(inner):
            raise ValueError(
                f"column {name!r} is a list of byte strings ({t}); kuat lists hold numbers or "
                "UTF-8 strings: decode the items to str, or store one bytes value per row"
            )
        if is_list(inner) or pa.types.is_fixed_size_list(inner):
            raise ValueError(
                f"column {name!r} holds nested lists of varying length ({t}); kuat stores a "
                "variable-length 1-D sequence (of numbers or strings) or a fixed-shape "
                "tensor: flatten each row into one list (with a second column of the inner "
                "lengths to split it again), or pad the rows to one shape, before converting"
            )
    raise ValueError(
        f"column {name!r} has Arrow type {t}, which has no kuat field type; cast it to a "
        "number, string, bytes or list of numbers before converting"
    )


def hf_features_of(metadata: dict) -> dict | None:
    """The ``datasets`` features dict from an Arrow schema's ``huggingface`` metadata."""
    raw = metadata.get(b"huggingface") or metadata.get("huggingface")
    if not raw:
        return None
    try:
        info = json.loads(raw)
        features = info.get("info", {}).get("features")
    except (ValueError, AttributeError):
        return None
    return features if isinstance(features, dict) else None


def hf_metadata(feature) -> tuple[dict, bool]:
    """``(field metadata, is image)`` for a ``datasets`` feature given as its dict form:
    ``ClassLabel`` names, also inside ``Sequence``/``List``/``LargeList``."""
    if not isinstance(feature, dict):
        if isinstance(feature, list) and feature:
            return hf_metadata(feature[0])[0], False
        return {}, False
    kind = feature.get("_type")
    if kind == "ClassLabel" and isinstance(feature.get("names"), list):
        return {"names": list(feature["names"])}, False
    if kind == "Image":
        return {}, True
    if kind in ("Sequence", "List", "LargeList"):
        return hf_metadata(feature.get("feature"))[0], False
    return {}, False
