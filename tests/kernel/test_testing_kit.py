"""meshkit.testing: the fixtures work, and the contract suites catch real mistakes.

The broken components below are the mistakes plugin authors actually make.
Each is run through the contract suite in a separate, in-process pytest run
(``pytester``), and the test asserts that the suite fails it, on the test
that names the mistake, with a message a plugin author can act on.
"""

from __future__ import annotations

import textwrap
import types
from pathlib import Path

import pytest

import meshkit
import meshkit.plugins
from meshkit.errors import PluginError
from meshkit.testing import make_plugin_set

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _preload_heavy_modules() -> None:
    """Import what the inner pytest runs use before they start.

    ``runpytest_inprocess`` drops every module an inner run imported when it
    ends; numpy's C extensions cannot be imported twice in one process, so a
    second inner run would fail to re-import them.
    """
    import numpy.testing  # noqa: F401

    import meshkit.aggregation  # noqa: F401
    import meshkit.node.board  # noqa: F401
    from meshkit.testing import (  # noqa: F401
        AggregatorContract, BoardContract, OuterOptimizerContract)

    pset = meshkit.plugins.build_manager()
    pset.create("aggregator", "fedavg")


def _aggregator_plugin(name: str, factory) -> types.SimpleNamespace:
    records = lambda: [meshkit.Component(name, factory)]  # noqa: E731
    return types.SimpleNamespace(__name__=f"plugin-{name}",
                                 meshkit_aggregators=meshkit.hookimpl(records))


class _First:
    def aggregate(self, states, weights=None):
        return dict(states[0])


# -- fixtures ----------------------------------------------------------------


def test_meshkit_plugins_builds_a_set_of_just_the_given_plugins(meshkit_plugins):
    pset = meshkit_plugins(_aggregator_plugin("first", _First))
    assert list(pset.available("aggregator")) == ["first"]
    assert pset.available("aggregator")["first"].provenance.plugin == "plugin-first"
    assert pset.available("transport") == {}


def test_make_plugin_set_refuses_a_misspelled_hook():
    typo = types.SimpleNamespace(__name__="typo", meshkit_agregators=meshkit.hookimpl(lambda: []))
    with pytest.raises(PluginError, match="did you mean 'meshkit_aggregators'"):
        make_plugin_set(typo)


def test_meshkit_register_installs_a_default_for_one_test(meshkit_register):
    before = meshkit.plugins.default()
    pset = meshkit_register(_aggregator_plugin("first", _First), entry_points=False)
    assert meshkit.plugins.default() is pset
    assert isinstance(meshkit.plugins.create("aggregator", "first"), _First)
    assert before is not pset


def test_meshkit_register_keeps_the_installed_plugins(meshkit_register):
    meshkit_register(_aggregator_plugin("first", _First))
    names = meshkit.plugins.available("aggregator")
    assert "first" in names and "fedavg" in names


def test_registering_an_installed_plugin_does_not_load_it_twice(meshkit_register):
    # A plugin under test is usually installed too (pip install -e .): its
    # entry point is skipped rather than loaded a second time.
    import meshkit_aggregators

    pset = meshkit_register(meshkit_aggregators)
    assert pset.failures == []
    assert "fedavg" in meshkit.plugins.available("aggregator")
    assert "aggregators" not in {p.name for p in pset.loaded}


def test_meshkit_register_restores_the_previous_default(pytester):
    pytester.makepyfile(textwrap.dedent("""
        import types
        import meshkit, meshkit.plugins

        plugin = types.SimpleNamespace(__name__="p", meshkit_aggregators=meshkit.hookimpl(
            lambda: [meshkit.Component("mine", object)]))
        original = meshkit.plugins.build_manager([], entry_points=False)

        def test_a(meshkit_register):
            meshkit.plugins.reset(original)
            meshkit_register(plugin, entry_points=False)
            assert "mine" in meshkit.plugins.available("aggregator")

        def test_b():
            assert meshkit.plugins.default() is original
    """))
    pytester.runpytest_inprocess("-p", "no:randomly").assert_outcomes(passed=2)


