"""Run torch's and torchdata's own loader test suites on ``kuat.DataLoader`` (issue #29).

The strongest test of a drop-in is the original's own suite. This script runs a *locally
provided* copy of

- pytorch/pytorch ``test/test_dataloader.py`` (suite ``torch``), and
- meta-pytorch/data ``test/stateful_dataloader/test_state_dict.py`` (suite ``torchdata``)

with ``torch.utils.data.DataLoader`` (and ``torch.utils.data.dataloader.DataLoader``, and
torchdata's ``StatefulDataLoader``) replaced by ``kuat.DataLoader`` before the test module
imports it, once per worker type, and compares the outcome with the committed list of tests
kuat is expected not to pass (``benchmarks/parity_expected.json``). Nothing is fetched at run
time and no third-party test code lives in this repository: pass the files' paths.

How the class is swapped: a generated ``sitecustomize.py`` on ``PYTHONPATH`` (Python imports it
at start-up, so it reaches every process the suite starts: spawned workers, ``ErrorTracking
Process`` children, ``sys.executable -c`` scripts). It reads ``KUAT_PARITY_MODE``:

- ``torch``: no swap (the reference: a test failing here is ``torch-own``);
- ``default``: ``kuat.DataLoader`` as is (``worker_type=None``);
- ``thread`` / ``process``: a subclass of ``kuat.DataLoader`` whose ``worker_type`` defaults to
  that value (an explicit ``worker_type=`` still wins).

Each run is a pytest process over a scratch copy of the file (a test that sets the
multiprocessing start method globally does not leave it to the tests after it: ``CONFTEST``),
with a per-test timeout (pytest-timeout, ``--timeout``) so no test can hang the run; a test past it ends its pytest
process (threads it left blocked would otherwise break the tests after it) and the run resumes
after it (``hung``), as it does after a test that kills the process (``crashed``).

Categories of the expectations file (why a test is allowed not to pass):
``internals`` (reads torch's iterator internals such as ``_workers``), ``layout`` (indexes
torchdata's state_dict layout), ``design`` (a documented kuat choice; ``ref`` names the
README/docs section), ``torch-own`` (fails on the reference class too), ``open`` (a real
difference not fixed yet; ``ref`` names the issue-29 class).

Usage (``make parity`` runs the first form with the two env vars)::

    python -m benchmarks.parity --torch-test PATH/test_dataloader.py \\
        --torchdata-test PATH/test_state_dict.py [--modes thread,process] [--timeout 60]
    python -m benchmarks.parity ... --modes torch      # the reference run
    python -m benchmarks.parity ... --update            # rewrite the expectations file

Exit status: 0 when no test fails that the expectations file does not list, 1 otherwise, 2 on
bad arguments. Needs pytest, pytest-timeout, and the suites' own imports (torch's
``torch.testing._internal`` needs ``expecttest``; torchdata's suite needs ``torchdata`` and
``parameterized``): ``pip install -e ".[parity]"``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXPECTED = REPO / "benchmarks" / "parity_expected.json"
MODES = ("torch", "default", "thread", "process")
CATEGORIES = ("internals", "layout", "design", "torch-own", "open")
PASSING = ("passed", "skipped", "xfailed")  # outcomes that are not a failure


@dataclass(frozen=True)
class Suite:
    """One third-party suite: the file name it is run as and where its path comes from."""

    name: str
    file_name: str
    env_var: str
    swaps_torchdata: bool


SUITES = {
    "torch": Suite("torch", "test_dataloader.py", "KUAT_PARITY_TORCH_TEST", False),
    "torchdata": Suite("torchdata", "test_state_dict.py", "KUAT_PARITY_TORCHDATA_TEST", True),
}

SITECUSTOMIZE = '''\
# Written by benchmarks/parity.py: swaps the loader class before any test module imports it.
import os as _os

_mode = _os.environ.get("KUAT_PARITY_MODE", "torch")
if _mode != "torch":
    import torch.utils.data as _tud
    import torch.utils.data.dataloader as _tdl

    import kuat as _kuat

    _Kuat = _kuat.DataLoader  # imports kuat.loader, which subclasses torch's real class
    if _os.environ.get("KUAT_PARITY_SWAP_TORCHDATA") == "1":
        # before the swap: torchdata subclasses torch's generic class (DataLoader[_T_co])
        import torchdata.stateful_dataloader as _sdl
        import torchdata.stateful_dataloader.stateful_dataloader as _sdl_mod
    if _mode in ("thread", "process"):

        import typing as _typing

        _T_co = _typing.TypeVar("_T_co", covariant=True)

        class DataLoader(_Kuat[_T_co]):  # generic, as torch's and kuat's (test_typing)
            """kuat.DataLoader whose worker_type defaults to the parity run's mode."""

            def __init__(self, *args, worker_type=_mode, **kwargs):
                super().__init__(*args, worker_type=worker_type, **kwargs)

        DataLoader.__qualname__ = "DataLoader"
        _Swap = DataLoader
    else:
        _Swap = _Kuat
    _tud.DataLoader = _Swap
    _tdl.DataLoader = _Swap
    if _os.environ.get("KUAT_PARITY_SWAP_TORCHDATA") == "1":
        _sdl.StatefulDataLoader = _Swap
        _sdl_mod.StatefulDataLoader = _Swap
