"""The parallel driver shared by every converter: an ordered, bounded thread-pool map with a
progress bar and an error policy, plus the per-image preparation (probe, or re-encode).

Threads suffice: reading files, Pillow's header parse, decoding (simplejpeg/Pillow) and JPEG
encoding release the GIL, so N threads use N cores; the single writer thread only appends.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice

from kuat.errors import DecodeError, KuatError
from kuat.format.schema import EncodedImage

__all__ = [
    "ENGINES",
    "ConvertOptions",
    "ConvertReport",
    "converting",
    "parallel_map",
    "prepare_image",
    "ON_ERROR",
    "Progress",
]

log = logging.getLogger("kuat.convert")

ON_ERROR = ("raise", "skip")
ENGINES = ("local", "ray")


@dataclass(frozen=True)
class ConvertOptions:
    """Options every converter takes.

    Attributes:
        num_workers: threads preparing samples (``None``: one per CPU core).
        progress: show a tqdm progress bar when stderr is a terminal; otherwise (a log file,
            a batch job) log a progress line on the ``kuat.convert`` logger (INFO) every
            ``progress_interval_s`` seconds.
        progress_interval_s: seconds between progress lines when stderr is not a terminal
            (default 30: a readable log for hour-long jobs).
        on_error: ``"raise"`` stops at the first unreadable image, naming its path;
            ``"skip"`` leaves it out, logs every skipped path and the count at the end.
        resize_shorter: re-encode images whose shorter side exceeds this many pixels,
            resized (Pillow, antialiased) so the shorter side is exactly this; ``None`` keeps
            the original bytes (default). Images already small enough keep their bytes.
        quality: JPEG quality (1-100) of re-encoded images.
        decode_check: fully decode every kept image to catch any corruption (slower). Without
            it every image is still checked for completeness (a JPEG's end-of-image marker after
            its scan, a PNG's IEND chunk), which catches truncated files.
        shard_bytes: target shard size in bytes (see ``kuat.Writer``).
        overwrite: replace an existing dataset at the destination.
        engine: ``"local"`` (default): this machine's threads; ``"ray"``: Ray Data tasks on
            the Ray cluster ``ray.init()`` finds (see ``kuat.convert._ray_convert``; ``kuat[ray]``).
        rows_per_task: (``engine="ray"``, ImageFolder) images one task converts and writes;
            1000 ImageNet JPEGs (~110 KB each) make about one 128 MiB shard per task. Tables
            take one task per input file.
        storage_options: fsspec options (credentials, ``endpoint_url``) for URL sources and
            destinations (``s3://...``; see :mod:`kuat.format.fs`).
        restart: (``engine="ray"``) start over, deleting the finished parts an earlier,
            interrupted run left; by default a rerun resumes from them (see
            ``kuat.convert._ray_convert``).
    """

    num_workers: int | None = None
    progress: bool = True
    progress_interval_s: float = 30.0
    on_error: str = "raise"
    resize_shorter: int | None = None
    quality: int = 90
    decode_check: bool = False
    shard_bytes: int | None = None
    overwrite: bool = False
    engine: str = "local"
    rows_per_task: int = 1000
    storage_options: dict | None = None
    restart: bool = False

    def __post_init__(self):
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error={self.on_error!r} must be one of {ON_ERROR}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine={self.engine!r} must be one of {ENGINES}")
        if not isinstance(self.restart, bool):
            raise ValueError(f"restart={self.restart!r} must be a bool")
        if not isinstance(self.rows_per_task, int) or self.rows_per_task < 1:
            raise ValueError(f"rows_per_task={self.rows_per_task!r} must be a positive int")
        if self.num_workers is not None and (
            not isinstance(self.num_workers, int) or self.num_workers < 1
        ):
            raise ValueError(f"num_workers={self.num_workers!r} must be a positive int or None")
        if self.resize_shorter is not None and (
            not isinstance(self.resize_shorter, int) or self.resize_shorter < 1
        ):
            raise ValueError(f"resize_shorter={self.resize_shorter!r} must be a positive int")
        if not isinstance(self.quality, int) or not 1 <= self.quality <= 100:
            raise ValueError(f"quality={self.quality!r} must be an int in [1, 100]")
        if not isinstance(self.progress_interval_s, (int, float)) or self.progress_interval_s < 0:
            raise ValueError(
                f"progress_interval_s={self.progress_interval_s!r} must be a number >= 0"
            )

    @property
    def workers(self) -> int:
        return self.num_workers or os.cpu_count() or 1

    def writer_kwargs(self, dst: str | os.PathLike) -> dict:
        """The :class:`kuat.Writer` options for the destination ``dst``: ``storage_options``
        only when ``dst`` is a URL (they may be there for URL sources alone, and a Writer
        refuses them for a local path)."""
        from kuat.format.fs import is_url

        kw = {"overwrite": self.overwrite}
        if self.shard_bytes is not None:
            kw["shard_bytes"] = self.shard_bytes
        if self.storage_options and is_url(os.fspath(dst)):
            kw["storage_options"] = self.storage_options
        return kw


@dataclass
class ConvertReport:
    """What a conversion did.

    Attributes:
        path: the written dataset directory.
        rows: rows written.
        skipped: ``[(source, reason)]`` of every sample left out with ``on_error="skip"``.
        seconds: wall time.
    """

    path: str
    rows: int = 0
    skipped: list = field(default_factory=list)
    seconds: float = 0.0

    def __repr__(self) -> str:
        return (
            f"ConvertReport({self.path!r}, rows={self.rows}, skipped={len(self.skipped)}, "
            f"seconds={self.seconds:.2f})"
        )


def prepare_image(data: bytes, source: object, opts: ConvertOptions) -> EncodedImage:
    """Encoded image bytes -> :class:`EncodedImage` as stored (original or re-encoded).

    Every image is checked for completeness (:func:`kuat.vision.probe.probe_complete`);
    ``opts.decode_check`` adds a full decode.

    Raises:
        kuat.DecodeError: the bytes are not a readable image, or truncated, or a decoder
            refused them with its own exception type (Pillow's ``DecompressionBombError``
            above its pixel limit, chained); names ``source``.
    """
    try:
        return _prepare_image(data, source, opts)
    except (KuatError, OSError):
        raise
    except Exception as e:  # noqa: BLE001 (a decoder's own refusal type: a DecodeError here,
        # so on_error applies and the conversion is not aborted by a foreign exception)
        raise DecodeError(f"cannot read image {source}: {type(e).__name__}: {e}",
                          source=source) from e


def _prepare_image(data: bytes, source: object, opts: ConvertOptions) -> EncodedImage:
    from kuat.vision.probe import probe_complete

    info = probe_complete(data, source=source)
    resize = opts.resize_shorter is not None and min(info.width, info.height) > opts.resize_shorter
    if not resize:
        if opts.decode_check:
            from kuat.vision.decode import decode_image

            decode_image(data, source=source)
        return EncodedImage(data, info.width, info.height, info.codec)
    return _resize_encode(data, source, opts.resize_shorter, opts.quality)


def _resize_encode(data: bytes, source: object, shorter: int, quality: int) -> EncodedImage:
    import numpy as np
    import simplejpeg
    from PIL import Image

    from kuat.vision.decode import decode_image

    # (H, W, 3) uint8, EXIF orientation applied; a JPEG decodes at the smallest DCT scale
    # (1/8 .. 1) that keeps both sides >= `shorter`, so the resize below only refines it
    hwc = decode_image(data, min_size=(shorter, shorter), source=source)
    h, w = hwc.shape[:2]
    scale = shorter / min(h, w)
    # the shorter side becomes exactly `shorter`; the other keeps the aspect ratio
    size = (shorter, max(1, round(w * scale))) if h <= w else (max(1, round(h * scale)), shorter)
    im = Image.fromarray(hwc).resize(
        (size[1], size[0]), Image.Resampling.BILINEAR, reducing_gap=None
    )
    out = np.ascontiguousarray(np.asarray(im))  # (H', W', 3) uint8
    encoded = simplejpeg.encode_jpeg(out, quality=quality, colorspace="RGB")
    return EncodedImage(encoded, out.shape[1], out.shape[0], "jpeg")


class Progress:
    """Progress of one conversion: a tqdm bar when stderr is a terminal, else a line on the
    ``kuat.convert`` logger (INFO) every ``interval_s`` seconds and one at the end, so that a
    job whose stderr goes to a file shows it is alive, how far it is and how fast it goes.
    Not thread-safe (the driver's consumer thread updates it)."""

    def __init__(self, total: int | None, desc: str, enabled: bool, interval_s: float = 30.0):
        self.bar = None
        self.total, self.desc, self.interval_s = total, desc, interval_s
        self.count = 0
        self.logging = enabled and not sys.stderr.isatty()
        self.t0 = self.last = time.monotonic()
        if enabled and not self.logging:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="sample", dynamic_ncols=True)

    def _line(self, now: float, what: str) -> None:
        elapsed = now - self.t0
        rate = self.count / elapsed if elapsed > 0 else 0.0
        of = f"/{self.total} ({100 * self.count / self.total:.0f}%)" if self.total else ""
        log.info(
            "%s: %s %d%s samples in %.0f s, %.0f samples/s",
            self.desc,
            what,
            self.count,
            of,
            elapsed,
            rate,
        )

    def update(self, n: int = 1) -> None:
        self.count += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.logging:
            now = time.monotonic()
            if now - self.last >= self.interval_s:
                self.last = now
                self._line(now, "at")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.logging and self.count:
            self._line(time.monotonic(), "done,")
        self.logging = False


# Items handed to a worker thread at a time for per-image work. One hand-off (a Future, a lock
# wake-up and a GIL transfer each way) costs about 100 us on a busy 2-core machine: as much as
# reading and probing one 60 KB JPEG, so per-item hand-offs made the pool slower than one
# thread. Coarse items (a batch of texts to tokenize) keep chunks of 1.
CHUNK_ITEMS = 16


def _run_chunk(fn: Callable, chunk: list) -> list:
    """``[(True, fn(item)) or (False, error)]`` per item; an item's ``KuatError``/``OSError``
    is returned, not raised, so the rest of the chunk still runs (other errors propagate)."""
    out = []
    for item in chunk:
        try:
            out.append((True, fn(item)))
        except (KuatError, OSError) as e:
            out.append((False, e))
    return out


def parallel_map(
    fn: Callable,
    items: Iterable,
    opts: ConvertOptions,
    *,
    total: int | None = None,
    desc: str = "convert",
    source_of: Callable = str,
    report: ConvertReport | None = None,
    chunk_size: int = 1,
    size_of: Callable | None = None,
) -> Iterator:
    """Yield ``fn(item)`` for every item, in order, computed by ``opts.workers`` threads.

    Items go to the threads in chunks of ``chunk_size`` (:data:`CHUNK_ITEMS` for items that
    cost about as much as a hand-off, such as probing an image); at most ``4 * workers``
    single items or ``2 * workers`` chunks are in flight (bounded memory). An item whose ``fn`` raises a :class:`kuat.KuatError` or
    ``OSError`` is skipped (``on_error="skip"``; recorded in ``report.skipped`` with
    ``source_of(item)``) or re-raised (``"raise"``). Other exceptions are bugs and always
    propagate. ``fn`` must be thread-safe. Progress counts samples: 1 per item, or
    ``size_of(item)`` for items that hold several (batches of records).
    """
    progress = Progress(total, desc, opts.progress, opts.progress_interval_s)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive int")
    window = 4 * opts.workers if chunk_size == 1 else 2 * opts.workers
    pending: deque[tuple[list, Future]] = deque()
    it = iter(items)
    try:
        with ThreadPoolExecutor(opts.workers, thread_name_prefix="kuat-convert") as pool:
            exhausted = False
            while True:
                while not exhausted and len(pending) < window:
                    chunk = list(islice(it, chunk_size))
                    if not chunk:
                        exhausted = True
                        break
                    pending.append((chunk, pool.submit(_run_chunk, fn, chunk)))
                if not pending:
                    break
                chunk, fut = pending.popleft()
                try:
                    outcomes = fut.result()
                except BaseException:
                    for _, f in pending:
                        f.cancel()
                    raise
                for item, (ok, result) in zip(chunk, outcomes):
                    progress.update(1 if size_of is None else size_of(item))
                    if ok:
                        yield result
                        continue
                    where = source_of(item)
                    if opts.on_error == "raise":
                        for _, f in pending:
                            f.cancel()
                        if isinstance(result, KuatError):
                            raise result
                        raise DecodeError(
                            f"cannot read {where}: {result}", source=where
                        ) from result
                    log.debug("skipping %s: %s", where, result)
                    if report is not None:
                        report.skipped.append((where, str(result)))
    finally:
        progress.close()


@contextmanager
def converting(dst, schema, opts: ConvertOptions, metadata: dict | None = None):
    """The ending every converter shares: ``with converting(dst, schema, opts, metadata) as
    (writer, report): ...`` opens the :class:`kuat.Writer` (``opts.overwrite``,
    ``opts.shard_bytes``), and on success fills ``report.rows`` and ``report.seconds`` and logs
    the skipped samples. The dataset is committed only if the block raises nothing.

    Raises:
        ValueError: ``opts.engine`` is not ``"local"``: a converter that reaches this block
            has no other engine (those that do call ``kuat.convert._ray_convert`` instead).
    """
    from kuat.format import Writer

    if opts.engine != "local":
        raise ValueError(
            f"engine={opts.engine!r}: this converter runs locally only (engine='ray' "
            "converts ImageFolder, Parquet, JSON Lines and CSV)"
        )
    check_storable(schema, metadata)
    t0 = time.perf_counter()
    report = ConvertReport(str(dst))
    with Writer(dst, schema, metadata=metadata, **opts.writer_kwargs(dst)) as w:
        yield w, report
        report.rows = w.num_rows
    report.seconds = time.perf_counter() - t0
    log_skipped(report)


def not_utf8(text: str) -> bytes | None:
    """``None`` when ``text`` encodes as UTF-8; else its original bytes: a file or folder name
    that is not valid UTF-8 reaches Python with each bad byte as a lone surrogate
    (``os.fsdecode``'s ``surrogateescape``), which ``os.fsencode`` turns back into it."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError:
        try:
            return os.fsencode(text)
        except UnicodeEncodeError:
            return text.encode("utf-8", "backslashreplace")


def refuse_not_utf8(text: str, what: str) -> None:
    """Raise ``ValueError`` naming ``what`` and the bytes of ``text`` unless it is UTF-8.

    kuat stores names (field names, class names, file names in the metadata, string values)
    as UTF-8 text: the manifest is JSON and Arrow strings are UTF-8. A name that is not could
    only be stored by a private escape no other reader knows, so it is refused, by the callers
    before anything is written."""
    raw = not_utf8(text)
    if raw is not None:
        raise ValueError(
            f"{what} {raw!r} is not valid UTF-8: kuat stores it as UTF-8 text (a JSON manifest, "
            "Arrow strings), so rename it (e.g. with convmv) and convert again; nothing was "
            "written"
        )


def check_storable(schema, metadata: dict | None) -> None:
    """Refuse, before the Writer starts, a field name or metadata text that is not UTF-8
    (typically a file or folder name): otherwise the conversion would run to the end and
    fail writing the manifest with a bare ``UnicodeEncodeError``.

    Raises:
        ValueError: names the field or metadata key and the offending bytes.
    """

    def walk(value, what: str) -> None:
        if isinstance(value, str):
            refuse_not_utf8(value, what)
        elif isinstance(value, dict):
            for k, v in value.items():
                if isinstance(k, str):
                    refuse_not_utf8(k, f"{what} key")
                walk(v, f"{what} {k!r}")
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v, what)

    for f in schema.fields:
        refuse_not_utf8(f.name, "the field name")
        walk(f.metadata, f"field {f.name!r} metadata")
    walk(metadata or {}, "the dataset metadata")


def log_skipped(report: ConvertReport) -> None:
    if report.skipped:
        log.warning(
            "skipped %d unreadable sample(s): %s",
            len(report.skipped),
            ", ".join(str(s) for s, _ in report.skipped),
        )
