"""The README's Python examples run exactly as written (in a scratch directory)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KUAT_CACHE", str(tmp_path / "cache"))
    code = compile(BLOCKS[index], f"README.md python block {index}", "exec")
    exec(code, {"__name__": f"readme_{index}"})


def test_readme_images_exist():
    """Every image the README shows is a committed file (the results chart among them)."""
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README.read_text())
    assert images, "the README shows the results chart"
    missing = [p for p in images if "://" not in p and not (README.parent / p).is_file()]
    assert missing == []
