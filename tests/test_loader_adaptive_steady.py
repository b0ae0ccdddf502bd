"""The iterator's per-batch shortcuts into the adaptive policy (issue 31: fewer calls per batch
in the loop's thread) answer as the full questions do.

``Adaptation.steady()`` stands for asking ``processes_wanted`` and ``inline_wanted`` (both
``NO``, nothing changed); ``Adaptation.watching`` False stands for the loop's time being unused
(``loop_resumed``/``loop_paused`` skipped). Every combination of the states they read is
checked against the full questions.
"""

import copy
import itertools

import hypothesis
from hypothesis import strategies as st

from kuat.engine.base import WorkStats
from kuat.engine.isolate import RngUse
from kuat.loader import _adaptive
from kuat.loader._adaptive import NO, Adaptation


def _states():
    """Adaptation objects over every combination of what the switch questions read."""
    for (auto, thread, draws, seeded, moved, may_inline, chosen, cheap_policy, seen, cheap,
         blocked, loop_heavy) in itertools.product(*[(False, True)] * 12):
        use = RngUse()
        use.draws, use.worker_seeded = draws, seeded
        a = Adaptation(num_workers=2, inline=False, prefetch_factor=2, adaptive=True,
                       thread_engine=thread, consumer_may_fetch=True, agnostic=False,
                       split_first=False, auto_processes=auto, rng_use=use)
        a._move = ("process", 2) if moved else None
        a.may_go_inline = may_inline
        a._inline_chosen = chosen
        a._cheap_policy = cheap_policy
        n = _adaptive.INLINE_PROBE if seen else 3
        a._seen, a._cheap, a.blocked = n, n if cheap else 0, n if blocked else 0
        a._work_s, a._loop_s = 1.0, (10.0 if loop_heavy else 0.0)
        a._watch()
        yield a


def test_steady_means_both_questions_answer_no_and_change_nothing():
    steady = 0
    for a in _states():
        if not a.steady():
            continue
        steady += 1
        for busy in (False, True):
            b = copy.copy(a)
            before = dict(vars(b))
            assert b.processes_wanted(busy=busy) == NO
            assert b.inline_wanted(busy=busy) == NO
            assert vars(b) == before  # (the questions changed nothing either)
    assert steady > 0


def test_not_steady_when_either_question_may_answer_otherwise():
    for a in _states():
        answers = {(copy.copy(a).processes_wanted(busy=busy), copy.copy(a).inline_wanted(busy=busy))
                   for busy in (False, True)}
        if answers != {(NO, NO)}:
            assert not a.steady()


def test_loop_time_unused_once_not_watching():
    for a in _states():
        if a.watching:
            continue
        answers = set()
        for loop_s in (0.0, 1e9):  # what loop_resumed would have added
            b = copy.copy(a)
            b._loop_s = loop_s
            answers.add(b.inline_wanted(busy=False))
        assert len(answers) == 1 and a._choice is None


def test_watching_stops_when_the_cheap_batch_test_rejects_the_epoch():
    a = Adaptation(num_workers=1, inline=False, prefetch_factor=2, adaptive=True,
                   thread_engine=True, consumer_may_fetch=True, agnostic=False,
                   split_first=False, auto_processes=False, rng_use=RngUse())
    assert a.watching
    a._seen, a._cheap, a.blocked = _adaptive.INLINE_PROBE, 0, _adaptive.INLINE_PROBE
    assert not a.steady()  # (the test is due: ask)
    assert a.inline_wanted(busy=False) == NO
    assert not a.watching and a.steady()


def _result(cheap: bool):
    ws = WorkStats()  # (a worker's measure of one batch: cheap, or 2x the cheap bound)
    ws.fetch_s = ws.fetch_cpu_s = _adaptive.CHEAP_BATCH_S / (10 if cheap else 0.5)
    return ws


@hypothesis.given(st.lists(st.booleans(), min_size=1, max_size=_adaptive.INLINE_PROBE))
def test_the_cheap_batch_test_stops_watching_once_its_answer_is_no(cheap_flags):
    # the first INLINE_PROBE results, cheap or not: watching the loop stops at the result that
    # makes "at least 75% of them cheap" impossible, and only then; inline_wanted's answer at
    # the probe (all of them seen, the loop blocked every time, its own time nil) is NO exactly
    # when it stopped
    a = Adaptation(num_workers=1, inline=False, prefetch_factor=2, adaptive=True,
                   thread_engine=True, consumer_may_fetch=True, agnostic=False,
                   split_first=False, auto_processes=False, rng_use=RngUse())
    flags = cheap_flags + [True] * (_adaptive.INLINE_PROBE - len(cheap_flags))
    for i, cheap in enumerate(flags, 1):
        a.on_result(_result(cheap))
        impossible = flags[:i].count(False) > _adaptive.INLINE_PROBE * 0.25
        assert a.watching == (not impossible), (i, flags)
    a.blocked = a._seen
    assert (a.inline_wanted(busy=False) == NO) == (flags.count(False) > _adaptive.INLINE_PROBE * 0.25)
