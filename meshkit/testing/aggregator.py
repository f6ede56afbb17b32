"""The aggregator contract suite.

Subclass :class:`AggregatorContract` in a test module and point it at your
component; pytest collects the inherited tests::

    class TestMedian(AggregatorContract):
        component = "median"            # the registered name
        options = {}                    # the config table, if any
        weighted = True                 # weight k behaves as k copies
        reference = staticmethod(lambda values, weights: np.median(values, axis=0))

What it checks is meshkit's aggregation contract: strictness (a missing key,
a shape or dtype that disagrees, zero contributors, a bad weight, each is an
:class:`meshkit.AggregationError` naming the key), dtype preservation, values
in float32, float16 and bfloat16 as in float64, no mutation of any input (the
states, the weights list, the round's reference; batch and streaming),
independence from the order contributors arrive in, weighted semantics when
declared, and that the streaming form (``begin()``) gives what the batch form
gives.

The rule's declared :class:`meshkit.AggregatorTraits` decide the rest:

* ``uses_reference``: every call gets the round's reference (``reference=``,
  a state of the contributions' keys and dtypes,
  :func:`meshkit.testing.support.round_reference`), as a round passes it.
  Identity is checked *at the reference* (contributions equal to it give it
  back bit for bit), not as one contributor back unchanged (a clipping rule
  clips it), and updates must be measured from it (the same updates around a
  moved reference move the result with it);
* ``stateful``: no first-round identity is assumed; ``state_dict()`` must
  survive a real checkpoint and give the next round exactly;
* ``linear``: the result must be ``Σ ωᵢ xᵢ / Σ ωᵢ`` with ``ωᵢ =
  weight(wᵢ)``, checked in every float dtype with no ``reference`` needed;
* otherwise (a mean, a median, a selection) one contributor comes back bit
  for bit and identical contributions give that contribution; and a rule
  that declares no state must keep none (a round on a used aggregator equals
  the same round on a fresh one).

Small rounds hide the mistakes of rules that select or cut contributors: a
trimmed mean with ``trim = 0.2`` cuts nothing from 4 contributors, so one that
forgets to sort passes every check made with 4. The many-contributors checks
therefore use :data:`MANY` contributors whose values are arranged against the
arrival order (the extremes arrive in the middle, central values first and
last), so that a rule cutting by position instead of by value gives another
result for another arrival order, misses its declared ``reference``, or, when
it declares ``robust``, lets one wild contributor drag it away.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, Sequence

import numpy as np
import pytest

from meshkit.aggregation import AggregatorTraits, BufferingFold, begin, linear_weight
from meshkit.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from meshkit.errors import AggregationError
from meshkit.wire import encode_state
from meshkit.testing.support import (
    ContractBase,
    assert_states_close,
    assert_states_identical,
    bfloat16,
    declared_traits,
    float_dtypes,
    model_states,
    round_reference,
    snapshot,
    tolerance,
)

__all__ = ["AggregatorContract", "MANY"]

State = Mapping[str, Any]

#: ``aggregate(..., reference=AUTO)``: the suite's own round reference for the states.
AUTO: Any = object()

#: Contributors in the many-contributors checks: enough that trimming any
#: fraction from 1/40 up cuts at least one whole contributor from each end.
MANY = 40


def _contributions(n: int, dtype: Any = np.float32, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [
        {"w": rng.standard_normal((3, 4)).astype(dtype),
         "b": rng.standard_normal(5).astype(dtype)}
        for _ in range(n)
    ]


def _adversarial(n: int = MANY, seed: int = 12) -> list[dict[str, Any]]:
    """``n`` float64 contributions whose extremes arrive in the middle.

    Per coordinate the values are distinct and heavy-tailed (Student t, two
    degrees of freedom). The first and last quarter of the arrival order hold
    the central values and the middle half the extremes, shuffled
    independently for every coordinate, so a rule that trims or selects by
    arrival position keeps exactly what it should have cut.
    """
    rng = np.random.default_rng(seed)
    shapes = {"w": (3, 4), "b": (5,)}
    size = sum(int(np.prod(s)) for s in shapes.values())
    ranked = np.sort(rng.standard_t(2, size=(n, size)) * 3.0, axis=0)
    by_centrality = np.argsort(np.abs(np.arange(n) - (n - 1) / 2), kind="stable")
    central, extreme = by_centrality[: n // 2], by_centrality[n // 2:]
    quarter = n // 4
    ends = np.r_[0:quarter, n - (n // 2 - quarter):n]
    middle = np.setdiff1d(np.arange(n), ends)
    values = np.empty_like(ranked)
    for j in range(size):
        values[ends, j] = ranked[rng.permutation(central), j]
        values[middle, j] = ranked[rng.permutation(extreme), j]
    states = []
    for row in values:
        state, start = {}, 0
        for key, shape in shapes.items():
            count = int(np.prod(shape))
            state[key] = row[start:start + count].reshape(shape).copy()
            start += count
        states.append(state)
    return states


def _many_weights(n: int = MANY) -> list[float]:
    """Integer weights 1..4 (realized work), so weight k can be read as k copies."""
    return [float(1 + (7 * i) % 4) for i in range(n)]


def _values(states: Sequence[State], key: str) -> np.ndarray:
    return np.stack([np.asarray(s[key]).astype(np.float64) for s in states])


class AggregatorContract(ContractBase):
    """Conformance tests every meshkit aggregator must pass."""

    kind: ClassVar[str] = "aggregator"

    #: Weight ``k`` behaves exactly like ``k`` copies of the contribution, and
    #: scaling every weight by the same factor changes nothing. Set it for any
    #: aggregator the reduce service may feed realized-work weights. When
    #: False the suite only gives equal weights, and unequal ones must be
    #: refused (AggregationError) or ignored.
    weighted: ClassVar[bool] = False
    #: The aggregator combines JSON leaves (numbers number by number, objects
    #: key by key, lists position by position; other values must agree).
    json_values: ClassVar[bool] = True
    #: The result lies between the smallest and largest contribution,
    #: coordinate by coordinate (true of every mean, median or selection); for
    #: a rule that uses the round's reference, of the contributions and the
    #: reference (a clipped update stops short of its contribution).
    bounded: ClassVar[bool] = True
    #: Optional ``reference(values, weights) -> expected`` computed in
    #: float64 (or ``reference(values, weights, base)`` with ``base`` the
    #: round's reference for that key, ``None`` for a rule that uses none):
    #: ``values`` has the contributors on axis 0, ``weights`` is a
    #: float64 vector (all ones when the test passes no weights; whole numbers
    #: otherwise, so ``np.repeat(values, weights.astype(int), axis=0)`` is a
    #: valid way to honour them).
    reference: ClassVar[Callable[[np.ndarray, np.ndarray], np.ndarray] | None] = None
    #: One contributor in :data:`MANY` sending a wild value (1e6), wherever it
    #: arrives and with the least weight, leaves the result within the range
    #: of the honest ones. True of a median, or of a trimmed mean cutting at
    #: least 1/40 of the weight from each end; never of a mean.
    robust: ClassVar[bool] = False
    #: The result depends on the contributions' values only, so the same values
    #: held in float16 give the float64 result to float16's precision. A rule
    #: that seeds a shuffle from the contributions' bytes (bucketing) sets False:
    #: each dtype is then checked for bounds and for depending on every contributor.
    same_in_every_dtype: ClassVar[bool] = True

    # -- helpers ---------------------------------------------------------

    def traits(self, agg: Any = None) -> AggregatorTraits:
        """What the aggregator declares (:func:`meshkit.testing.support.declared_traits`)."""
        return declared_traits(self.make() if agg is None else agg)

    def weights(self, weights: Sequence[float]) -> list[float]:
        """``weights`` for a weighted (or linear, weighing by the weight itself) aggregator,
        equal weights otherwise (a linear rule with its own ``weight(w)``, such as
        allreduce's every-contributor-once, may refuse unequal ones)."""
        agg = self.make()
        weighted = self.weighted or (self.traits(agg).linear
                                     and not callable(getattr(agg, "weight", None)))
        return list(weights) if weighted else [1.0] * len(weights)

    def round_reference(self, states: Sequence[State]) -> dict[str, Any] | None:
        """The round's reference the suite passes a rule that uses one (None otherwise)."""
        if not states or not self.traits().uses_reference:
            return None
        return round_reference(states[0])

    def aggregate(self, states: Sequence[State], weights: Sequence[float] | None = None,
                  agg: Any = None, *, reference: Any = AUTO) -> dict[str, Any]:
        """``agg.aggregate`` as a round calls it: with the round's reference when declared.

        ``reference=AUTO`` (the default) passes :meth:`round_reference` of ``states``.
        """
        agg = self.make() if agg is None else agg
        if self.traits(agg).uses_reference:
            ref = self.round_reference(states) if reference is AUTO else reference
            return agg.aggregate(list(states), weights, reference=ref)
        return agg.aggregate(list(states), weights) if weights is not None \
            else agg.aggregate(list(states))

    def refused(self, states: Sequence[State], weights: Sequence[float] | None = None,
                *, what: str) -> AggregationError:
        try:
            result = self.aggregate(states, weights)
        except AggregationError as exc:
            return exc
        except Exception as exc:  # the right refusal, the wrong type
            pytest.fail(f"{what}: expected meshkit.AggregationError, got "
                        f"{type(exc).__name__}: {exc}", pytrace=False)
        pytest.fail(f"{what}: expected meshkit.AggregationError, but the aggregator "
                    f"returned a result: {result!r}", pytrace=False)

    # -- identity and dtypes ----------------------------------------------

    def _skip_unless_identity_holds(self) -> None:
        """One contributor back unchanged is a promise only some rules make (their traits say)."""
        traits = self.traits()
        if traits.uses_reference:
            pytest.skip("the rule uses the round's reference: its identity is at the reference "
                        "(test_contributions_at_the_reference_give_the_reference)")
        if traits.stateful:
            pytest.skip("the rule keeps state across rounds: no identity is promised "
                        "(test_declared_state_survives_a_checkpoint)")

    @pytest.mark.parametrize("dtype", float_dtypes(), ids=str)
    def test_one_contributor_is_returned_unchanged(self, dtype: Any) -> None:
        self._skip_unless_identity_holds()
        (state,) = _contributions(1, dtype)
        assert_states_identical(self.aggregate([snapshot(state)]), state,
                                what="aggregate([s])")
        assert_states_identical(self.aggregate([snapshot(state)], [1.0]), state,
                                what="aggregate([s], weights=[1.0])")
        # Any positive weight: (w * x) / w may round in the last bit in float64.
        assert_states_close(self.aggregate([snapshot(state)], [2.5]), state,
                            what="aggregate([s], weights=[2.5])")

    def test_identical_contributions_give_that_contribution(self) -> None:
        self._skip_unless_identity_holds()
        (state,) = _contributions(1)
        result = self.aggregate([snapshot(state) for _ in range(3)],
                                self.weights([1.0, 2.0, 3.0]))
        assert_states_close(result, state, what="aggregate([s, s, s])")

    @pytest.mark.parametrize("dtype", float_dtypes(), ids=str)
    def test_contributions_at_the_reference_give_the_reference(self, dtype: Any) -> None:
        if not self.traits().uses_reference:
            pytest.skip("the rule does not use the round's reference")
        (state,) = _contributions(1, dtype)
        reference = round_reference(state)
        result = self.aggregate([snapshot(reference)], [1.0], reference=reference)
        assert_states_identical(result, reference, what=(
            "one contribution equal to the round's reference (a zero update) did not give the "
            "reference back bit for bit"))
        # Several: a weighted mean of equal values may round in the last bit.
        result = self.aggregate([snapshot(reference) for _ in range(3)],
                                self.weights([1.0, 2.0, 3.0]), reference=reference)
        assert_states_close(result, reference, what=(
            "three contributions equal to the round's reference (zero updates)"))

    def test_updates_are_measured_from_the_reference(self) -> None:
        if not self.traits().uses_reference:
            pytest.skip("the rule does not use the round's reference")
        states = _contributions(5, np.float64, seed=17)
        weights = self.weights([1.0, 2.0, 1.0, 3.0, 1.0])
        reference = round_reference(states[0])
        base = self.aggregate(states, weights, reference=reference)
        shift = 100.0
        moved = [{k: v + shift for k, v in s.items()} for s in states]
        shifted = self.aggregate(moved, weights,
                                 reference={k: v + shift for k, v in reference.items()})
        for key in base:
            np.testing.assert_allclose(
                np.asarray(shifted[key]) - shift, np.asarray(base[key]), rtol=1e-9, atol=1e-9,
                err_msg=f"key {key!r}: the same updates around a global model moved by +{shift:g} "
                        f"gave another update; a rule that declares uses_reference must work "
                        f"on contribution - reference (is the reference ignored?)")

    def test_each_array_keeps_its_input_dtype(self) -> None:
        rng = np.random.default_rng(1)
        states = [{str(np.dtype(d)): rng.standard_normal(6).astype(d) for d in float_dtypes()}
                  for _ in range(3)]
        result = self.aggregate(states, self.weights([1.0, 1.0, 2.0]))
        for key, value in states[0].items():
            assert isinstance(result[key], np.ndarray), (
                f"key {key!r}: expected a numpy array, got {type(result[key]).__name__}")
            assert result[key].dtype == value.dtype, (
                f"key {key!r}: a {value.dtype} input came back as {result[key].dtype}; "
                f"return each array in its input dtype")
            assert result[key].shape == value.shape

    def test_0_d_arrays_numpy_scalars_and_integer_buffers_come_back_wire_ready(self) -> None:
        """A real model's state (:func:`meshkit.testing.support.model_states`), batch and
        streaming: every leaf an ndarray of its input's shape and dtype, the result
        encodable for the wire, the identical int64 buffer unchanged."""
        states = model_states(MANY, seed=5)
        weights = self.weights([1.0 + i % 3 for i in range(MANY)])
        fold = self._fold(self.make(), self.round_reference(states))
        for i, (s, w) in enumerate(zip(states, weights)):
            fold.add(snapshot(s), w, source=f"rank {i + 1}")
        for how, result in (("aggregate", self.aggregate(states, weights)),
                            ("fold", fold.result())):
            for key, value in states[0].items():
                got = result[key]
                assert isinstance(got, np.ndarray), (
                    f"{how}: key {key!r} came back as a {type(got).__name__}, not a numpy "
                    f"array; a numpy scalar cannot go on the wire (wrap it: "
                    f"np.asarray(x, dtype=...))")
                assert got.shape == np.shape(value) and got.dtype == np.asarray(value).dtype, (
                    f"{how}: key {key!r}: a {np.asarray(value).dtype}{list(np.shape(value))} "
                    f"input came back as {got.dtype}{list(got.shape)}")
            assert np.array_equal(result["steps"], states[0]["steps"]), (
                f"{how}: the int64 buffer 'steps', identical everywhere, came back as "
                f"{result['steps']!r}")
            encode_state(result)  # what the coordinator or a relay does with it next

    @pytest.mark.parametrize("dtype", float_dtypes(), ids=str)
    @pytest.mark.parametrize("how", ["aggregate", "fold"])
    def test_inputs_are_not_modified(self, how: str, dtype: Any) -> None:
        # Large and small contributions, so a rule that clips or rescales in
        # place is caught whatever its threshold.
        states = _contributions(4, dtype, seed=18)
        for scale, s in zip((1e-3, 1.0, 30.0, 1e3), states):
            for key in s:
                s[key] = (s[key].astype(np.float64) * scale).astype(dtype)
        weights = self.weights([1.0, 2.0, 3.0, 4.0])
        reference = self.round_reference(states)
        before = ([snapshot(s) for s in states], list(weights), snapshot(reference))
        if how == "aggregate":
            self.aggregate(states, weights, reference=reference)
        else:
            fold = self._fold(self.make(), reference)
            for i, (s, w) in enumerate(zip(states, weights)):
                fold.add(s, w, source=f"rank {i + 1}")
            fold.result()
        for i, (after, orig) in enumerate(zip(states, before[0])):
            assert_states_identical(after, orig, what=f"{how}: contribution {i} afterwards "
                                                      f"(clip or rescale a copy, never the input)")
        assert weights == before[1], (
            f"{how}: the weights list was modified: {before[1]} became {weights}")
        if reference is not None:
            assert_states_identical(reference, before[2],
                                    what=f"{how}: the round's reference afterwards")

    # -- declared traits: linear, stateful ---------------------------------------

    @pytest.mark.parametrize("dtype", float_dtypes(), ids=str)
    def test_a_linear_rule_is_the_weighted_mean_it_declares(self, dtype: Any) -> None:
        agg = self.make()
        if not self.traits(agg).linear:
            pytest.skip("the rule does not declare linear = True")
        states = _contributions(5, dtype, seed=19)
        weights = self.weights([1.0, 2.0, 3.0, 1.0, 4.0])
        omega = np.array([linear_weight(agg, w) for w in weights])
        result = self.aggregate(states, weights, agg)
        for key in states[0]:
            values = _values(states, key)
            expected = (np.tensordot(omega, values, axes=1) / omega.sum()).astype(dtype)
            got = result[key]
            assert isinstance(got, np.ndarray) and got.dtype == np.dtype(dtype), (
                f"key {key!r}: a {np.dtype(dtype)} input came back as {getattr(got, 'dtype', got)}")
            tol = tolerance(dtype)
            np.testing.assert_allclose(
                got.astype(np.float64), expected.astype(np.float64),
                rtol=tol["rtol"], atol=tol["atol"],
                err_msg=f"key {key!r} in {np.dtype(dtype)}: the rule declares linear = True, "
                        f"so it must give sum(w_i x_i) / sum(w_i) with w_i = weight(weights[i]) "
                        f"(weights {weights}); are the weights ignored?")

    @pytest.mark.parametrize("dtype", [d for d in float_dtypes() if d != np.float64], ids=str)
    def test_values_in_each_dtype_agree_with_float64(self, dtype: Any) -> None:
        """The multi-contributor value check, in float32, float16 and bfloat16.

        Each contribution is rounded to ``dtype`` first, so both sides see the
        same numbers; the result in ``dtype`` must be the float64 result to
        ``dtype``'s precision. Catches a rule that treats bfloat16 as not a
        float (``np.issubdtype(bfloat16, np.floating)`` is False).
        """
        low = _contributions(5, dtype, seed=20)
        high = [{k: v.astype(np.float64) for k, v in s.items()} for s in low]
        weights = self.weights([1.0, 2.0, 3.0, 1.0, 4.0])
        ref_low = self.round_reference(low)
        ref_high = None if ref_low is None else {k: np.asarray(v).astype(np.float64)
                                                 for k, v in ref_low.items()}
        got = self.aggregate(low, weights, reference=ref_low)
        for key in low[0]:
            assert isinstance(got[key], np.ndarray) and got[key].dtype == np.dtype(dtype), (
                f"key {key!r}: a {np.dtype(dtype)} input came back as "
                f"{getattr(got[key], 'dtype', type(got[key]).__name__)}")
        if not self.same_in_every_dtype:
            self._check_in_dtype(low, weights, ref_low, got, dtype)
            return
        expected = self.aggregate(high, weights, reference=ref_high)
        for key in low[0]:
            tol = tolerance(dtype)
            np.testing.assert_allclose(
                np.asarray(got[key]).astype(np.float64),
                np.asarray(expected[key]).astype(dtype).astype(np.float64),
                rtol=tol["rtol"], atol=tol["atol"],
                err_msg=f"key {key!r}: {len(low)} contributions in {np.dtype(dtype)} gave "
                        f"another result than the same values in float64 (is {np.dtype(dtype)} "
                        f"handled as a float? ml_dtypes' bfloat16 is not np.floating)")

    def _check_in_dtype(self, low: list[dict[str, Any]], weights: list[float], reference: Any,
                        got: Mapping[str, Any], dtype: Any) -> None:
        """For a rule not the same in every dtype: bounded, and every contributor counts."""
        tol = tolerance(dtype)
        if self.bounded:
            for key in low[0]:
                values = _values(low + ([reference] if reference is not None else []), key)
                value = np.asarray(got[key]).astype(np.float64)
                slack = tol["atol"] + tol["rtol"] * np.abs(values).max()
                assert np.all(value >= values.min(axis=0) - slack) and \
                    np.all(value <= values.max(axis=0) + slack), (
                    f"key {key!r} in {np.dtype(dtype)}: the result leaves the contributions' "
                    f"range (is {np.dtype(dtype)} handled as a float?)")
        for i in range(len(low)):
            moved = [s if j == i else {k: (v.astype(np.float64) + 10.0).astype(dtype)
                                       for k, v in s.items()} for j, s in enumerate(low)]
            shifted = self.aggregate(moved, weights, reference=reference)
            assert not np.allclose(np.asarray(shifted["w"]).astype(np.float64),
                                   np.asarray(got["w"]).astype(np.float64)), (
                f"in {np.dtype(dtype)}, moving every contributor except number {i} by +10 left "
                f"the result unchanged (is {np.dtype(dtype)} handled as a float?)")

    def test_a_rule_that_declares_no_state_keeps_none(self) -> None:
        agg = self.make()
        if self.traits(agg).stateful:
            pytest.skip("the rule declares state (test_declared_state_survives_a_checkpoint)")
        first = _contributions(4, np.float64, seed=21)
        second = _contributions(4, np.float64, seed=22)
        weights = self.weights([1.0, 2.0, 1.0, 3.0])
        self.aggregate(first, weights, agg)
        again = self.aggregate(second, weights, agg)
        assert_states_identical(again, self.aggregate(second, weights), what=(
            "a round after another round, on one aggregator, differs from the same round on a "
            "fresh one: the rule keeps state, so declare AggregatorTraits(stateful=True) with "
            "state_dict()/load_state_dict() (a resumed run would differ)"))

    def test_declared_state_survives_a_checkpoint(self, tmp_path: Path) -> None:
        agg = self.make()
        if not self.traits(agg).stateful:
            pytest.skip("the rule declares no state")
        rounds = [_contributions(4, np.float64, seed=23 + i) for i in range(3)]
        weights = self.weights([1.0, 2.0, 1.0, 3.0])
        for states in rounds[:2]:
            self.aggregate(states, weights, agg)
        save_checkpoint(tmp_path, Checkpoint(round=2, state={},
                                             aggregator_state=agg.state_dict()))
        resumed = self.make()
        resumed.load_state_dict(dict(load_checkpoint(tmp_path).aggregator_state))
        assert_states_identical(self.aggregate(rounds[2], weights, resumed),
                                self.aggregate(rounds[2], weights, agg), what=(
            "round 3 after a checkpoint of state_dict() and load_state_dict() differs from the "
            "run that never stopped"))

    # -- strictness -------------------------------------------------------

    @pytest.mark.parametrize("position", [0, 1, 2], ids=lambda p: f"contributor{p}")
    def test_a_missing_key_is_refused_naming_it(self, position: int) -> None:
        states = _contributions(3)
        del states[position]["b"]
        exc = self.refused(states, what=f"contributor {position} lacks key 'b'")
        assert "'b'" in str(exc) or '"b"' in str(exc) or " b " in f" {exc} ", (
            f"the error should name the missing key 'b': {exc}")

    def test_a_shape_mismatch_is_refused_naming_the_key(self) -> None:
        states = _contributions(3)
        states[2]["w"] = states[2]["w"].reshape(4, 3)
        exc = self.refused(states, what="key 'w' has shape (4, 3) in one contributor")
        assert "w" in str(exc), f"the error should name the key 'w': {exc}"

    def test_a_dtype_mismatch_is_refused_naming_the_key(self) -> None:
        states = _contributions(3)
        states[1]["b"] = states[1]["b"].astype(np.float64)
        exc = self.refused(states, what="key 'b' is float64 in one contributor")
        assert "b" in str(exc), f"the error should name the key 'b': {exc}"

    def test_zero_contributors_are_refused(self) -> None:
        self.refused([], what="no contributions at all")
        self.refused([], [], what="no contributions at all (empty weights)")

    @pytest.mark.parametrize("weights", [
        [1.0, -1.0, 1.0],
        [1.0, float("nan"), 1.0],
        [1.0, float("inf"), 1.0],
        [0.0, 0.0, 0.0],
        [1.0, 1.0],
    ], ids=["negative", "nan", "inf", "all-zero", "wrong-count"])
    def test_a_bad_weight_is_refused(self, weights: list[float]) -> None:
        self.refused(_contributions(3), weights, what=f"weights {weights}")

    def test_a_nan_contribution_is_refused_or_visible(self) -> None:
        states = _contributions(3)
        states[1]["w"] = states[1]["w"].copy()
        states[1]["w"][0, 0] = np.nan
        try:
            result = self.aggregate(states)
        except AggregationError:
            return  # refusing is fine
        assert np.isnan(np.asarray(result["w"], dtype=np.float64)[0, 0]), (
            "a NaN in one contribution vanished from the result: aggregating over the "
            "finite contributions only hides a diverged worker; propagate the NaN or "
            "raise AggregationError")

    # -- semantics --------------------------------------------------------

    def test_the_order_of_contributors_does_not_matter(self) -> None:
        states = _contributions(4, np.float64)
        weights = self.weights([1.0, 2.0, 3.0, 4.0])
        forward = self.aggregate(states, weights)
        order = [2, 0, 3, 1]
        permuted = self.aggregate([states[i] for i in order], [weights[i] for i in order])
        assert_states_close(permuted, forward, what="contributors in another order",
                            rtol=1e-9, atol=1e-12)

    def test_no_weights_means_equal_weights(self) -> None:
        states = _contributions(3, np.float64)
        plain = self.aggregate(states)
        assert_states_close(self.aggregate(states, [1.0, 1.0, 1.0]), plain,
                            what="weights [1, 1, 1] vs none", rtol=1e-9, atol=1e-12)
        assert_states_close(self.aggregate(states, [2.0, 2.0, 2.0]), plain,
                            what="weights [2, 2, 2] vs none", rtol=1e-9, atol=1e-12)

    def test_the_result_lies_within_the_contributions(self) -> None:
        if not self.bounded:
            pytest.skip("the aggregator declares bounded = False")
        states = _contributions(5, np.float64, seed=3)
        result = self.aggregate(states, self.weights([1.0, 3.0, 0.5, 2.0, 1.0]))
        reference = self.round_reference(states)
        for key in states[0]:
            # A rule on updates (clipping) may stop between the contributions and the reference.
            values = _values(states + ([reference] if reference is not None else []), key)
            got = np.asarray(result[key], dtype=np.float64)
            slack = 1e-9 * (1 + np.abs(values).max())
            assert np.all(got >= values.min(axis=0) - slack) and \
                np.all(got <= values.max(axis=0) + slack), (
                f"key {key!r}: the result leaves the range of the contributions")

    def test_the_result_depends_on_every_contributor(self) -> None:
        # Catches an aggregator that returns one contribution (the first, the
        # last) or ignores some: moving every contributor but one must move
        # the result for a mean, and for any robust rule when all but one move.
        states = _contributions(3, np.float64, seed=4)
        base = self.aggregate(states)
        for i in range(len(states)):
            moved = [snapshot(s) for s in states]
            for j, s in enumerate(moved):
                if j != i:
                    s["w"] = s["w"] + 10.0
            shifted = self.aggregate(moved)
            assert not np.allclose(np.asarray(shifted["w"], dtype=np.float64),
                                   np.asarray(base["w"], dtype=np.float64)), (
                f"moving every contributor except number {i} by +10 left the result "
                f"unchanged: the aggregator follows contributor {i} alone")

    def test_integer_weights_count_as_copies(self) -> None:
        if not self.weighted:
            pytest.skip("the aggregator does not declare weighted = True")
        a, b, c = _contributions(3, np.float64, seed=5)
        weighted = self.aggregate([a, b, c], [2.0, 1.0, 3.0])
        copies = self.aggregate([a, a, b, c, c, c])
        assert_states_close(weighted, copies, what="weights [2, 1, 3] vs copies",
                            rtol=1e-9, atol=1e-12)

    def test_scaling_every_weight_changes_nothing(self) -> None:
        if not self.weighted:
            pytest.skip("the aggregator does not declare weighted = True")
        states = _contributions(3, np.float64, seed=6)
        one = self.aggregate(states, [1.0, 2.0, 5.0])
        assert_states_close(self.aggregate(states, [10.0, 20.0, 50.0]), one,
                            what="weights x10", rtol=1e-9, atol=1e-12)
        assert_states_close(self.aggregate(states, [0.1, 0.2, 0.5]), one,
                            what="weights x0.1", rtol=1e-9, atol=1e-12)

    def test_the_weights_change_the_result(self) -> None:
        if not self.weighted:
            pytest.skip("the aggregator does not declare weighted = True")
        states = _contributions(3, np.float64, seed=7)
        even = self.aggregate(states)
        skewed = self.aggregate(states, [1.0, 1.0, 8.0])
        assert not np.allclose(np.asarray(even["w"], dtype=np.float64),
                               np.asarray(skewed["w"], dtype=np.float64)), (
            "weights [1, 1, 8] gave the same result as equal weights: the aggregator "
            "declares weighted = True but ignores its weights")

    def test_unequal_weights_are_refused_or_ignored(self) -> None:
        if self.weighted or self.traits().linear:
            pytest.skip("weighted (or linear): checked by the weighted-semantics tests")
        states = _contributions(3, np.float64, seed=11)
        try:
            result = self.aggregate(states, [1.0, 1.0, 8.0])
        except AggregationError:
            return  # refusing unequal work is honest
        assert_states_close(result, self.aggregate(states), what="weights [1, 1, 8] given to "
                            "an aggregator that does not declare weighted = True",
                            rtol=1e-9, atol=1e-12)

    def _expected(self, reference: Callable[..., Any], states: Sequence[State], key: str,
                  weights: np.ndarray) -> np.ndarray:
        """``reference(values, weights)``, or with a third parameter the round's reference."""
        values = _values(states, key)
        if len(inspect.signature(reference).parameters) >= 3:
            ref = self.round_reference(states)
            base = None if ref is None else np.asarray(ref[key], dtype=np.float64)
            return np.asarray(reference(values, weights, base))
        return np.asarray(reference(values, weights))

    def test_matches_the_declared_reference(self) -> None:
        reference = type(self).reference
        if reference is None:
            pytest.skip("no reference declared")
        states = _contributions(5, np.float64, seed=8)
        for weights in (None, self.weights([1.0, 2.0, 3.0, 1.0, 4.0])):
            w = np.ones(len(states)) if weights is None else np.asarray(weights, dtype=np.float64)
            result = self.aggregate(states, weights)
            for key in states[0]:
                expected = self._expected(reference, states, key, w)
                np.testing.assert_allclose(
                    np.asarray(result[key], dtype=np.float64), expected, rtol=1e-9,
                    atol=1e-12, err_msg=f"key {key!r}, weights {weights}")

    # -- many contributors: rules that cut or select ----------------------------

    def test_many_contributors_in_any_order_give_one_result(self) -> None:
        states = _adversarial()
        weights = self.weights(_many_weights())
        expected = self.aggregate(states, weights)
        rng = np.random.default_rng(13)
        orders = {
            "reversed": list(range(MANY))[::-1],
            "rotated by a quarter": [(i + MANY // 4) % MANY for i in range(MANY)],
            "shuffled": list(rng.permutation(MANY)),
            "shuffled again": list(rng.permutation(MANY)),
        }
        for what, order in orders.items():
            result = self.aggregate([states[i] for i in order], [weights[i] for i in order])
            try:
                assert_states_close(result, expected, what=f"{MANY} contributors, {what}",
                                    rtol=1e-9, atol=1e-12)
            except AssertionError as exc:
                raise AssertionError(
                    f"{MANY} contributors {what} gave another result than in arrival order: "
                    f"the aggregator depends on the order contributions arrive in (does it "
                    f"trim or select by position instead of sorting the values?)\n{exc}"
                ) from None

    def test_many_contributors_match_the_declared_reference(self) -> None:
        reference = type(self).reference
        if reference is None:
            pytest.skip("no reference declared")
        states = _adversarial(seed=14)
        for weights in (None, self.weights(_many_weights())):
            w = np.ones(MANY) if weights is None else np.asarray(weights, dtype=np.float64)
            result = self.aggregate(states, weights)
            for key in states[0]:
                expected = self._expected(reference, states, key, w)
                np.testing.assert_allclose(
                    np.asarray(result[key], dtype=np.float64), expected, rtol=1e-9,
                    atol=1e-12, err_msg=f"{MANY} contributors, extremes arriving in the "
                                        f"middle: key {key!r}, weights {weights}")

    def test_many_integer_weights_count_as_copies(self) -> None:
        if not self.weighted:
            pytest.skip("the aggregator does not declare weighted = True")
        states = _adversarial(n=MANY // 2, seed=15)
        weights = _many_weights(MANY // 2)
        copies = [s for s, w in zip(states, weights) for _ in range(int(w))]
        assert_states_close(self.aggregate(states, weights), self.aggregate(copies),
                            what=f"{len(states)} contributors weighted 1..4 vs "
                                 f"{len(copies)} copies", rtol=1e-9, atol=1e-12)

    @pytest.mark.parametrize("arriving", ["first", "in the middle", "last"])
    def test_one_wild_contributor_cannot_drag_a_robust_result(self, arriving: str) -> None:
        if not self.robust:
            pytest.skip("the aggregator does not declare robust = True")
        rng = np.random.default_rng(16)
        honest = [{"w": rng.uniform(-1.0, 1.0, (3, 4)), "b": rng.uniform(-1.0, 1.0, 5)}
                  for _ in range(MANY - 1)]
        wild = {"w": np.full((3, 4), 1e6), "b": np.full(5, -1e6)}
        position = {"first": 0, "in the middle": MANY // 2, "last": MANY - 1}[arriving]
        states = honest[:position] + [wild] + honest[position:]
        # The wild one carries the least weight (1): robustness to one
        # contributor, not to a contributor that did most of the work.
        work = _many_weights(MANY - 1)
        weights = self.weights(work[:position] + [1.0] + work[position:])
        result = self.aggregate(states, weights)
        for key in honest[0]:
            values = _values(honest, key)
            got = np.asarray(result[key], dtype=np.float64)
            inside = (got >= values.min(axis=0) - 1e-9) & (got <= values.max(axis=0) + 1e-9)
            assert np.all(inside), (
                f"key {key!r}: one contributor in {MANY} sending {wild[key].flat[0]:g} "
                f"(arriving {arriving}) dragged the result out of the honest contributions' "
                f"range [{values.min():.3g}, {values.max():.3g}] (got values up to "
                f"{np.abs(got).max():.3g}), although the aggregator declares robust = True")

    # -- JSON leaves --------------------------------------------------------

    def test_json_values_are_combined_and_non_numbers_must_agree(self) -> None:
        if not self.json_values:
            pytest.skip("the aggregator declares json_values = False")
        states = [
            {"w": np.full(2, float(i), np.float32), "mu": float(i), "name": "net",
             "cfg": {"lr": 0.1 * (i + 1), "tag": "x"}, "hist": [float(i), 1.0]}
            for i in range(3)
        ]
        result = self.aggregate(states)
        assert result["name"] == "net" and result["cfg"]["tag"] == "x", (
            f"identical non-numeric values must come back unchanged, got {result!r}")
        assert 0.0 <= float(result["mu"]) <= 2.0, f"'mu' should be combined, got {result['mu']!r}"
        assert 0.1 - 1e-9 <= float(result["cfg"]["lr"]) <= 0.3 + 1e-9
        assert len(result["hist"]) == 2 and float(result["hist"][1]) == 1.0

        states[2]["name"] = "other-net"
        exc = self.refused(states, what="key 'name' is 'net' in two contributors, "
                                        "'other-net' in one")
        assert "name" in str(exc), f"the error should name the key 'name': {exc}"

    # -- streaming ----------------------------------------------------------

    def _fold(self, agg: Any, reference: Any = None) -> Any:
        """A fold as the round engine opens one (with the round's reference when declared)."""
        if not self.traits(agg).uses_reference:
            return begin(agg)
        if callable(getattr(agg, "begin", None)):
            return agg.begin(reference=reference)
        return BufferingFold(agg, reference=reference)

    def test_streaming_equals_batch(self) -> None:
        agg = self.make()
        states = _contributions(4, seed=9)
        weights = self.weights([1.0, 3.0, 2.0, 0.5])
        fold = self._fold(agg, self.round_reference(states))
        for i, (s, w) in enumerate(zip(states, weights)):
            fold.add(s, w, source=f"rank {i + 1}")
        assert_states_close(fold.result(), self.aggregate(states, weights),
                            what="fold (begin/add/result) vs aggregate")

    def test_an_empty_fold_is_refused(self) -> None:
        fold = self._fold(self.make())
        with pytest.raises(AggregationError):
            fold.result()

    def test_a_streaming_refusal_names_the_contributor(self) -> None:
        agg = self.make()
        if not hasattr(agg, "begin"):
            pytest.skip("no streaming form of its own (begin())")
        states = _contributions(3, seed=10)
        del states[2]["b"]
        fold = self._fold(agg, self.round_reference(states))
        with pytest.raises(AggregationError) as info:
            for i, s in enumerate(states):
                fold.add(s, 1.0, source=f"rank {i + 5}")
            fold.result()
        assert "rank 7" in str(info.value), (
            f"the error should name the contributor that lacks 'b' (source 'rank 7'): "
            f"{info.value}")


_ = bfloat16  # re-exported for subclasses that build their own states
