"""kuat.format's package face: the source's names it used to re-export (``Dataset``, ``open``,
``open_dataset``) still resolve for one release, with a DeprecationWarning, and lazily:
importing the format imports no source."""

import subprocess
import sys

import pytest

import kuat
import kuat.format as kf


@pytest.mark.parametrize(
    "name, instead", [("Dataset", "Dataset"), ("open", "open"), ("open_dataset", "open")]
)
def test_the_sources_names_warn_and_resolve(name, instead):
    match = rf"kuat\.format\.{name} is deprecated .*; use kuat\.{instead}"
    with pytest.warns(DeprecationWarning, match=match):
        assert getattr(kf, name) is getattr(kuat, instead)
    with pytest.warns(DeprecationWarning, match=match):  # every use warns, not only the first
        getattr(kf, name)
    assert name not in kf.__all__


def test_unknown_names_still_raise_attribute_error():
    with pytest.raises(AttributeError, match="module 'kuat.format' has no attribute 'nope'"):
        kf.nope  # noqa: B018


def test_importing_the_format_imports_no_source():
    code = (
        "import sys, warnings; warnings.simplefilter('error'); import kuat.format; "
        "print(sorted(m for m in sys.modules if m.startswith(('kuat.sources', 'kuat.loader'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
