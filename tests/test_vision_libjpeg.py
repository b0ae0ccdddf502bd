"""Which libjpeg the ROI decoder runs on (kuat.vision._libjpeg): the extension compiles against
the vendored headers and links no libjpeg; at import it loads Pillow's bundled libjpeg-turbo or
the system's, refuses a library whose ABI differs (libjpeg's own version/struct-size check),
and falls back with one warning.

Each test builds its own copy of the extension into tmp_path (its jpeg_* table is per copy),
so the copy kuat imported is never touched.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
from _roi import build_roi_module

from kuat.vision import _build_roijpeg, _libjpeg


def _build(out_dir: Path, include: Path = _build_roijpeg.INCLUDE):
    return build_roi_module(out_dir, include=include)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("roijpeg"))


@pytest.fixture(scope="module")
def mismatched(tmp_path_factory):
    """The extension compiled as a libjpeg 9 caller (JPEG_LIB_VERSION 90: a larger struct).
    Not 80: a process may hold a libjpeg-turbo with the libjpeg 8 ABI (torchvision's copy,
    Ubuntu's libjpeg.so.8), which would rightly accept such a caller."""
    include = tmp_path_factory.mktemp("include80")
    for h in _build_roijpeg.INCLUDE.iterdir():
        shutil.copy(h, include / h.name)
    cfg = include / "jconfig.h"
    text = cfg.read_text()
    assert "#define JPEG_LIB_VERSION  62" in text  # the vendored header this test edits
    cfg.write_text(text.replace("#define JPEG_LIB_VERSION  62", "#define JPEG_LIB_VERSION  90"))
    return _build(tmp_path_factory.mktemp("roijpeg80"), include)


def _acceptable(mod) -> list[tuple[str, str]]:
    """Candidates of the default order that load into ``mod`` on this machine: Pillow's
    bundled libjpeg-turbo (with a Pillow wheel), and Debian's libjpeg.so.62 where installed
    (Ubuntu's libjpeg.so.8 is refused: another ABI)."""
    found = []
    for origin, path in _libjpeg.candidates("auto"):
        try:
            mod.load(path)
        except OSError:
            continue
        found.append((origin, path))
    return found


def _photo_jpeg(h=61, w=83, **kw) -> bytes:
    rng = np.random.default_rng(1)
    yy, xx = np.mgrid[0:h, 0:w]
    a = np.stack([yy * 3, xx * 2, yy + xx], -1) + rng.integers(-20, 21, (h, w, 3))
    return simplejpeg.encode_jpeg(np.clip(a, 0, 255).astype(np.uint8), quality=85, **kw)


def test_build_uses_only_the_vendored_headers():
    """No system jpeglib.h/jconfig.h is read: every libjpeg header the preprocessor opens is
    a vendored one (what makes the build work without libjpeg's development package)."""
    try:
        cc = _build_roijpeg.compiler()
    except RuntimeError as e:
        pytest.skip(str(e))
    dep = subprocess.run(
        [cc, "-M", *_build_roijpeg.compile_flags(), str(_build_roijpeg.SOURCE)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    headers = [Path(t) for t in dep.replace("\\\n", " ").split() if t.endswith(".h")]
    jpeg = [h for h in headers if h.name in ("jpeglib.h", "jconfig.h", "jmorecfg.h", "jerror.h")]
    assert sorted(h.name for h in jpeg) == ["jconfig.h", "jmorecfg.h", "jpeglib.h"]
    for h in jpeg:
        assert h.resolve().parent == _build_roijpeg.INCLUDE.resolve(), h


def test_extension_links_no_libjpeg(fresh):
    """Importing the built module alone maps no libjpeg into a fresh interpreter."""
    code = textwrap.dedent(
        f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("_roijpeg", {fresh.__file__!r})
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        maps = open("/proc/self/maps").read()
        print("libjpeg" in maps)
        """
    )
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs /proc (Linux)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_decode_before_load_raises(tmp_path):
    mod = _build(tmp_path)
    with pytest.raises(RuntimeError, match="no libjpeg loaded"):
        mod.decode_crop(_photo_jpeg(), 8, 0, 1, 0, 1, np.empty(3, np.uint8))


def test_every_available_libjpeg_decodes_exactly(fresh):
    """Pillow's bundled libjpeg-turbo and the system's (where installed) give the pixels of a
    full decode (simplejpeg) on the same region, at every DCT scale kuat uses."""
    found = _acceptable(fresh)
    pillow = [("pillow", p) for p in _libjpeg._pillow_candidates()]
    assert found and set(pillow) <= set(found), (found, pillow)
    data = _photo_jpeg()
    for origin, path in found:
        copyright, file = fresh.load(path)
        assert "libjpeg-turbo" in copyright, (origin, path, copyright)
        assert os.path.isfile(file) and "jpeg" in os.path.basename(file), file
        for k in (1, 2, 4, 8):  # simplejpeg picks the smallest k/8 that covers min_*
            h, w = -(-61 * k // 8), -(-83 * k // 8)  # ceil(61 * k / 8) x ceil(83 * k / 8)
            full = simplejpeg.decode_jpeg(data, min_height=h, min_width=w)
            assert full.shape[:2] == (h, w)
            y0, y1, x0, x1 = 1, full.shape[0] - 1, 2, full.shape[1] - 1
            got = np.empty((y1 - y0, x1 - x0, 3), np.uint8)
            fresh.decode_crop(data, k, y0, y1, x0, x1, got)
            np.testing.assert_array_equal(got, full[y0:y1, x0:x1], err_msg=f"{origin} k={k}")


def test_default_order_and_report(fresh, caplog):
    """The default takes the first acceptable candidate (Pillow's when Pillow is a wheel),
    without a warning, and says which file it is."""
    with caplog.at_level(logging.DEBUG, logger="kuat.vision"):
        info = _libjpeg.load_into(fresh, None)
    assert info is not None
    first = _acceptable(fresh)[0]
    assert (info.origin, info.path) == first
    assert os.path.exists(info.resolved)
    assert os.path.basename(info.resolved) in info.describe()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    system = _libjpeg.load_into(fresh, "system")
    if system is not None:  # Debian/Ubuntu's libjpeg62-turbo, where installed
        assert system.origin == "system" and "libjpeg" in os.path.basename(system.resolved)


def test_mismatched_abi_is_refused_with_one_warning(mismatched, fresh, caplog):
    """A caller built for another JPEG_LIB_VERSION (another struct size) is refused by
    libjpeg's own check, cleanly (OSError, nothing loaded), for every candidate; the loader
    then gives up with one warning and kuat decodes through simplejpeg."""
    origin, path = _acceptable(fresh)[0]
    with pytest.raises(OSError, match="refused kuat's libjpeg ABI.*JPEG_LIB_VERSION 90"):
        mismatched.load(path)
    with pytest.raises(RuntimeError, match="no libjpeg loaded"):  # the refusal loaded nothing
        mismatched.decode_crop(_photo_jpeg(), 8, 0, 1, 0, 1, np.empty(3, np.uint8))
    with caplog.at_level(logging.DEBUG, logger="kuat.vision"):
        assert _libjpeg.load_into(mismatched, None) is None
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert "Wrong JPEG library version" in msg and "simplejpeg" in msg and path in msg


def test_refused_choice_falls_back_with_one_warning(fresh, caplog):
    """KUAT_LIBJPEG naming a file that is not a libjpeg (here: the extension itself) is
    refused with one warning, and the default order is used instead."""
    with caplog.at_level(logging.DEBUG, logger="kuat.vision"):
        info = _libjpeg.load_into(fresh, fresh.__file__)
    assert info is not None and (info.origin, info.path) == _acceptable(fresh)[0]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "has no jpeg_std_error" in warnings[0].getMessage()
    got = np.empty((4, 5, 3), np.uint8)  # and it decodes with the fallback library
    fresh.decode_crop(_photo_jpeg(), 8, 0, 4, 0, 5, got)


def test_kuat_libjpeg_words():
    assert _libjpeg.candidates("off") == []
    assert [o for o, _ in _libjpeg.candidates("system")] == ["system"] * len(_libjpeg._SYSTEM_NAMES)
    assert all(o == "pillow" for o, _ in _libjpeg.candidates("pillow"))
    assert _libjpeg.candidates("/opt/libjpeg.so.62") == [("path", "/opt/libjpeg.so.62")]
    with pytest.raises(ValueError, match="KUAT_LIBJPEG='turbo'"):
        _libjpeg.candidates("turbo")


def test_off_disables_the_roi_decoder():
    """KUAT_LIBJPEG=off: kuat imports without the ROI decoder and still decodes JPEGs."""
    code = (
        "from kuat.vision import decode as d; import simplejpeg, numpy as np\n"
        "data = simplejpeg.encode_jpeg(np.zeros((8, 8, 3), np.uint8))\n"
        "print(d._roi, d._roi_libjpeg, d.decode_image(data).shape)"
    )
    env = {**os.environ, "KUAT_LIBJPEG": "off"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == "None None (8, 8, 3)"


def test_smoke_check_without_simplejpeg(fresh, monkeypatch):
    """Where simplejpeg is missing, the load-time test decode compares with Pillow instead
    (an import of kuat must never fail for it)."""
    monkeypatch.setitem(sys.modules, "simplejpeg", None)  # `import simplejpeg` raises
    info = _libjpeg.load_into(fresh, None)
    assert info is not None and (info.origin, info.path) == _acceptable(fresh)[0]


def test_real_libjpeg8_is_refused(fresh):
    """torchvision's wheel bundles a libjpeg-turbo with the libjpeg 8 ABI (soname
    libjpeg.so.8, as Ubuntu's): once it is in the process, ``dlopen("libjpeg.so.8")`` finds
    it, and libjpeg's own check refuses kuat's 6.2 caller; the module keeps what it had."""
    pytest.importorskip("torchvision.io")
    import torchvision.io  # noqa: F401  (maps torchvision.libs/libjpeg.<hash>.so.8)

    maps = open("/proc/self/maps").read() if os.path.exists("/proc/self/maps") else ""
    if "libjpeg" not in maps or ".so.8" not in maps:
        pytest.skip("this torchvision bundles no libjpeg.so.8")
    assert _acceptable(fresh)  # Pillow's copy loaded last
    with pytest.raises(OSError, match="library is 80, caller expects 62"):
        fresh.load("libjpeg.so.8")
    data = _photo_jpeg()
    got = np.empty((4, 5, 3), np.uint8)  # still decoding with the last accepted library
    fresh.decode_crop(data, 8, 0, 4, 0, 5, got)
    np.testing.assert_array_equal(got, simplejpeg.decode_jpeg(data)[:4, :5])
