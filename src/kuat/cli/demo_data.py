"""Moved to :mod:`kuat.demo_data` (library code: ``benchmarks/`` and tests build the corpus
without the CLI). This name stays for code written against the old README; it re-exports the
public names and warns once per process."""

import warnings

from kuat.demo_data import (  # noqa: F401  (re-exported)
    GRAIN_SIGMA,
    LONG_SIDE,
    QUALITY,
    SMOOTH_QUALITY,
    SOURCES,
    build_demo_imagefolder,
    corpus_stats,
    default_cache_dir,
    load_source_photos,
    make_jpeg,
)

warnings.warn(
    "kuat.cli.demo_data moved to kuat.demo_data; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
