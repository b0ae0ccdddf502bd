"""Virtual environments for peers that cannot share the interpreter running ``kuat bench``.

Each lives in ``bench-envs/<name>`` under kuat's cache root (``~/.cache/kuat`` unless
``$KUAT_CACHE`` or ``$XDG_CACHE_HOME`` says otherwise; ``$KUAT_BENCH_ENVS`` overrides), is created
with ``python3 -m venv`` and filled by pip from the package index only, and is reused while its
recipe is unchanged (a marker file records the recipe and what installed). Every environment
gets exactly the torch and torchvision of the running interpreter, by path, never by download:
the venv is made by the running interpreter (same Python, same ABI), and a ``.pth`` file puts a
folder of symlinks to torch, torchvision and everything they require (the CUDA libraries,
triton, numpy, pillow...: :func:`shared_dir`) at the end of its ``sys.path``. pip then finds
``torch==X`` already installed and copies nothing (the CUDA wheels alone are 3 GiB per
environment); a package the environment pins differently (Streaming's ``numpy<2.2``) is
installed into the environment itself, which comes first on ``sys.path``, and pip never
uninstalls the shared copy (it is outside the environment). Every loader runs the same kernels.

Why separate environments (facts measured on this project's machine, late 2026):

- ``streaming``: Mosaic Streaming 0.13 pins ``numpy<2.2`` and brings a transformers /
  huggingface-hub pair that breaks ``datasets`` 5.2.
- ``ffcv``: FFCV 1.0.2 is an sdist that compiles against libjpeg-turbo and OpenCV (Debian's
  ``libturbojpeg0-dev libopencv-dev pkg-config``), and its declared requirements pin old
  versions, so it is installed with ``--no-deps`` after its run-time dependencies.
- ``text``: torchtune 0.6.1 (imports with torch 2.14 only beside ``torchao==0.10.0``, newer
  torchao fails at import) and TRL 1.16 with the ``datasets`` it brings, for the text
  benchmark's packing peers (``benchmarks/text_peers.py``).
- ``mds``: an *overlay*, not a venv: Mosaic Streaming's writer (``MDSWriter``) and the few
  modules it imports, ``pip install --target``-ed with ``--no-deps`` and appended to the
  running interpreter's ``sys.path`` (after its own packages, so nothing is shadowed): the
  ``mds`` ingest row runs on exactly the project's torch/numpy, with no torch download. Writing
  MDS shards works with numpy 2.x despite Streaming's ``numpy<2.2`` pin (reading is what the
  full ``streaming`` environment is for).
- ``peers``: SPDL 0.8 (needs Debian's ``libavdevice59 libavfilter8`` at run time), DALI (CPU
  pipeline) and LitData, which co-install, but not into the project's environment.

Debian packages are installed with ``apt-get`` when missing and the process is root;
otherwise the failure is recorded and the peers needing them are reported as unavailable.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

BASE = ["psutil", "simplejpeg", "pillow", "numpy"]

# name -> Debian packages and pip steps; each step is one ``pip install`` whose outcome is
# recorded separately, so one peer failing to install does not take the others down.
ENVS: dict[str, dict] = {
    "peers": {
        "apt": ["libavdevice59", "libavfilter8"],
        "steps": {
            "spdl": ["spdl==0.8.0"],
            "dali": ["nvidia-dali-cuda120==2.4.0", "nvidia-nvimgcodec-cu12"],
            "litdata": ["litdata==0.2.76"],
        },
    },
    "text": {
        "apt": [],
        "steps": {
            "torchtune": ["torchtune==0.6.1", "torchao==0.10.0"],
            "trl": ["trl==1.16.0"],
        },
    },
    "streaming": {
        "apt": [],
        "steps": {"streaming": ["mosaicml-streaming==0.13.0"]},
    },
    "mds": {
        "apt": [],
        "overlay": True,
        "steps": {
            "mds": [
                "--no-deps",
                "mosaicml-streaming==0.13.0",
                # what `from streaming import MDSWriter` imports beyond the project's packages
                "Brotli",
                "python-snappy",
                "cramjam",
                "zstd",
                "catalogue",
            ]
        },
    },
    "ffcv": {
        "apt": ["libturbojpeg0-dev", "libopencv-dev", "pkg-config"],
        "steps": {
            "ffcv-deps": [
                "numba",
                "opencv-python-headless",
                "terminaltables",
                "pytorch_pfn_extras",
                "fastprogress",
                "imgcat",
                "tqdm",
                "assertpy",
                "pkgconfig",
                "setuptools",
                "wheel",
            ],
            "ffcv": ["--no-deps", "--no-build-isolation", "ffcv==1.0.2"],
        },
    },
}


class EnvUnavailable(RuntimeError):
    """The environment (or the step a peer needs) is missing or failed to install."""


def envs_root() -> Path:
    """``$KUAT_BENCH_ENVS``, else ``bench-envs`` under kuat's cache root (``$KUAT_CACHE``, else
    ``$XDG_CACHE_HOME/kuat``, else ``~/.cache/kuat``)."""
    from kuat._dirs import cache_root  # lazily: this module is read in peer environments too

    env = os.environ.get("KUAT_BENCH_ENVS")  # absolute: peers' interpreters run elsewhere
    return Path(os.path.abspath(Path(env).expanduser())) if env else cache_root() / "bench-envs"


def _torch_pins() -> list[str]:
    # the public version without its local label: ``torch==2.14.1+cu130`` matches no wheel an
    # index serves (pip: ResolutionImpossible), while ``torch==2.14.1`` is the same build (the
    # package index's default CUDA wheel) and resolves to the copy on this machine's disk
    pins = []
    for name in ("torch", "torchvision"):
        try:
            pins.append(f"{name}=={metadata.version(name).split('+')[0]}")
        except metadata.PackageNotFoundError:
            continue
    return pins


def recipe(name: str) -> dict:
    if name not in ENVS:
        raise ValueError(f"unknown bench environment name={name!r}; known: {sorted(ENVS)}")
    if ENVS[name].get("overlay"):  # installs beside the running interpreter's packages
        return {"base": [], **ENVS[name]}
    return {"base": _torch_pins() + BASE, **ENVS[name]}


def overlay_dir(name: str) -> Path:
    """The ``--target`` folder of overlay environment ``name``."""
    return envs_root() / name / "site"


def use_overlay(name: str) -> bool:
    """Append overlay environment ``name`` to ``sys.path`` (after the interpreter's own
    packages) if it was set up; returns whether it was."""
    d = str(overlay_dir(name))
    if marker(name) is None or not os.path.isdir(d):
        return False
    if d not in sys.path:
        sys.path.append(d)
    return True


def _requirement_closure(roots: tuple[str, ...]) -> dict[str, metadata.Distribution]:
    """The installed distributions ``roots`` require, transitively (markers evaluated, extras
    followed), keyed by normalised name; the running interpreter's metadata."""
    from packaging.requirements import Requirement

    found: dict[str, tuple[metadata.Distribution, set[str]]] = {}
    todo: list[tuple[str, frozenset[str]]] = [(name, frozenset()) for name in roots]
    while todo:
        name, extras = todo.pop()
        key = name.lower().replace("_", "-")
        if key in found and extras <= found[key][1]:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional requirement this interpreter lacks: pip resolves it
        asked = found.get(key, (dist, set()))[1] | extras
        found[key] = (dist, asked)
        for line in dist.requires or []:
            req = Requirement(line)
            marker_envs = [{"extra": e} for e in (asked or {""})]
            if req.marker is None or any(req.marker.evaluate(e) for e in marker_envs):
                todo.append((req.name, frozenset(req.extras)))
    return {k: d for k, (d, _) in found.items()}


