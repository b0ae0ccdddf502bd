"""The optional ROI decoder built from source for a test (into a temporary folder), imported
without being installed; the test skips with the compiler's reason where it cannot be built."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def build_roi_module(out_dir: Path, **build_kwargs):
    """``kuat.vision._build_roijpeg.build(out_dir, **build_kwargs)``, imported as a module
    (no libjpeg loaded into it yet: see ``kuat.vision._libjpeg.load_into``)."""
    from kuat.vision._build_roijpeg import build

    try:
        path = build(out_dir, **build_kwargs)
    except RuntimeError as e:
        pytest.skip(f"cannot build the optional ROI decoder here: {e}")
    spec = importlib.util.spec_from_file_location("_roijpeg", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
