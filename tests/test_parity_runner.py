"""benchmarks/parity.py, the opt-in run of torch's and torchdata's own suites (issue #29): its own
logic, without the third-party files (the class swap, resuming after a crash or a hang, the
comparison with the expectations file)."""

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest

from benchmarks import parity

SWAP_CHECK = textwrap.dedent("""
    import multiprocessing as mp
    import torch.utils.data as tud
    import torch.utils.data.dataloader as tdl

    def where():
        import torch.utils.data as d
        return d.DataLoader.__module__, getattr(d.DataLoader([0]), "worker_type", None)

    if __name__ == "__main__":
        import kuat
        swapped = tud.DataLoader is tdl.DataLoader and issubclass(tud.DataLoader, kuat.DataLoader)
        with mp.get_context("spawn").Pool(1) as pool:
            child = pool.apply(where)
        try:  # torchdata's suite: StatefulDataLoader swapped too, its module still importable
            import torchdata.stateful_dataloader as sdl
            stateful = sdl.StatefulDataLoader is tud.DataLoader
        except ImportError:
            stateful = "no-torchdata"
        print(swapped, tud.DataLoader([0]).worker_type, *child, stateful)
""")
REFERENCE_CHECK = "import torch.utils.data as d; print(d.DataLoader.__module__)"


def _run_swap_check(tmp_path, mode, code=SWAP_CHECK, suite="torch"):
    site = parity.sitecustomize_dir(tmp_path)
    script = tmp_path / "check.py"
    script.write_text(code)
    env = parity.run_env(site, parity.SUITES[suite], mode)
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.split()


def test_sitecustomize_swaps_the_class_with_the_mode_as_default_worker_type(tmp_path):
    # the main process and a spawned child both see kuat's class, worker_type set by the mode
    has_torchdata = importlib.util.find_spec("torchdata") is not None
    out = _run_swap_check(tmp_path, "process", suite="torchdata" if has_torchdata else "torch")
    assert out == ["True", "process", "sitecustomize", "process",
                   "True" if has_torchdata else "no-torchdata"]


def test_reference_mode_keeps_torchs_class(tmp_path):
    assert _run_swap_check(tmp_path, "torch", REFERENCE_CHECK) == ["torch.utils.data.dataloader"]


FAKE_SUITE = textwrap.dedent("""
    import os
    import time
    import unittest

    class TestFake(unittest.TestCase):
        def test_a_passes(self):
            pass

        def test_b_fails(self):
            self.assertEqual(1, 2)

        def test_c_kills_the_test_process(self):
            os._exit(3)

        def test_d_hangs(self):
            time.sleep(600)

        @unittest.skip("needs CUDA")
        def test_e_skipped(self):
            pass
""")


def test_run_suite_bounds_hangs_and_resumes_after_a_dead_test_process(tmp_path):
    src = tmp_path / "fake.py"
    src.write_text(FAKE_SUITE)
    logged = []
    results = parity.run_suite(parity.SUITES["torch"], "torch", src, timeout_s=2,
                               log=logged.append)
    status = {t: o.status for t, o in results.items()}
    assert status == {"TestFake::test_a_passes": "passed", "TestFake::test_b_fails": "failed",
                      "TestFake::test_c_kills_the_test_process": "crashed",
                      "TestFake::test_d_hangs": "hung", "TestFake::test_e_skipped": "skipped"}
    assert "Timeout" in results["TestFake::test_d_hangs"].detail
    assert len(logged) == 2 and "test_c_kills_the_test_process" in logged[0]


LEAKY_SUITE = textwrap.dedent("""
    import multiprocessing as mp
    import unittest

    START = mp.get_start_method(allow_none=True)

    class TestLeak(unittest.TestCase):
        def test_a_sets_forkserver_for_good(self):  # as torch's test_worker_init_fn_forkserver
            mp.set_start_method("forkserver", force=True)

        def test_b_starts_with_the_runs_start_method(self):
            self.assertEqual(mp.get_start_method(allow_none=True), START)
""")


def test_a_start_method_set_by_one_test_does_not_reach_the_next(tmp_path):
    # torch's test_worker_init_fn_forkserver leaked "forkserver" to every later test, whose
    # workers then each imported torch: test_ind_worker_queue ran past --timeout (a "hang")
    src = tmp_path / "leaky.py"
    src.write_text(LEAKY_SUITE)
    results = parity.run_suite(parity.SUITES["torch"], "torch", src, timeout_s=60)
    assert {t: o.status for t, o in results.items()} == {
        "TestLeak::test_a_sets_forkserver_for_good": "passed",
        "TestLeak::test_b_starts_with_the_runs_start_method": "passed"}