def shared_dir() -> Path:
    """A folder of symlinks to the running interpreter's torch and torchvision and every
    distribution they require (each distribution's top-level files and its ``.dist-info``),
    named by a digest of what it links, under :func:`envs_root`; created once.

    Environments put it at the end of their ``sys.path`` (a ``.pth`` file), so ``torch==X``
    resolves to these very files: nothing is downloaded or copied. Shared libraries resolve
    ``$ORIGIN``-relative paths inside the folder, where every top-level name sits side by side.
    Raises EnvUnavailable when this interpreter has no torch.
    """
    dists = _requirement_closure(("torch", "torchvision"))
    if "torch" not in dists:
        raise EnvUnavailable("the interpreter running kuat bench has no torch to share")
    links: dict[str, Path] = {}
    for dist in dists.values():
        site = Path(dist.locate_file(""))
        for f in dist.files or []:
            top = f.parts[0]
            if top in ("..", "__pycache__") or top.endswith(".pth"):
                continue  # console scripts outside site-packages; interpreter hooks
            links[top] = site / top
    key = sorted(f"{d.metadata['Name']}=={d.version}@{d.locate_file('')}" for d in dists.values())
    d = envs_root() / f"_shared-torch-{_digest({'dists': key})}"
    if not (d / ".complete").exists():
        tmp = d.with_name(d.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for top, target in sorted(links.items()):
            if target.exists():
                (tmp / top).symlink_to(target)
        (tmp / ".complete").write_text("\n".join(key) + "\n")
        shutil.rmtree(d, ignore_errors=True)
        tmp.rename(d)
    return d


def share_torch(venv: Path) -> Path:
    """Put :func:`shared_dir` at the end of ``sys.path`` in ``venv`` (made by this
    interpreter: the same Python version) with a ``.pth`` file; returns that file."""
    major, minor = sys.version_info[:2]
    pth = venv / "lib" / f"python{major}.{minor}" / "site-packages" / "kuat-bench-shared-torch.pth"
    pth.write_text(f"{shared_dir()}\n")
    return pth


def _digest(r: dict) -> str:
    return hashlib.sha256(json.dumps(r, sort_keys=True).encode()).hexdigest()[:16]


def python_path(name: str) -> Path:
    if ENVS.get(name, {}).get("overlay"):
        return Path(sys.executable)
    return envs_root() / name / "bin" / "python"


def marker(name: str) -> dict | None:
    """The recorded install outcome of environment ``name``, or None if never completed."""
    p = envs_root() / name / "kuat-bench-env.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _missing_apt(packages: list[str]) -> list[str]:
    if not shutil.which("dpkg-query"):
        return list(packages)
    missing = []
    for pkg in packages:
        r = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True
        )
        if "install ok installed" not in r.stdout:
            missing.append(pkg)
    return missing


