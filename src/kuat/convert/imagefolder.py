"""ImageFolder tree (``root/<class>/**/<image>``) -> kuat dataset ``{image, label}``.

Classes and sample order match ``torchvision.datasets.ImageFolder``: class folders sorted by
name give ``class_to_idx``; within a class, ``os.walk`` (following links) with directories and
file names sorted; files are kept by extension (torchvision's ``IMG_EXTENSIONS``, any case).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kuat.convert._driver import (
    CHUNK_ITEMS,
    ConvertOptions,
    ConvertReport,
    converting,
    parallel_map,
    prepare_image,
    refuse_not_utf8,
)
from kuat.format import Field, Schema, image, int64, string

__all__ = ["IMG_EXTENSIONS", "find_classes", "list_imagefolder", "from_imagefolder"]

log = logging.getLogger("kuat.convert.imagefolder")

# torchvision.datasets.folder.IMG_EXTENSIONS
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def find_classes(root: str | os.PathLike) -> tuple[list[str], dict[str, int]]:
    """Sorted class folder names and ``class_to_idx`` (as torchvision's ``find_classes``).

    Raises:
        FileNotFoundError: ``root`` has no class folders.
    """
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not classes:
        raise FileNotFoundError(f"no class folders found in {root} (expected root/<class>/<image>)")
    return classes, {c: i for i, c in enumerate(classes)}


def list_imagefolder(root: str | os.PathLike) -> tuple[list[tuple[str, int]], list[str]]:
    """``[(path, class index)]`` in torchvision's order, and the class names."""
    root = os.fspath(root)
    classes, class_to_idx = find_classes(root)
    samples = []
    for c in classes:
        target = os.path.join(root, c)
        for dirpath, _, fnames in sorted(os.walk(target, followlinks=True)):
            for fname in sorted(fnames):
                if fname.lower().endswith(IMG_EXTENSIONS):
                    samples.append((os.path.join(dirpath, fname), class_to_idx[c]))
    return samples, classes


def from_imagefolder(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    include_path: bool = False,
    **options,
) -> ConvertReport:
    """Convert an ImageFolder tree into a kuat dataset at ``dst``.

    Fields: ``image`` (original bytes unless ``resize_shorter``), ``label`` (int64, index into
    the sorted class names) and, with ``include_path``, ``path`` (string, relative to ``src``).
    The manifest metadata holds ``classes`` and ``class_to_idx``; the ``label`` field's
    metadata holds ``names``.

    Args:
        options: ``num_workers`` (threads reading and probing images; default one per core),
            ``progress``, ``progress_interval_s``, ``on_error`` (``"raise"``, default: the
            error names the file; or ``"skip"``), ``resize_shorter``, ``quality``,
            ``decode_check``, ``shard_bytes``, ``overwrite``, ``engine`` (``"ray"``: on a
            Ray cluster, the same rows in the same order), ``rows_per_task``: see
            :class:`kuat.convert.ConvertOptions`.

    Returns:
        a :class:`kuat.convert.ConvertReport` (rows written, skipped files, seconds).

    ``src`` may be ``bytes`` (Linux paths that are not UTF-8). Image file names need not be
    UTF-8, but the names kuat stores must be: a class folder (and, with ``include_path``, an
    image path) that is not is refused before anything is written, naming its bytes.

    Raises:
        FileNotFoundError: ``src`` has no class folders, or they hold no images.
        ValueError: ``dst`` is inside ``src`` (it would become a class); a class folder (or,
            with ``include_path``, an image path) whose name is not valid UTF-8.
        FileExistsError: ``dst`` is a dataset and ``overwrite`` is False.
        kuat.DecodeError: an image is unreadable and ``on_error="raise"``.
    """
    opts = ConvertOptions(**options)
    src = Path(os.fsdecode(src))  # bytes paths too (os.fsdecode: surrogateescape)
    if Path(os.fsdecode(dst)).resolve().is_relative_to(src.resolve()):
        raise ValueError(f"dst={str(dst)!r} is inside the ImageFolder src={str(src)!r}")
    samples, classes = list_imagefolder(src)
    if not samples:
        raise FileNotFoundError(
            f"no images in the class folders of {src} ({', '.join(classes[:5])}"
            f"{', ...' if len(classes) > 5 else ''}); an ImageFolder reads files ending in "
            f"{', '.join(IMG_EXTENSIONS)} (any case)"
        )
    empty = sorted(set(classes) - {classes[label] for _, label in samples})
    if empty:
        log.warning(
            "%d class folder(s) of %s hold no images: %s (their labels have no samples)",
            len(empty),
            src,
            ", ".join(empty),
        )
    # names kuat stores (class names; relative paths with include_path) must be UTF-8 text:
    # refused here, naming the path, before anything is written. Other file names are not
    # stored and need not be.
    for c in classes:
        refuse_not_utf8(os.path.join(src, c), "the class folder")
    if include_path:
        for path, _ in samples:
            refuse_not_utf8(path, "the image file (include_path=True stores its path)")
    fields = [Field("image", image()), Field("label", int64(), {"names": classes})]
    if include_path:
        fields.append(Field("path", string()))
    metadata = {
        "source": "imagefolder",
        "classes": classes,
        "class_to_idx": {c: i for i, c in enumerate(classes)},
    }

    def load(item: tuple[str, int]) -> dict:
        path, label = item
        with open(path, "rb") as f:
            data = f.read()
        row = {"image": prepare_image(data, path, opts), "label": label}
        if include_path:
            row["path"] = os.path.relpath(path, src)
        return row

    if opts.engine == "ray":
        from kuat.convert._ray_convert import convert_on_ray

        def write_part(w, part: list, part_opts: ConvertOptions, report: ConvertReport) -> None:
            for row in parallel_map(
                load, part, part_opts, source_of=lambda item: item[0], report=report
            ):
                w.write(row)

        n = opts.rows_per_task
        parts = [samples[i : i + n] for i in range(0, len(samples), n)]
        return convert_on_ray(
            dst, Schema(fields), metadata, opts, parts, write_part, _paths_of_part
        )

    with converting(dst, Schema(fields), opts, metadata) as (w, report):
        for row in parallel_map(
            load,
            samples,
            opts,
            total=len(samples),
            desc=f"convert {src.name}",
            source_of=lambda item: item[0],
            report=report,
            chunk_size=CHUNK_ITEMS,
        ):
            w.write(row)
    return report


def _paths_of_part(part: list[tuple[str, int]]) -> list[str]:
    """The image files of one Ray part (their sizes and times go into its fingerprint)."""
    return [path for path, _ in part]