'''

# Each test starts with the start method the run began with: torch's test_worker_init_fn_forkserver
# sets it to "forkserver" for the rest of the process (force=True) and never resets it, so every
# later test's worker processes then import torch on start (about 2.2 s of CPU each, torch's
# loader and kuat's alike) and TestIndividualWorkerQueue::test_ind_worker_queue (45 workers)
# took 130 s (kuat) and 270 s (torch's own loader) on a loaded 2-core machine instead of seconds:
# past --timeout, reported as a hang. Tests that want a start method pass their context.
CONFTEST = '''\
# Written by benchmarks/parity.py: no test leaves its multiprocessing start method to the next.
import multiprocessing as _mp

import pytest

_START = _mp.get_start_method(allow_none=True)


@pytest.fixture(autouse=True)
def _kuat_parity_start_method():
    yield
    if _mp.get_start_method(allow_none=True) != _START:
        _mp.set_start_method(_START, force=True)
'''

_VERBOSE_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|XFAIL|XPASS|ERROR)\b")
_VERBOSE_STATUS = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped",
                   "XFAIL": "xfailed", "XPASS": "passed", "ERROR": "failed"}


@dataclass
class Outcome:
    """One test's result: ``status`` in passed/failed/skipped/xfailed/hung/crashed; ``detail``
    is the first line of the failure message."""

    status: str
    detail: str = ""


@dataclass
class Comparison:
    """A run's results against the expectations of its suite and mode."""

    counts: dict
    new_failures: dict = field(default_factory=dict)   # {test: Outcome}
    newly_passing: list = field(default_factory=list)  # [test]
    expected_failing: dict = field(default_factory=dict)  # {test: Outcome}


def short_id(nodeid: str) -> str:
    """``file.py::Class::test`` or ``module.Class`` + ``test`` -> ``Class::test``."""
    return nodeid.split("::", 1)[1] if "::" in nodeid else nodeid


def sitecustomize_dir(root: Path) -> Path:
    """Write the class-swapping ``sitecustomize.py`` under ``root``; returns its folder."""
    d = Path(root) / "site"
    d.mkdir(parents=True, exist_ok=True)
    (d / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return d


def run_env(site: Path, suite: Suite, mode: str, extra_path: str = "") -> dict:
    """The environment of a run: the swap's folder, then this checkout's ``src`` (so the
    kuat under test is this tree's), then ``extra_path`` and any inherited ``PYTHONPATH``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    env = dict(os.environ)
    parts = [str(site), str(REPO / "src")] + [p for p in (extra_path, env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["KUAT_PARITY_MODE"] = mode
    env["KUAT_PARITY_SWAP_TORCHDATA"] = "1" if suite.swaps_torchdata else "0"
    env.setdefault("PYTHONHASHSEED", "0")
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return env


def parse_junit(path: Path) -> dict[str, Outcome]:
    """``{Class::test: Outcome}`` from a pytest junit xml file."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        tid = f"{cls}::{case.get('name')}" if cls else case.get("name")
        status, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                status = "failed"
                detail = (child.get("message") or "").strip().splitlines()[:1]
                detail = detail[0] if detail else child.tag
                break
            if child.tag == "skipped":
                status = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
                detail = (child.get("message") or "")[:200]
        out[tid] = Outcome(status, detail[:200])
    return out


def parse_verbose(log: str) -> dict[str, Outcome]:
    """``{Class::test: Outcome}`` from ``pytest -v`` output (used when no junit file was
    written because the pytest process died)."""
    out = {}
    for line in log.splitlines():
        m = _VERBOSE_LINE.match(line.strip())
        if m:
            out[short_id(m.group(1))] = Outcome(_VERBOSE_STATUS[m.group(2)])
    return out


def _pytest(args: list[str], env: dict, cwd: Path, limit_s: float, log: Path) -> int | None:
    """Run pytest with its output going to ``log`` (readable while it runs); the return code,
    or None when it outlived ``limit_s`` and was killed with its process group."""
    # only the plugin the run needs: faster start, and no third-party plugin changes a result
    cmd = [sys.executable, "-m", "pytest", "-p", "pytest_timeout", "-p", "no:cacheprovider", *args]
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            return p.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return None


def run_suite(suite: Suite, mode: str, source: Path, *, timeout_s: float = 60,
              run_limit_s: float = 3600, extra_path: str = "", log_dir: Path | None = None,
              only: tuple[str, ...] = (), log=print) -> dict[str, Outcome]:
    """Run one suite in one mode on a scratch copy of ``source``; ``{Class::test: Outcome}``.

    Every test is bounded by ``timeout_s`` (pytest-timeout, thread method: the pytest process
    ends, which a blocked thread cannot prevent); a pytest process that times out, dies or
    outlives ``run_limit_s`` is restarted after the test that was running, which is recorded
    as ``hung`` or ``crashed``. pytest's ``-v`` output goes to ``log_dir`` (kept) when given.
    """
    with tempfile.TemporaryDirectory(prefix=f"kuat-parity-{suite.name}-{mode}-") as tmp:
        tmp = Path(tmp)
        logs = Path(log_dir) if log_dir else tmp
        logs.mkdir(parents=True, exist_ok=True)
        site = sitecustomize_dir(tmp)
        work = tmp / "tests"
        work.mkdir()
        shutil.copy(source, work / suite.file_name)
        (work / "pytest.ini").write_text("[pytest]\naddopts =\n")  # not the repo's options
        (work / "conftest.py").write_text(CONFTEST)  # (start methods do not leak: CONFTEST)
        env = run_env(site, suite, mode, extra_path)
        collect_log = logs / f"{suite.name}-{mode}-collect.log"
        _pytest(["--collect-only", "-q", suite.file_name], env, work, 600, collect_log)
        out = collect_log.read_text()
        order = [short_id(line.strip()) for line in out.splitlines() if "::" in line]
        if not order:
            raise RuntimeError(f"{suite.name}/{mode}: nothing collected from {source}:\n"
                               f"{out[-3000:]}")
        if only:
            order = [t for t in order if any(o in t for o in only)]
        results: dict[str, Outcome] = {}
        remaining = order
        for attempt in range(len(order)):
            xml = tmp / f"junit{attempt}.xml"
            run_log = logs / f"{suite.name}-{mode}-run{attempt}.log"
            ids = [f"{suite.file_name}::{t}" for t in remaining]
            # thread method: a test past its limit ends the whole pytest process (after a stack
            # dump), so threads it left blocked cannot poison the tests after it
            rc = _pytest(["-v", f"--timeout={timeout_s}", "--timeout-method=thread",
                          f"--junitxml={xml}", *ids], env, work, run_limit_s, run_log)
            got = parse_junit(xml) if xml.exists() else parse_verbose(run_log.read_text())
            results.update(got)
            remaining = [t for t in remaining if t not in results]
            if not remaining:
                break
            if xml.exists() and rc is not None:
                # pytest finished but did not report these (e.g. a collection-time skip)
                for t in remaining:
                    results[t] = Outcome("crashed", "not reported by pytest")
                break
            dead = remaining.pop(0)
            text = run_log.read_text(errors="replace")
            if rc is not None and "+ Timeout +" in text:
                results[dead] = Outcome("hung", f"Timeout > {timeout_s:g} s (a hang); "
                                        "the test process was ended and the run resumed")
                why = "hung"
            else:
                why = "run limit reached" if rc is None else f"pytest died (rc={rc})"
                results[dead] = Outcome("crashed", why)
            log(f"  {suite.name}/{mode}: {dead} {why}; resuming after it")
            if not remaining:
                break
        return results


def load_expected(path: Path = EXPECTED) -> dict:
    """The expectations file: ``{"suites": {suite: {mode: {test: {"category", "reason",
    "ref"}}}}}``; raises ``ValueError`` on an unknown suite, mode or category."""
    data = json.loads(Path(path).read_text())
    for suite, modes in data.get("suites", {}).items():
        if suite not in SUITES:
            raise ValueError(f"{path}: unknown suite {suite!r} (not one of {tuple(SUITES)})")
        for mode, tests in modes.items():
            if mode not in MODES:
                raise ValueError(f"{path}: {suite}: unknown mode {mode!r} (not one of {MODES})")
            for t, e in tests.items():
                if e.get("category") not in CATEGORIES:
                    raise ValueError(f"{path}: {suite}/{mode} {t}: category "
                                     f"{e.get('category')!r} is not one of {CATEGORIES}")
    return data


def expected_for(expected: dict, suite: str, mode: str) -> dict:
    """``{test: entry}`` of the tests not expected to pass in ``suite`` under ``mode``."""
    return expected.get("suites", {}).get(suite, {}).get(mode, {})


def compare(results: dict[str, Outcome], expected: dict) -> Comparison:
    """Compare a run's ``results`` with ``expected`` (``{test: entry}`` for its suite and
    mode): a test that fails (or crashes) without an entry is a new failure; a test with an
    entry that passes is newly passing (the entry is stale: remove it)."""
    counts = {s: 0 for s in ("passed", "failed", "skipped", "xfailed", "hung", "crashed")}
    cmp = Comparison(counts)
    for t, o in results.items():
        counts[o.status] = counts.get(o.status, 0) + 1
        if o.status in PASSING:
            if t in expected and o.status == "passed":
                cmp.newly_passing.append(t)
        elif t in expected:
            cmp.expected_failing[t] = o
        else:
            cmp.new_failures[t] = o
    counts["expected"] = len(cmp.expected_failing)
    counts["new failures"] = len(cmp.new_failures)
    counts["newly passing"] = len(cmp.newly_passing)
    return cmp


def update_expected(expected: dict, suite: str, mode: str, results: dict[str, Outcome]) -> dict:
    """``expected`` with exactly the tests of ``suite`` that did not pass in ``results`` listed
    under ``mode``: an entry keeps its category and reason; a new one is ``open`` and says so;
    the entry of a test that passed goes."""
    tests = expected.setdefault("suites", {}).setdefault(suite, {}).setdefault(mode, {})
    for t, o in results.items():
        if o.status not in PASSING:
            tests.setdefault(t, {"category": "open", "reason": f"UNCLASSIFIED ({o.status}): "
                                 f"{o.detail}", "ref": ""})
        elif o.status == "passed":
            tests.pop(t, None)
    return expected


def _print_report(suite: str, mode: str, cmp: Comparison, elapsed_s: float) -> None:
    c = cmp.counts
    print(f"{suite:9s} {mode:8s} passed {c['passed']:4d}  failed {c['failed']:3d}  "
          f"hung {c['hung']:2d}  crashed {c['crashed']:2d}  skipped {c['skipped']:3d}  xfailed {c['xfailed']:2d}  "
          f"| expected {c['expected']:3d}  new failures {c['new failures']:3d}  "
          f"newly passing {c['newly passing']:3d}  ({elapsed_s:.0f} s)")
    for t, o in sorted(cmp.new_failures.items()):
        print(f"    NEW FAILURE {t}: {o.status} {o.detail}")
    for t in sorted(cmp.newly_passing):
        print(f"    newly passing (remove its entry) {t}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--torch-test", default=os.environ.get("KUAT_PARITY_TORCH_TEST"),
                    help="a local copy of pytorch's test/test_dataloader.py "
                         "(env KUAT_PARITY_TORCH_TEST)")
    ap.add_argument("--torchdata-test", default=os.environ.get("KUAT_PARITY_TORCHDATA_TEST"),
                    help="a local copy of torchdata's test/stateful_dataloader/"
                         "test_state_dict.py (env KUAT_PARITY_TORCHDATA_TEST)")
    ap.add_argument("--modes", default="thread,process",
                    help=f"comma-separated, of {', '.join(MODES)} (default thread,process)")
    ap.add_argument("--timeout", type=float, default=60.0, help="per-test limit, seconds")
    ap.add_argument("--run-limit", type=float, default=3600.0,
                    help="limit of one pytest process, seconds (it resumes after a kill)")
    ap.add_argument("--pythonpath", default=os.environ.get("KUAT_PARITY_PYTHONPATH", ""),
                    help="extra PYTHONPATH for the suites' own imports")
    ap.add_argument("--expected", type=Path, default=EXPECTED)
    ap.add_argument("--update", action="store_true",
                    help="rewrite the expectations file from this run (new entries: 'open')")
    ap.add_argument("--json", type=Path, help="also write every outcome to this file")
    ap.add_argument("--log-dir", type=Path, help="keep pytest's -v output of each run here")
    ap.add_argument("--only", default="", help="comma-separated substrings of Class::test "
                    "to run (the comparison then covers those tests only)")
    args = ap.parse_args(argv)

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        ap.error(f"--modes: {bad or modes} not in {MODES}")
    sources = {"torch": args.torch_test, "torchdata": args.torchdata_test}
    sources = {k: Path(v) for k, v in sources.items() if v}
    if not sources:
        ap.error("give --torch-test and/or --torchdata-test (or KUAT_PARITY_TORCH_TEST / "
                 "KUAT_PARITY_TORCHDATA_TEST): local copies; nothing is fetched")
    for k, p in sources.items():
        if not p.is_file():
            ap.error(f"{k} suite: {p} is not a file")
    expected = load_expected(args.expected)
    new_total, dump = 0, {}
    for name, source in sources.items():
        for mode in modes:
            t0 = time.monotonic()
            results = run_suite(SUITES[name], mode, source, timeout_s=args.timeout,
                                run_limit_s=args.run_limit, extra_path=args.pythonpath,
                                log_dir=args.log_dir,
                                only=tuple(o for o in args.only.split(",") if o))
            cmp = compare(results, expected_for(expected, name, mode))
            _print_report(name, mode, cmp, time.monotonic() - t0)
            sys.stdout.flush()
            new_total += len(cmp.new_failures)
            dump[f"{name}/{mode}"] = {t: [o.status, o.detail] for t, o in sorted(results.items())}
            if args.update:
                update_expected(expected, name, mode, results)
    if args.json:
        args.json.write_text(json.dumps(dump, indent=1) + "\n")
    if args.update:
        args.expected.write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.expected}")
        return 0
    return 1 if new_total else 0


if __name__ == "__main__":
    sys.exit(main())