def _run(cmd: list[str], log) -> int:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode


def ensure(name: str, *, create: bool, log_path: Path, force: bool = False) -> Path:
    """Return the interpreter of environment ``name``, creating it when ``create`` is true.

    Reuses an environment whose marker matches the current recipe. With ``create=False`` a
    missing or outdated environment raises :class:`EnvUnavailable` (``kuat bench --quick``
    only uses what is already installed). Creation output goes to ``log_path``.
    """
    r = recipe(name)
    m = marker(name)
    if m is not None and m.get("digest") == _digest(r) and not force:
        return python_path(name)
    if not create:
        raise EnvUnavailable(
            f"bench environment {name!r} is not set up (run `kuat bench --setup-envs`)"
        )
    log_path.parent.mkdir(parents=True, exist_ok=True)
    status: dict[str, str] = {}
    with open(log_path, "a") as log:
        missing = _missing_apt(r["apt"])
        if missing:
            if os.geteuid() == 0 and shutil.which("apt-get"):
                rc = _run(["apt-get", "update"], log) or _run(
                    ["apt-get", "install", "-y", "--no-install-recommends", *missing], log
                )
            else:
                rc = -1
            status["apt"] = "ok" if rc == 0 else f"failed (rc={rc}): apt-get install {missing}"
        d = envs_root() / name
        py = python_path(name)
        pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check"]
        if r.get("overlay"):
            overlay_dir(name).mkdir(parents=True, exist_ok=True)
            pip += ["--target", str(overlay_dir(name)), "--upgrade"]
        else:
            # the running interpreter makes the venv: the shared torch needs the same Python
            if not py.exists() and _run([sys.executable, "-m", "venv", str(d)], log):
                raise EnvUnavailable(f"{sys.executable} -m venv {d} failed; see {log_path}")
            pth = share_torch(d)
            log.write(f"# {pth}: {pth.read_text().strip()} (torch and its requirements)\n")
        if r["base"] and _run([*pip, *r["base"]], log):
            raise EnvUnavailable(f"installing {r['base']} into {d} failed; see {log_path}")
        for step, args in r["steps"].items():
            rc = _run([*pip, *args], log)
            status[step] = "ok" if rc == 0 else f"pip install {' '.join(args)} failed (rc={rc})"
    (envs_root() / name / "kuat-bench-env.json").write_text(
        json.dumps({"digest": _digest(r), "recipe": r, "status": status}, indent=1)
    )
    return python_path(name)


def step_error(name: str) -> str | None:
    """Why environment ``name`` is incomplete (failed apt or pip steps), or None."""
    m = marker(name) or {}
    bad = [f"{k}: {v}" for k, v in m.get("status", {}).items() if v != "ok"]
    return "; ".join(bad) or None
