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
:class:`meshkit.AggregationError` naming the key), identity for one
contributor, dtype preservation, no mutation of the inputs, independence from
the order contributors arrive in, weighted semantics when declared, and that
the streaming form (``begin()``) gives what the batch form gives.

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

from typing import Any, Callable, ClassVar, Mapping, Sequence

import numpy as np
import pytest

from meshkit.aggregation import begin
from meshkit.errors import AggregationError
from meshkit.wire import encode_state
from meshkit.testing.support import (
    ContractBase,
    assert_states_close,
    assert_states_identical,
    bfloat16,
    float_dtypes,
    model_states,
    snapshot,
)

__all__ = ["AggregatorContract", "MANY"]

State = Mapping[str, Any]

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
    #: coordinate by coordinate (true of every mean, median or selection).
    bounded: ClassVar[bool] = True
    #: Optional ``reference(values, weights) -> expected`` computed in
    #: float64: ``values`` has the contributors on axis 0, ``weights`` is a
    #: float64 vector (all ones when the test passes no weights; whole numbers
    #: otherwise, so ``np.repeat(values, weights.astype(int), axis=0)`` is a
    #: valid way to honour them).
    reference: ClassVar[Callable[[np.ndarray, np.ndarray], np.ndarray] | None] = None
    #: One contributor in :data:`MANY` sending a wild value (1e6), wherever it
    #: arrives and with the least weight, leaves the result within the range
    #: of the honest ones. True of a median, or of a trimmed mean cutting at
    #: least 1/40 of the weight from each end; never of a mean.
    robust: ClassVar[bool] = False

    # -- helpers ---------------------------------------------------------

    def weights(self, weights: Sequence[float]) -> list[float]:
        """``weights`` for a weighted aggregator, equal weights for an unweighted one."""
        return list(weights) if self.weighted else [1.0] * len(weights)

    def aggregate(self, states: Sequence[State], weights: Sequence[float] | None = None,
                  agg: Any = None) -> dict[str, Any]:
        agg = self.make() if agg is None else agg
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

    @pytest.mark.parametrize("dtype", float_dtypes(), ids=str)
    def test_one_contributor_is_returned_unchanged(self, dtype: Any) -> None:
        (state,) = _contributions(1, dtype)
        assert_states_identical(self.aggregate([snapshot(state)]), state,
                                what="aggregate([s])")
        assert_states_identical(self.aggregate([snapshot(state)], [1.0]), state,
                                what="aggregate([s], weights=[1.0])")
        # Any positive weight: (w * x) / w may round in the last bit in float64.
        assert_states_close(self.aggregate([snapshot(state)], [2.5]), state,
                            what="aggregate([s], weights=[2.5])")

    def test_identical_contributions_give_that_contribution(self) -> None:
        (state,) = _contributions(1)
        result = self.aggregate([snapshot(state) for _ in range(3)],
                                self.weights([1.0, 2.0, 3.0]))
        assert_states_close(result, state, what="aggregate([s, s, s])")

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
        fold = self._fold(self.make())
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

    def test_inputs_are_not_modified(self) -> None:
        states = _contributions(3)
        before = [snapshot(s) for s in states]
        self.aggregate(states, self.weights([1.0, 2.0, 3.0]))
        for i, (after, orig) in enumerate(zip(states, before)):
            assert_states_identical(after, orig, what=f"contribution {i} after aggregate")

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
        for key in states[0]:
            values = _values(states, key)
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
        if self.weighted:
            pytest.skip("weighted: checked by the weighted-semantics tests")
        states = _contributions(3, np.float64, seed=11)
        try:
            result = self.aggregate(states, [1.0, 1.0, 8.0])
        except AggregationError:
            return  # refusing unequal work is honest
        assert_states_close(result, self.aggregate(states), what="weights [1, 1, 8] given to "
                            "an aggregator that does not declare weighted = True",
                            rtol=1e-9, atol=1e-12)

    def test_matches_the_declared_reference(self) -> None:
        reference = type(self).reference
        if reference is None:
            pytest.skip("no reference declared")
        states = _contributions(5, np.float64, seed=8)
        for weights in (None, self.weights([1.0, 2.0, 3.0, 1.0, 4.0])):
            w = np.ones(len(states)) if weights is None else np.asarray(weights, dtype=np.float64)
            result = self.aggregate(states, weights)
            for key in states[0]:
                expected = np.asarray(reference(_values(states, key), w))
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
                expected = np.asarray(reference(_values(states, key), w))
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

    def _fold(self, agg: Any) -> Any:
        return begin(agg)

    def test_streaming_equals_batch(self) -> None:
        agg = self.make()
        states = _contributions(4, seed=9)
        weights = self.weights([1.0, 3.0, 2.0, 0.5])
        fold = self._fold(agg)
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
        fold = agg.begin()
        with pytest.raises(AggregationError) as info:
            for i, s in enumerate(states):
                fold.add(s, 1.0, source=f"rank {i + 5}")
            fold.result()
        assert "rank 7" in str(info.value), (
            f"the error should name the contributor that lacks 'b' (source 'rank 7'): "
            f"{info.value}")


_ = bfloat16  # re-exported for subclasses that build their own states
