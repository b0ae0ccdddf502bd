"""Dependencies point one way (DESIGN.md, "Layout"): the storage layer (kuat.format) imports no
source, loader, engine, sampling or RNG module; vision has no import cycle; opening and
reading a kuat dataset imports neither torch nor the vision transforms."""

import ast
import subprocess
import sys
from pathlib import Path

import kuat

SRC = Path(kuat.__file__).parent


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any level (lazy imports inside functions too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_the_format_is_storage_only():
    allowed = ("kuat.format", "kuat.errors", "kuat.__version__", "kuat._dirs")
    # the exceptions, both lazy: the column builder reads each image's header for the per-row
    # width/height the index stores; verify(images=True / decode=True) checks and decodes
    exceptions = {
        "builder.py": {"kuat.vision.probe"},
        "verify.py": {"kuat.vision.decode", "kuat.vision.probe"},
    }
    bad = []
    for path in sorted((SRC / "format").glob("*.py")):
        for name in sorted(_imports(path)):
            if name.startswith("kuat") and name != "kuat" and not name.startswith(allowed):
                if not any(name.startswith(e) for e in exceptions.get(path.name, ())):
                    bad.append(f"format/{path.name} imports {name}")
    assert bad == []


def test_vision_modules_form_no_cycle():
    mods = {p.stem: _imports(p) for p in (SRC / "vision").glob("*.py")}
    edges = {
        a: {b for b in mods if b != a and any(n == f"kuat.vision.{b}" or n.startswith(f"kuat.vision.{b}.") for n in deps)}
        for a, deps in mods.items()
    }

    def reaches(a, target, seen=()):
        return any(b == target or (b not in seen and reaches(b, target, (*seen, b))) for b in edges[a])

    cycles = sorted(a for a in edges if reaches(a, a))
    assert cycles == [], {a: sorted(edges[a]) for a in cycles}
    assert "transforms" in edges and "geometry" in edges["gpu"] and "transforms" not in edges["gpu"]


def test_reading_a_dataset_imports_no_torch_nor_transforms(tmp_path):
    code = f"""
import sys
import numpy as np
import kuat
import kuat.format as kf
with kuat.Writer({str(tmp_path / "d")!r}, {{"x": kf.tensor((2,), "int8"), "y": kf.int64()}}) as w:
    w.write({{"x": np.ones(2, np.int8), "y": 3}})
ds = kuat.open({str(tmp_path / "d")!r})
assert type(ds).__module__ == "kuat.sources.dataset"
assert ds[0]["y"] == 3 and ds.read_batch([0])["x"].tolist() == [[1, 1]]
import warnings
with warnings.catch_warnings(record=True) as caught:  # deprecated names, kept for one release
    warnings.simplefilter("always")
    assert kf.Dataset is kuat.Dataset and kf.open is kuat.open
assert [w.category for w in caught] == [DeprecationWarning] * 2, caught
print(sorted(m for m in ("torch", "kuat.vision.transforms", "kuat.loader") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
