"""Parquet, JSON (Lines or arrays) and CSV/TSV files -> kuat dataset, read with pyarrow.

Column types are inferred over the **whole input** (every block of every file; see
:mod:`kuat.convert._table`): an integer column that holds ``2.5`` at row 150,000 becomes
float64, a column that is null in one file takes its type from the others, and a real
conflict (a string in a number column) is a ``SchemaError`` naming the column, file and row.
Types then map to kuat fields (:func:`arrow_field`): integers/floats -> the same scalar type,
bool -> bool, strings (also ``large_string``, ``string_view`` and dictionary-encoded columns
such as pandas ``Categorical``, whose categories go to the field's ``metadata["categories"]``)
-> string, binary -> bytes, lists of numbers -> sequence, fixed-size lists -> tensor,
``struct<bytes, path>`` (Hugging Face ``Image``) -> image. Columns named in ``image_fields``
become images: binary columns hold encoded bytes, string columns file paths (relative paths
resolve against the directory of the file that names them).

A Parquet file written by ``datasets`` keeps its features in the schema's ``huggingface``
metadata: ``ClassLabel`` names (also inside ``Sequence``) go to the field's
``metadata["names"]``, ``Image`` columns become images, and the manifest keeps the features
(``metadata["hf_features"]``), as ``datasets.load_dataset("parquet")`` restores them.

Reading: any valid file reads, whatever its record sizes. JSON Lines is parsed in blocks of
whole lines (a record longer than a block extends its block); a ``.json`` file whose first
character is ``[`` is a JSON array of records (what ``datasets.load_dataset("json")`` reads);
CSV blocks grow until the longest record fits, quoted values may hold newlines, and a CSV
file whose types change after its first block is read whole once to infer them. Types come
first (a Parquet file's from its schema; JSON and CSV files are parsed, and the parsed
batches are kept for the conversion up to 256 MiB, beyond which they are parsed again).

Several files (a list, or a glob such as ``"data/*.parquet"``) are read in sorted order and
must have the same columns (JSON records may omit keys: a missing key is a null).
Nulls, top-level or inside lists, follow kuat's null rule: a ``SchemaError`` naming the
column, file and row, or the row is skipped with ``on_error="skip"``.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence

from kuat.convert._driver import ConvertOptions, ConvertReport, converting, refuse_not_utf8
from kuat.convert._inputs import expand_paths, local_copies, local_copy, named_as_given
from kuat.convert._table import write_batches
from kuat.convert._table_fields import arrow_field, hf_features_of, hf_metadata
from kuat.convert._table_types import TypeUnifier
from kuat.convert._tabular_files import CSV_BLOCK, KEEP_BYTES, TableFiles
from kuat.errors import KuatError
from kuat.format import Schema

__all__ = ["from_parquet", "from_jsonl", "from_csv", "arrow_field", "expand_paths"]


def _from_tables(
    kind: str,
    paths,
    dst,
    *,
    image_fields: Sequence[str],
    batch_size: int,
    opts: ConvertOptions,
    delimiter: str | None = None,
) -> ConvertReport:
    files = expand_paths(paths, opts.storage_options)
    for f in files:  # pyarrow opens files by UTF-8 path, and their names go into the metadata
        refuse_not_utf8(f, "the input file")
    if opts.engine == "ray":
        return _convert_files_on_ray(kind, files, dst, image_fields, batch_size, opts, delimiter)
    with local_copies(files, opts.storage_options) as local:
        try:
            return _convert_files(
                kind, files, local, dst, image_fields, batch_size, opts, delimiter
            )
        except (KuatError, ValueError) as e:
            named = named_as_given(e, {c: f for c, f in zip(local, files) if c != f})
            if named is None:
                raise
            raise named from e


def _convert_files(kind, files, local, dst, image_fields, batch_size, opts, delimiter):
    """``files`` as named by the user; ``local``: the same, URLs downloaded to local copies
    (each is parsed twice: type inference, then conversion). Image paths in a table are
    resolved next to the local file."""
    src = TableFiles(kind, local, batch_size, delimiter)
    unifier = src.infer()
    fields, metadata = _plan(kind, files, unifier, src.schema_metadata(local[0]), image_fields)
    with converting(dst, Schema([f for f, _ in fields]), opts, metadata) as (w, report):
        write_batches(w, fields, src.table_batches(), opts, report, desc=f"convert {kind}")
    return report


def _plan(kind, files, unifier: TypeUnifier, first_metadata: dict, image_fields):
    """The kuat fields ``[(Field, arrow type)]`` and the dataset metadata of a conversion,
    from the unified column types (both engines)."""
    if not unifier.types:
        raise ValueError(f"{files[0]} holds no rows (cannot infer the columns)")
    unknown = [n for n in image_fields if n not in unifier.types]
    if unknown:
        raise ValueError(
            f"image field {unknown[0]!r} is not a column of {files[0]} ({list(unifier.types)})"
        )
    hf_features = hf_features_of(first_metadata)
    fields = []
    for name, t in unifier.types.items():
        md, is_image = hf_metadata((hf_features or {}).get(name))
        if name in unifier.categories:
            md["categories"] = unifier.categories[name]
        try:
            f = arrow_field(name, t, is_image or name in image_fields, md)
        except ValueError as e:
            raise ValueError(f"{e} (in {', '.join(files)})") from e
        fields.append((f, t))
    metadata = {"source": kind, "files": [os.path.basename(f) for f in files]}
    if hf_features is not None:
        metadata["hf_features"] = hf_features
    return fields, metadata


def _convert_files_on_ray(kind, files, dst, image_fields, batch_size, opts, delimiter):
    """The Ray engine: one task per input file infers its column types (the driver reads no
    rows; it unifies the files' types in file order, as the local engine does over the
    whole input), then one task per file converts it."""
    from kuat.convert._ray import map_on_ray, ray_session
    from kuat.convert._ray_convert import convert_on_ray

    with ray_session():  # one Ray instance for both passes
        plan = TableFiles(kind, files, batch_size, delimiter)
        found = map_on_ray(_infer_task, files, opts, fn_kwargs={"plan": plan, "opts": opts})
        unifier, first_names = TypeUnifier(), None
        for path, (types, names, block, _) in zip(files, found):
            unifier.update(types)  # a conflict between files names both (file and row)
            first_names = plan.check_columns(path, names, first_names)
            if block is not None:
                plan.csv_block[path] = block
        plan.types = dict(unifier.types)
        fields, metadata = _plan(kind, files, unifier, found[0][3], image_fields)

        def write_part(w, path: str, part_opts: ConvertOptions, report: ConvertReport) -> None:
            with local_copy(path, part_opts.storage_options) as local:
                one = copy.copy(plan)
                one.files, one.kept, one.kept_bytes = [local], {}, 0
                one.csv_block = {local: plan.csv_block.get(path, CSV_BLOCK)}
                write_batches(
                    w, fields, one.table_batches(), part_opts, report, desc=f"convert {kind}"
                )

        schema = Schema([f for f, _ in fields])
        return convert_on_ray(dst, schema, metadata, opts, files, write_part, _path_of_part)


def _path_of_part(path: str) -> list[str]:
    """The one input file of a Ray part (its size and time go into its fingerprint)."""
    return [path]


def _infer_task(path: str, k: int, payload: bytes, *, plan: TableFiles, opts: ConvertOptions):
    """Ray task: pass 1 over one file -> ``(its TypeUnifier, its column names, its CSV block
    size or None, the first file's schema metadata)``."""
    with local_copy(path, opts.storage_options) as local:
        one = copy.copy(plan)
        # kept_bytes past the budget: pass 1 keeps no batches in memory (pass 2 is another task)
        one.files, one.kept, one.kept_bytes, one.csv_block = [local], {}, KEEP_BYTES + 1, {}
        u = TypeUnifier()
        names = one.infer_file(local, u)
        for name in list(u.seen_at):  # name the file as the user did, not its local copy
            u.seen_at[name] = u.seen_at[name].replace(local, path, 1)
        return u, names, one.csv_block.get(local), one.schema_metadata(local) if k == 0 else {}


def _opts(kw: dict) -> ConvertOptions:
    return ConvertOptions(**kw)


_DOC_ARGS = """
    Args:
        paths: a file, a glob, or a list of either.
        dst: the dataset directory to write.
        image_fields: columns holding images (bytes, or file paths relative to the file's
            directory); ``struct<bytes, path>`` columns are images without being named.
        batch_size: rows per Arrow record batch read.
        options: ``num_workers``, ``progress``, ``progress_interval_s``, ``overwrite``,
            ``on_error``, ``resize_shorter``, ``quality``, ``decode_check``,
            ``shard_bytes``, ``engine`` (``"ray"``: one Ray task per input file, the same
            rows in the same order): see :class:`kuat.convert.ConvertOptions`.

    Returns:
        a :class:`kuat.convert.ConvertReport`.

    Raises:
        FileNotFoundError: no input file.
        ValueError: a column type has no kuat equivalent (names the column).
        kuat.FormatError: a file that does not parse as its format (names the file).
        kuat.SchemaError: a null value (names column, file and row; skipped with
            ``on_error="skip"``), a column whose types conflict, or files whose columns differ.
        kuat.DecodeError: an unreadable image with ``on_error="raise"``.
"""


def from_parquet(
    paths,
    dst,
    *,
    image_fields: Sequence[str] = (),
    batch_size: int = 1024,
    **options,
) -> ConvertReport:
    return _from_tables(
        "parquet", paths, dst, image_fields=image_fields, batch_size=batch_size, opts=_opts(options)
    )


def from_jsonl(
    paths,
    dst,
    *,
    image_fields: Sequence[str] = (),
    batch_size: int = 1024,
    **options,
) -> ConvertReport:
    return _from_tables(
        "jsonl", paths, dst, image_fields=image_fields, batch_size=batch_size, opts=_opts(options)
    )


def from_csv(
    paths,
    dst,
    *,
    image_fields: Sequence[str] = (),
    batch_size: int = 1024,
    delimiter: str | None = None,
    **options,
) -> ConvertReport:
    if delimiter is not None and (not isinstance(delimiter, str) or len(delimiter) != 1):
        raise ValueError(f"delimiter={delimiter!r} must be one character, e.g. ',' or '\\t'")
    return _from_tables(
        "csv",
        paths,
        dst,
        image_fields=image_fields,
        batch_size=batch_size,
        opts=_opts(options),
        delimiter=delimiter,
    )


from_parquet.__doc__ = "Convert Parquet file(s) into a kuat dataset." + _DOC_ARGS
from_jsonl.__doc__ = (
    "Convert JSON file(s) into a kuat dataset: JSON Lines (one object per line), or a JSON "
    "array of objects (detected by content)." + _DOC_ARGS
)
from_csv.__doc__ = (
    "Convert CSV file(s) (header row, types inferred over the whole input) into a kuat "
    "dataset.\n\n    ``delimiter``: the field separator (one character); ``None`` (default): "
    "a tab for ``.tsv``/``.tab`` files, else a comma." + _DOC_ARGS
)