def test_the_contracts_load_lazily():
    # meshkit.testing is imported into every pytest run of every meshkit user:
    # the suites (and numpy) must load only when named.
    import subprocess
    import sys

    code = ("import sys, meshkit.testing; "
            "assert 'numpy' not in sys.modules, 'numpy imported'; "
            "assert 'meshkit.testing.aggregator' not in sys.modules; "
            "meshkit.testing.AggregatorContract; "
            "assert 'meshkit.testing.aggregator' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- the suites catch real mistakes ---------------------------------------------

BROKEN = '''
import types

import numpy as np

import meshkit
from meshkit.aggregation import MeanFold, aggregate_by_folding
from meshkit.node.board import BoardError
from meshkit.testing import AggregatorContract, BoardContract, OuterOptimizerContract


class FirstContribution:
    """Checks everything, then returns the first contribution as "the mean"."""

    def aggregate(self, states, weights=None):
        aggregate_by_folding(MeanFold(weighted=True), states, weights)  # strict checks
        return {k: (v.copy() if isinstance(v, np.ndarray) else v)
                for k, v in states[0].items()}


class SubsetMean:
    """Averages each key over the contributors that sent it: a missing key is skipped."""

    def aggregate(self, states, weights=None):
        if not states:
            raise meshkit.AggregationError("no contributions")
        weights = [1.0] * len(states) if weights is None else list(weights)
        if len(weights) != len(states) or any(not w >= 0 or w == float("inf")
                                              for w in weights) or sum(weights) == 0:
            raise meshkit.AggregationError(f"bad weights {weights}")
        keys = {k for s in states for k in s}
        out = {}
        for k in keys:
            have = [(s[k], w) for s, w in zip(states, weights) if k in s]
            first = have[0][0]
            for v, _ in have:
                if not isinstance(v, np.ndarray) or v.shape != first.shape or v.dtype != first.dtype:
                    raise meshkit.AggregationError(f"key {k!r} disagrees")
            total = sum(w for _, w in have)
            acc = sum(v.astype(np.float64) * (w / total) for v, w in have)
            out[k] = acc.astype(first.dtype) if len(have) > 1 else first.copy()
        return out


class SizeBlindBoard:
    """Declares 8 values in and out, then runs whatever it is given."""

    descriptor = meshkit.FixedFunction("mlp.0", 8, 8, "float32")

    def execute(self, x):
        return (np.asarray(x, dtype=np.float32) * 2).astype(np.float32)


class WrongSign:
    """Adam-free momentum that ascends: g taken as consensus - global."""

    def __init__(self):
        self.b = None

    def step(self, x, c):
        out = {}
        for k in x:
            g = c[k].astype(np.float64) - x[k]        # the wrong sign
            out[k] = (x[k] - 0.5 * g).astype(x[k].dtype)
        return out

    def state_dict(self):
        return {}

    def load_state_dict(self, d):
        pass


class LiveStateDict:
    """Momentum whose state_dict() hands out its live buffers."""

    def __init__(self):
        self.b = {}

    def step(self, x, c):
        if set(c) != set(x):
            raise meshkit.AggregationError(f"keys differ: {sorted(set(x) ^ set(c))}")
        out = {}
        for k in x:
            g = x[k].astype(np.float64) - c[k]
            b = self.b.setdefault(k, np.zeros(x[k].shape))
            b *= 0.9
            b += g                                     # updated in place...
            out[k] = (x[k] - 0.5 * b).astype(x[k].dtype)
        return out

    def state_dict(self):
        return {"b": self.b}                           # ...and handed out live

    def load_state_dict(self, d):
        self.b = {k: v.copy() for k, v in d["b"].items()}


class FloatsOnly:
    """Steps the float parameters and silently drops everything else."""

    def step(self, x, c):
        if set(c) != set(x):
            raise meshkit.AggregationError(f"keys differ: {sorted(set(x) ^ set(c))}")
        # "V" is bfloat16 (ml_dtypes): still a float parameter.
        return {k: np.asarray(c[k]) for k in c
                if isinstance(c[k], np.ndarray) and c[k].dtype.kind in "fV"}

    def state_dict(self):
        return {}

    def load_state_dict(self, d):
        pass


def _records(kind, **factories):
    return lambda: [meshkit.Component(name, f) for name, f in factories.items()]


broken = types.SimpleNamespace(
    __name__="broken",
    meshkit_aggregators=meshkit.hookimpl(_records("aggregator", first=FirstContribution,
                                                  subset=SubsetMean)),
    meshkit_boards=meshkit.hookimpl(_records("board", blind=SizeBlindBoard)),
    meshkit_outer_optimizers=meshkit.hookimpl(_records("outer", wrongsign=WrongSign,
                                                       live=LiveStateDict,
                                                       floatsonly=FloatsOnly)),
)


class TestFirstContribution(AggregatorContract):
    component = "first"
    plugins = [broken]
    weighted = True


class TestSubsetMean(AggregatorContract):
    component = "subset"
    plugins = [broken]
    weighted = True


class TestSizeBlindBoard(BoardContract):
    component = "blind"
    plugins = [broken]


class TestWrongSign(OuterOptimizerContract):
    component = "wrongsign"
    plugins = [broken]


class TestLiveStateDict(OuterOptimizerContract):
    component = "live"
    plugins = [broken]


class TestFloatsOnly(OuterOptimizerContract):
    component = "floatsonly"
    plugins = [broken]
'''


@pytest.fixture
def contract_run(pytester):
    pytester.makepyfile(test_broken=BROKEN)
    result = pytester.runpytest_inprocess("-p", "no:randomly", "-p", "no:cacheprovider",
                                          "-rf", "--tb=line")
    failed = {r.nodeid.split("::", 1)[1] for r in result.reprec.getreports("pytest_runtest_logreport")
              if r.when == "call" and r.failed}
    return result, failed


def _failures(failed: set[str], cls: str) -> set[str]:
    return {name.split("::", 1)[1].split("[")[0] for name in failed if name.startswith(cls + "::")}


def test_the_contract_suites_catch_real_mistakes(contract_run):
    result, failed = contract_run
    text = result.stdout.str()

    # An aggregator that returns the first contribution passes every strictness
    # check, and is caught by the semantics.
    first = _failures(failed, "TestFirstContribution")
    assert {"test_the_order_of_contributors_does_not_matter",
            "test_the_result_depends_on_every_contributor",
            "test_the_weights_change_the_result"} <= first
    assert "the aggregator follows contributor 0 alone" in text

    # One that averages over the contributors that have a key.
    subset = _failures(failed, "TestSubsetMean")
    assert "test_a_missing_key_is_refused_naming_it" in subset
    assert "contributor 1 lacks key 'b': expected meshkit.AggregationError, but the " \
           "aggregator returned a result" in text

    # A board that ignores its declared size.
    blind = _failures(failed, "TestSizeBlindBoard")
    assert blind == {"test_a_wrong_input_size_is_refused"}
    assert "the board accepted an activation of 7 values although its descriptor says 8" in text

    # An outer optimizer with the wrong sign, and one whose checkpoint is a live view.
    assert "test_the_first_step_moves_toward_the_consensus" in _failures(failed, "TestWrongSign")
    assert "the pseudo-gradient is g = global - consensus" in text
    assert _failures(failed, "TestLiveStateDict") == {
        "test_state_dict_is_a_snapshot_not_a_live_view",
        # It also only knows float arrays: a JSON value breaks its step.
        "test_integer_arrays_and_json_values_survive_a_step"}

    # One that steps the floats and silently drops integer arrays and JSON values.
    assert _failures(failed, "TestFloatsOnly") == {
        "test_integer_arrays_and_json_values_survive_a_step"}
    assert "an outer optimizer must keep integer arrays and JSON values" in text


def test_a_correct_component_passes_the_same_harness(pytester):
    pytester.makepyfile(test_good=textwrap.dedent("""
        from meshkit.testing import AggregatorContract, BoardContract

        class TestFedAvg(AggregatorContract):
            component = "fedavg"
            weighted = True
    """))
    result = pytester.runpytest_inprocess("-p", "no:randomly", "-q")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes["passed"] > 20


def test_a_suite_without_a_component_says_what_to_set(pytester):
    pytester.makepyfile(test_empty=textwrap.dedent("""
        from meshkit.testing import AggregatorContract

        class TestNothing(AggregatorContract):
            pass
    """))
    result = pytester.runpytest_inprocess("-p", "no:randomly", "-x")
    result.stdout.fnmatch_lines(["*TestNothing: set `component = \"<registered name>\"`*"])


# -- a trimmed mean that forgets to sort (issue 13) ---------------------------------

UNSORTED = '''
import types

import numpy as np

import meshkit
from meshkit_aggregators.robust import RobustRule
from meshkit.testing import AggregatorContract


class UnsortedTrimmedMean(RobustRule):
    """The classic slip: cut int(0.2 * n) rows from each end without sorting them first."""

    name = "unsorted-trimmed-mean"

    def combine(self, x, w):
        n = len(x)
        k = int(0.2 * n)
        return x[k:n - k].mean(axis=0)


wrong = types.SimpleNamespace(__name__="wrong", meshkit_aggregators=meshkit.hookimpl(
    lambda: [meshkit.Component("unsorted-trimmed-mean", UnsortedTrimmedMean)]))


class TestUnsortedTrimmedMean(AggregatorContract):
    component = "unsorted-trimmed-mean"
    plugins = [wrong]


class TestUnsortedTrimmedMeanDeclaredRobust(AggregatorContract):
    component = "unsorted-trimmed-mean"
    plugins = [wrong]
    robust = True


# The built-in rules, declared as they are (each contributor counts once).
class TestTrimmedMean(AggregatorContract):
    component = "trimmed-mean"
    options = {"beta": 0.2}
    robust = True


class TestMedian(AggregatorContract):
    component = "median"
    robust = True
    reference = staticmethod(lambda values, weights: np.median(values, axis=0))
'''


def test_the_aggregator_contract_catches_a_trimmed_mean_that_forgets_to_sort(pytester):
    pytester.makepyfile(test_unsorted=UNSORTED)
    result = pytester.runpytest_inprocess("-p", "no:randomly", "-p", "no:cacheprovider",
                                          "--tb=short")
    reports = [r for r in result.reprec.getreports("pytest_runtest_logreport")
               if r.when == "call"]
    failed = {r.nodeid.split("::", 1)[1] for r in reports if r.failed}
    passed = {r.nodeid.split("::", 1)[1] for r in reports if r.passed}
    text = result.stdout.str()

    # With 4 contributors trim = 0.2 cuts nothing, so the small-round checks
    # all pass it; the many-contributors one does not.
    assert _failures(failed, "TestUnsortedTrimmedMean") == {
        "test_many_contributors_in_any_order_give_one_result"}
    assert "does it trim or select by position instead of sorting the values?" in text
    # Declared robust, a wild value arriving mid-round survives its cut.
    assert {n for n in failed if n.startswith("TestUnsortedTrimmedMeanDeclaredRobust::")} == {
        "TestUnsortedTrimmedMeanDeclaredRobust::"
        "test_many_contributors_in_any_order_give_one_result",
        "TestUnsortedTrimmedMeanDeclaredRobust::"
        "test_one_wild_contributor_cannot_drag_a_robust_result[in the middle]"}
    assert "dragged the result out of the honest contributions' range" in text

    # The built-in trimmed mean and median pass every check, the new ones included.
    assert not {n for n in failed if n.startswith(("TestTrimmedMean::", "TestMedian::"))}
    for cls in ("TestTrimmedMean", "TestMedian"):
        assert {"test_many_contributors_in_any_order_give_one_result",
                "test_one_wild_contributor_cannot_drag_a_robust_result"} <= _failures(passed, cls)
    assert "TestMedian::test_many_contributors_match_the_declared_reference" in passed