def test_compare_flags_a_new_failure_and_a_stale_entry():
    Out = parity.Outcome
    results = {"T::ok": Out("passed"), "T::listed": Out("failed", "x"), "T::new": Out("failed", "boom"),
               "T::now_ok": Out("passed"), "T::cuda": Out("skipped"), "T::died": Out("crashed")}
    expected = {"T::listed": {"category": "internals"}, "T::now_ok": {"category": "open"}}
    cmp = parity.compare(results, expected)
    assert set(cmp.new_failures) == {"T::new", "T::died"}
    assert cmp.newly_passing == ["T::now_ok"]
    assert set(cmp.expected_failing) == {"T::listed"}
    assert cmp.counts["passed"] == 2 and cmp.counts["new failures"] == 2


def test_expectations_are_per_suite_and_mode_and_update_keeps_reasons():
    Out = parity.Outcome
    exp = {"suites": {"torch": {
        "thread": {"T::a": {"category": "internals", "reason": "reads _workers", "ref": ""},
                   "T::b": {"category": "design", "reason": "r", "ref": "docs/loader.md"}},
        "process": {"T::a": {"category": "internals", "reason": "reads _workers", "ref": ""}},
    }}}
    assert set(parity.expected_for(exp, "torch", "process")) == {"T::a"}
    assert parity.expected_for(exp, "torchdata", "thread") == {}
    parity.update_expected(exp, "torch", "thread",
                           {"T::a": Out("failed"), "T::b": Out("passed"), "T::c": Out("hung", "msg")})
    thread = exp["suites"]["torch"]["thread"]
    assert thread["T::a"]["reason"] == "reads _workers"
    assert "T::b" not in thread  # it passes now: the entry goes
    assert thread["T::c"]["category"] == "open" and "msg" in thread["T::c"]["reason"]
    assert set(exp["suites"]["torch"]["process"]) == {"T::a"}


def test_parsers_read_junit_and_verbose_output(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="test_x.TestA" name="test_ok"/>'
        '<testcase classname="test_x.TestA" name="test_bad"><failure message="AssertionError: 1 != 2">'
        'tb</failure></testcase>'
        '<testcase classname="test_x.TestA" name="test_skip"><skipped type="pytest.skip" message="CUDA"/>'
        '</testcase><testcase classname="test_x.TestA" name="test_xf">'
        '<skipped type="pytest.xfail" message=""/></testcase>'
        '</testsuite></testsuites>')
    got = {t: (o.status, o.detail) for t, o in parity.parse_junit(xml).items()}
    assert got == {"TestA::test_ok": ("passed", ""),
                   "TestA::test_bad": ("failed", "AssertionError: 1 != 2"),
                   "TestA::test_skip": ("skipped", "CUDA"), "TestA::test_xf": ("xfailed", "")}
    log = "test_x.py::TestA::test_ok PASSED   [ 50%]\ntest_x.py::TestA::test_bad FAILED [100%]\n"
    assert {t: o.status for t, o in parity.parse_verbose(log).items()} == {
        "TestA::test_ok": "passed", "TestA::test_bad": "failed"}


def test_committed_expectations_file_is_valid(tmp_path):
    exp = parity.load_expected()
    for suite, modes in exp["suites"].items():
        for mode, tests in modes.items():
            for t, e in tests.items():
                assert e["reason"], (suite, mode, t)
                if e["category"] in ("design", "open"):
                    assert e["ref"], f"{suite}/{mode} {t}: a {e['category']} entry names its reference"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"suites": {"torch": {"thread": {"T::x": {"category": "flaky"}}}}}))
    with pytest.raises(ValueError, match="flaky"):
        parity.load_expected(bad)


def test_main_needs_local_copies_and_fetches_nothing(monkeypatch, capsys):
    monkeypatch.delenv("KUAT_PARITY_TORCH_TEST", raising=False)
    monkeypatch.delenv("KUAT_PARITY_TORCHDATA_TEST", raising=False)
    with pytest.raises(SystemExit) as e:
        parity.main([])
    assert e.value.code == 2 and "nothing is fetched" in capsys.readouterr().err
