"""Find the libjpeg-turbo that the ROI decoder (``kuat.vision._roijpeg``) runs on, and load it.

``_roijpeg`` links no libjpeg: it is compiled against libjpeg-turbo 3.1.2's public headers,
vendored in ``_libjpeg_turbo/`` next to this file (so building it needs a C compiler only,
not libjpeg's development package), and at import a libjpeg-turbo is ``dlopen``-ed into it with
``RTLD_LOCAL`` (its symbols stay private to the module: no clash with the copies inside Pillow,
simplejpeg or torchvision). Which one, in this order, unless ``KUAT_LIBJPEG`` says otherwise:

1. Pillow's bundled copy (``pillow.libs/libjpeg-<hash>.so.62.*`` in Pillow's manylinux wheels,
   ``PIL/.dylibs/libjpeg.62.dylib`` on macOS). kuat depends on Pillow, so every pip install
   has it, and its version is fixed by the Pillow version: the same decoder everywhere.
2. The system's ``libjpeg.so.62`` (Debian's ``libjpeg62-turbo``, Fedora's ``libjpeg-turbo``).
   Ubuntu's ``libjpeg.so.8`` (``libjpeg-turbo8``) exports the libjpeg 8 ABI, which these
   headers do not describe: it is refused, and Pillow's copy is what runs there.

A candidate is accepted only if it has libjpeg-turbo's crop/skip scanline API, accepts kuat's
ABI (libjpeg's own check in ``jpeg_CreateDecompress``: ``JPEG_LIB_VERSION`` 62 and the size of
``struct jpeg_decompress_struct``) and decodes a small JPEG crop to exactly the pixels of
simplejpeg's full decode. A refused candidate (a libjpeg 8/9, an IJG libjpeg without the
libjpeg-turbo extensions, a broken file) is skipped; if a candidate that exists was refused,
or none loads, one warning on the ``kuat.vision`` logger says why and what is used instead
(the next candidate, or simplejpeg's full/DCT-scaled decodes: same pixels, slower).

``KUAT_LIBJPEG``: unset or ``auto`` (the order above), ``pillow``, ``system``, a path to a
``libjpeg*.so``, or ``off`` (no ROI decoder). A path or group that is refused falls back to
the order above, with the warning.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import sys
import threading
from dataclasses import dataclass
from types import ModuleType

import numpy as np

logger = logging.getLogger("kuat.vision")

ENV = "KUAT_LIBJPEG"
# libjpeg.so.8 (Ubuntu's libjpeg-turbo8: the libjpeg 8 ABI) is always refused by the ABI
# check; it is tried so that the warning says why rather than "none found"
_SYSTEM_NAMES = (
    ("libjpeg.62.dylib", "libjpeg.dylib")
    if sys.platform == "darwin"
    else ("libjpeg.so.62", "libjpeg.so.8")
)


@dataclass(frozen=True)
class LibjpegInfo:
    """The libjpeg the ROI decoder uses: ``origin`` is ``"pillow"``, ``"system"`` or
    ``"path"`` (from ``KUAT_LIBJPEG``); ``path`` what was asked for (a file path, or a soname);
    ``resolved`` the file the dynamic linker loaded (a soname may resolve to a copy another
    module already loaded); ``copyright`` the library's own copyright line (names
    libjpeg-turbo and its year)."""

    origin: str
    path: str
    resolved: str
    copyright: str

    def describe(self) -> str:
        return f"{self.origin} {os.path.basename(self.resolved)} ({self.copyright})"


def _pillow_candidates() -> list[str]:
    spec = importlib.util.find_spec("PIL")  # locates Pillow without importing it
    if spec is None or not spec.submodule_search_locations:
        return []
    pil_dir = list(spec.submodule_search_locations)[0]
    patterns = [
        os.path.join(pil_dir, os.pardir, "pillow.libs", "libjpeg*.so*"),  # Pillow >= 10.1
        os.path.join(pil_dir, os.pardir, "Pillow.libs", "libjpeg*.so*"),  # older wheels
        os.path.join(pil_dir, ".dylibs", "libjpeg*.dylib"),  # macOS wheels
    ]
    return sorted(os.path.normpath(p) for pat in patterns for p in glob.glob(pat))


def candidates(spec: str | None) -> list[tuple[str, str]]:
    """``(origin, path)`` pairs to try for ``KUAT_LIBJPEG=spec``, in order (see the module
    docstring); ``[]`` for ``off``. Raises ``ValueError`` for an unknown word."""
    spec = (spec or "auto").strip()
    pillow = [("pillow", p) for p in _pillow_candidates()]
    system = [("system", n) for n in _SYSTEM_NAMES]
    if spec.lower() in ("off", "none", "0"):
        return []
    if spec.lower() == "auto":
        return pillow + system
    if spec.lower() == "pillow":
        return pillow
    if spec.lower() == "system":
        return system
    if os.sep in spec or spec.startswith("lib"):
        return [("path", spec)]
    raise ValueError(
        f"{ENV}={spec!r}: expected auto, pillow, system, off or a path to a libjpeg shared library"
    )


def _reference(img: np.ndarray) -> tuple[bytes, np.ndarray]:
    """``img`` (H, W, 3) uint8 as a 4:2:0 JPEG, and its full decode by another libjpeg-turbo
    binding (simplejpeg, kuat's JPEG dependency; Pillow where simplejpeg is missing): the
    same integer IDCT and fancy upsampling as the ROI decoder, so the same pixels."""
    try:
        import simplejpeg
    except ImportError:
        import io

        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(img).save(buf, "JPEG", quality=90, subsampling=2)  # 2: 4:2:0
        with Image.open(io.BytesIO(buf.getvalue())) as im:
            return buf.getvalue(), np.asarray(im.convert("RGB"))
    data = simplejpeg.encode_jpeg(img, quality=90, colorsubsampling="420")
    return data, simplejpeg.decode_jpeg(data)


def _smoke(module: ModuleType) -> None:
    """Decode an interior crop of a small JPEG (4:2:0, odd offsets: exercises skip, crop and
    the fancy upsampling at the window's edges) and compare it with a full decode by another
    binding; raises ``OSError`` on any difference."""
    yy, xx = np.mgrid[0:48, 0:64]
    img = np.stack([(yy * 5) % 256, (xx * 4) % 256, ((yy + xx) * 3) % 256], -1).astype(np.uint8)
    data, full = _reference(img)
    want = full[9:37, 11:45]  # (28, 34, 3)
    got = np.empty((28, 34, 4), np.uint8)
    try:
        module.decode_crop(data, 8, 9, 37, 11, 45, got, 4)  # RGBX: a libjpeg-turbo extension
    except ValueError as e:
        raise OSError(f"a test decode failed: {e}") from e
    if not np.array_equal(got[:, :, :3], want):
        raise OSError("a test decode differs from a full decode's pixels")


_lock = threading.Lock()


def load_into(module: ModuleType, spec: str | None) -> LibjpegInfo | None:
    """Load the first acceptable libjpeg for ``spec`` (``KUAT_LIBJPEG``'s syntax) into the
    ``_roijpeg`` extension ``module``. Returns what was loaded, or ``None`` (disabled, or
    nothing acceptable: then one warning is logged). Not safe while ``module`` decodes in
    another thread (the module's jpeg_* table is replaced); serialised by a lock.

    Raises:
        ValueError: ``spec`` is not one of the accepted words or a path.
    """
    tried = candidates(spec)
    explicit = bool(tried) and (spec or "auto").strip().lower() != "auto"
    if explicit:  # a refused choice falls back to the default order
        tried += [c for c in candidates("auto") if c not in tried]
    refused: list[str] = []
    with _lock:
        for origin, path in tried:
            try:
                copyright, resolved = module.load(path)
                _smoke(module)
            except OSError as e:
                # a soname that is simply absent is no news; a file that exists and is refused is
                if origin == "system" and str(e).startswith("cannot load") and not explicit:
                    logger.debug("ROI decoder: no system %s", path)
                else:
                    refused.append(f"{origin}: {e}")  # e names the path
                continue
            info = LibjpegInfo(origin, path, resolved, copyright)
            if refused:
                logger.warning(
                    "ROI decoder: refused %s; using %s", "; ".join(refused), info.describe()
                )
            else:
                logger.debug("ROI decoder: using %s", info.describe())
            return info
    if tried:
        logger.warning(
            "ROI decoder: no usable libjpeg-turbo (%s); JPEG crops decode through simplejpeg "
            "instead (same pixels, slower). Set %s to a libjpeg-turbo >= 1.5 (libjpeg 6.2 ABI).",
            "; ".join(refused) or "none found",
            ENV,
        )
    return None


def load_roi() -> tuple[ModuleType | None, LibjpegInfo | None]:
    """Import ``kuat.vision._roijpeg`` and load a libjpeg into it (``KUAT_LIBJPEG``).

    Returns ``(module, info)``, or ``(None, None)`` when the extension was not built (no C
    compiler at install time), is disabled, or no libjpeg is acceptable.

    Raises:
        ValueError: ``KUAT_LIBJPEG`` holds an unknown word.
    """
    try:
        from kuat.vision import _roijpeg
    except ImportError as e:
        logger.debug("ROI decoder not built (%s): JPEG crops decode through simplejpeg", e)
        return None, None
    if not hasattr(_roijpeg, "load"):  # built from an older _roijpeg.c, linked to -ljpeg
        logger.warning(
            "ROI decoder %s predates run-time libjpeg loading; rebuild it "
            "(python -m kuat.vision._build_roijpeg) or reinstall kuat",
            _roijpeg.__file__,
        )
        return None, None
    info = load_into(_roijpeg, os.environ.get(ENV))
    return (_roijpeg, info) if info is not None else (None, None)
