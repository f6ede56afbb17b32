"""The built-in task passes meshkit's task contract suite, and the suite catches mistakes."""

from __future__ import annotations

import textwrap

from meshkit.testing import TaskContract

pytest_plugins = ["pytester"]


class TestDigits(TaskContract):
    component = "digits"


BROKEN = '''
import numpy as np

from meshkit.task import FitResult
from meshkit.testing import TaskContract
from meshkit_tasks.digits import DigitsTask


class Unseeded(DigitsTask):
    """Ignores the seed it is given: every node trains differently."""

    def fit(self, state, x, y, *, seed):
        return super().fit(state, x, y, seed=int(np.random.default_rng().integers(1 << 30)))


class InPlace(DigitsTask):
    """Trains the caller's arrays in place, and reports its work as a float."""

    def fit(self, state, x, y, *, seed):
        result = super().fit(state, x, y, seed=seed)
        for key, value in result.state.items():
            state[key][...] = value
        return FitResult(state=state, examples=float(len(x)), metrics=result.metrics)


class Crashes(DigitsTask):
    """Trips over a state that lacks a key instead of refusing it by name."""

    def fit(self, state, x, y, *, seed):
        if len(state) < len(self.init_state(0)):
            raise AttributeError("'NoneType' object has no attribute 'shape'")
        return super().fit(state, x, y, seed=seed)


class TestUnseeded(TaskContract):
    component = "test_broken_tasks:Unseeded"


class TestCrashes(TaskContract):
    component = "test_broken_tasks:Crashes"


class TestInPlace(TaskContract):
    component = "test_broken_tasks:InPlace"
'''


def test_the_task_contract_catches_real_mistakes(pytester):
    pytester.makepyfile(test_broken_tasks=BROKEN)
    pytester.syspathinsert()
    result = pytester.runpytest_inprocess("-p", "no:randomly", "-p", "no:cacheprovider",
                                          "--tb=line", "-q")
    failed = {r.nodeid.split("::", 1)[1].split("[")[0]
              for r in result.reprec.getreports("pytest_runtest_logreport")
              if r.when == "call" and r.failed}
    text = result.stdout.str()
    assert "TestUnseeded::test_fit_is_deterministic_given_its_seed" in failed
    assert "fit(seed=7) of a second task on the same shard" in text
    assert {"TestInPlace::test_fit_and_evaluate_modify_none_of_their_inputs",
            "TestInPlace::test_fit_keeps_the_model_layout_and_reports_work_and_metrics"} <= failed
    assert "must be the realized work as a positive int" in text
    # A crash is not a refusal (before, any exception passed this check).
    assert "TestCrashes::test_fit_refuses_a_state_that_lacks_a_key" in failed
    assert "raised AttributeError: 'NoneType' object has no attribute 'shape', which does " \
           "not name the missing key: that is a crash, not a refusal" in text
    # The correct parts of each still pass.
    assert "TestCrashes::test_fit_is_deterministic_given_its_seed" not in failed
    assert "TestUnseeded::test_evaluate_returns_finite_named_numbers" not in failed


def test_a_task_suite_without_a_component_says_what_to_set(pytester):
    pytester.makepyfile(test_empty=textwrap.dedent("""
        from meshkit.testing import TaskContract

        class TestNothing(TaskContract):
            pass
    """))
    result = pytester.runpytest_inprocess("-p", "no:randomly", "-x", "-q")
    assert "set `component = " in result.stdout.str()


class TestSynthetic(TaskContract):
    component = "synthetic"
    options = {"params": 1000, "arrays": 3, "rows": 256}


class TestSyntheticBfloat16(TaskContract):
    component = "synthetic"
    options = {"params": 100, "dtype": "bfloat16", "rows": 128}


class TestSyntheticFederated(TaskContract):
    component = "synthetic-federated"
    options = {"clients": 100_000, "eval_clients": 8}
