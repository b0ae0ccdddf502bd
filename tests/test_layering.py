"""Dependencies point one way (the project's design notes, "Layout"): the storage layer (kuat.format) imports no
source, loader, engine, sampling or RNG module; vision has no import cycle; opening and
reading a kuat dataset imports neither torch nor the vision transforms."""

import ast
import re
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


# --- the whole graph (issue #27): modules of src/kuat and benchmarks/, lazy imports included ----
REPO = SRC.parent.parent


def _module_files() -> dict[str, Path]:
    """``{dotted module name: file}`` for every module of ``kuat`` and ``benchmarks``."""
    out = {}
    for base, pkg in ((SRC.parent, "kuat"), (REPO, "benchmarks")):
        for p in sorted((base / pkg).rglob("*.py")):
            parts = list(p.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


MODULES = _module_files()


def _edges(name: str, path: Path) -> set[str]:
    """The modules of MODULES that ``name`` imports (``from pkg import module`` names the
    module; ``from module import name`` the module; relative imports resolved)."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            found |= {f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names}
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _edges(name, path) for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_kuat_or_benchmarks():
    assert "kuat.loader._iterator" in GRAPH and "benchmarks.runner" in GRAPH
    assert _cycles(GRAPH) == []


def test_the_loaders_iterator_knows_neither_the_face_nor_any_integration():
    deps = GRAPH["kuat.loader._iterator"]
    assert not {d for d in deps if d in ("kuat.loader", "kuat.loader.dataloader")
                or d.startswith("kuat.integrations")}
    # nothing of the loader package but its face reaches an integration
    for name, deps in GRAPH.items():
        if name.startswith("kuat.loader") and name != "kuat.loader.dataloader":
            assert not any(d.startswith("kuat.integrations") for d in deps), name
    # it reads the plan it is handed, never the loader's private attributes
    text = (SRC / "loader" / "_iterator.py").read_text()
    assert re.findall(r"(?<![\w.])(?:loader|lo)\._\w+", text) == []


def test_no_library_module_imports_the_cli_or_the_benchmarks():
    bad = [f"{name} imports {d}" for name, deps in GRAPH.items() for d in sorted(deps)
           if not name.startswith("kuat.cli") and name != "kuat.__main__"  # (python -m kuat)
           and (d == "kuat.cli" or d.startswith("kuat.cli.")
                or (name.startswith("kuat") and d.startswith("benchmarks")))]
    assert bad == []


def test_rank_is_resolved_in_one_module():
    users = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                   if "get_rank()" in p.read_text() or "get_world_size()" in p.read_text())
    assert users == ["distributed.py"]


def test_no_python_file_of_kuat_is_over_500_lines():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


def test_the_loader_package_map_answers_the_four_questions():
    import kuat.loader

    doc = kuat.loader.__doc__
    for question in ("where is the epoch order decided", "where is rank resolved",
                     "where is ``state_dict`` built", "where do batches cross threads"):
        (row,) = [line for line in doc.splitlines() if line.startswith(question)]
        named = [m for m in MODULES if f":mod:`{m}`" in row]
        assert len(named) == 1, (question, row)
