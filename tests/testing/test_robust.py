"""RobustAggregatorContract catches the classic wrong implementations.

Each broken rule below is a mistake robust-aggregation code actually
ships with. The contract is run against it and must fail on the check
that names the mistake; the correct built-in passes the same checks
(tests/aggregation/test_robust_contract.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from meshkit.testing import RobustAggregatorContract


class _Rows:
    """A minimal aggregator over ``{"w": row}`` states, computing ``combine(x)``."""

    def __init__(self, combine: Any) -> None:
        self.combine = combine

    def aggregate(self, states, weights=None):
        x = np.stack([np.asarray(s["w"], dtype=np.float64) for s in states])
        return {"w": self.combine(x)}


def unsorted_trimmed_mean(x: np.ndarray, beta: float = 0.2) -> np.ndarray:
    """Cuts floor(beta * n) rows from each end in arrival order, never sorting them."""
    cut = int(beta * len(x))
    return x[cut:len(x) - cut].mean(axis=0)


def krum_with(neighbours: Any, f: int = 2) -> Any:
    def krum(x: np.ndarray) -> np.ndarray:
        n = len(x)
        if n < 2 * f + 3:
            from meshkit import AggregationError
            raise AggregationError(f"needs {2 * f + 3}")
        d = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
        np.fill_diagonal(d, np.inf)
        scores = np.sort(d, axis=1)[:, :neighbours(n, f)].sum(1)
        return x[int(np.argmin(scores))]
    return krum


def one_sided_median(x: np.ndarray) -> np.ndarray:
    """The lower middle value of an even count, instead of the mean of the two."""
    return np.sort(x, axis=0)[(len(x) - 1) // 2]


def first_come_median(x: np.ndarray) -> np.ndarray:
    """A median of the first seven arrivals only: depends on arrival order."""
    return np.median(x[:7], axis=0)


class _Forgetful:
    """Centered clipping whose load_state_dict forgets the centre (a resume starts afresh)."""

    traits = __import__("meshkit").AggregatorTraits(uses_reference=True, stateful=True)

    def __init__(self) -> None:
        import meshkit
        self.inner = meshkit.plugins.create("aggregator", "centered-clipping",
                                            {"tau": 2.0, "iterations": 2})

    def aggregate(self, states, weights=None, *, reference=None):
        return self.inner.aggregate(states, weights, reference=reference)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        pass  # the bug: nothing is restored


def _suite(rule: str, build: Any, options: dict[str, Any] | None = None) -> Any:
    cls = type(f"Broken_{rule}", (RobustAggregatorContract,),
               {"rule": rule, "options": options or {}, "make": lambda self, **_: build()})
    return cls()


def _fails(suite: Any, test: str, *args: Any) -> str:
    with pytest.raises(AssertionError) as info:
        getattr(suite, test)(*args)
    return str(info.value)


def test_the_kit_fails_a_trimmed_mean_that_does_not_sort():
    suite = _suite("trimmed-mean", lambda: _Rows(unsorted_trimmed_mean))
    message = _fails(suite, "test_a_trimmed_mean_sorts_each_coordinate_before_cutting")
    assert "must be sorted before floor(beta * n) values are cut" in message


@pytest.mark.parametrize("neighbours", [
    pytest.param(lambda n, f: n - f - 1, id="n-f-1"),
    pytest.param(lambda n, f: n - f - 3, id="n-f-3"),
    pytest.param(lambda n, f: n - 1, id="all-others"),
])
def test_the_kit_fails_krum_scoring_over_the_wrong_neighbour_count(neighbours):
    suite = _suite("krum", lambda: _Rows(krum_with(neighbours)), {"f": 2})
    message = _fails(suite, "test_krum_scores_over_n_minus_f_minus_2_squared_distances")
    assert "n - f - 2" in message


def test_the_kit_passes_krum_with_the_right_neighbour_count():
    suite = _suite("krum", lambda: _Rows(krum_with(lambda n, f: n - f - 2)), {"f": 2})
    suite.test_krum_scores_over_n_minus_f_minus_2_squared_distances()


def test_the_kit_fails_a_median_that_takes_one_side_of_an_even_count():
    suite = _suite("median", lambda: _Rows(one_sided_median))
    message = _fails(suite, "test_an_even_count_median_is_the_mean_of_the_two_middle_values")
    assert "mean of the two middle values" in message


def test_the_kit_fails_a_rule_that_depends_on_arrival_order():
    suite = _suite("median", lambda: _Rows(first_come_median))
    message = _fails(suite, "test_the_order_of_contributions_does_not_matter")
    assert "arrived in another order" in message


def test_the_kit_fails_a_centre_not_restored_on_resume():
    suite = _suite("centered-clipping", _Forgetful)
    message = _fails(suite, "test_the_centre_is_restored_on_resume")
    assert "the centre is not restored on resume" in message


def test_the_kit_fails_krum_that_accepts_too_few_contributors():
    suite = _suite("krum", lambda: _Rows(lambda x: x[0]), {"f": 2})
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        suite.test_too_few_contributors_are_refused_saying_how_many()


def test_a_suite_with_an_unknown_rule_says_what_to_set():
    suite = type("Typo", (RobustAggregatorContract,), {"component": "median",
                                                       "rule": "medain"})()
    with pytest.raises(pytest.fail.Exception, match="set `rule` to one of median"):
        suite.test_the_order_of_contributions_does_not_matter()


# -- a new rule: the generic properties ---------------------------------------


def _new_rule(build: Any, **declared: Any) -> Any:
    cls = type("NewRule", (RobustAggregatorContract,),
               {"make": lambda self, **_: build(), **declared})
    return cls()


_GENERIC = ["test_the_order_of_contributions_does_not_matter",
            "test_too_few_contributors_are_refused_saying_how_many"]


def _run_generic(suite: Any) -> None:
    for test in _GENERIC:
        getattr(suite, test)()
    for magnitude in (1e3, 1e20, 1e100, 1e155, 1e300):
        suite.test_f_outliers_have_bounded_influence_at_any_magnitude(magnitude)
    for value in (float("nan"), float("inf"), float("-inf")):
        suite.test_a_non_finite_contribution_is_refused(value)


def _finite_median(x: np.ndarray) -> np.ndarray:
    from meshkit import AggregationError
    if not np.isfinite(x).all():
        raise AggregationError("a contribution is not finite")
    return np.median(x, axis=0)


def test_a_correct_new_rule_passes_the_generic_properties():
    _run_generic(_new_rule(lambda: _Rows(_finite_median)))


@pytest.mark.parametrize("component, options, minimum", [
    ("median", {}, 1), ("trimmed-mean", {"beta": 0.2}, 1), ("krum", {"f": 1}, 5),
    ("multi-krum", {"f": 1, "m": 3}, 5),
])
def test_the_built_in_rules_pass_as_if_they_were_new(component, options, minimum):
    import meshkit
    suite = _new_rule(lambda: meshkit.plugins.create("aggregator", component, options),
                      options=options, minimum_contributors=minimum)
    _run_generic(suite)


def test_the_kit_fails_a_new_rule_that_is_a_mean():
    suite = _new_rule(lambda: _Rows(lambda x: x.mean(axis=0)))
    message = _fails(suite, "test_f_outliers_have_bounded_influence_at_any_magnitude", 1e3)
    assert "outside the honest contributions' range" in message


def test_the_kit_fails_a_new_rule_whose_arithmetic_overflows():
    # Weiszfeld's geometric median started from the mean, with plain distances:
    # fine at 1e3; at 1e155 the squared distances overflow and the result is NaN.
    def weiszfeld(x: np.ndarray) -> np.ndarray:
        from meshkit import AggregationError
        if not np.isfinite(x).all():
            raise AggregationError("a contribution is not finite")
        z = x.mean(axis=0)
        for _ in range(100):
            d = np.sqrt(((x - z) ** 2).sum(1))
            w = 1.0 / np.maximum(d, 1e-12)
            z = (w[:, None] * x).sum(0) / w.sum()
        return z
    suite = _new_rule(lambda: _Rows(weiszfeld))
    suite.test_f_outliers_have_bounded_influence_at_any_magnitude(1e3)
    with np.errstate(all="ignore"):
        message = _fails(suite, "test_f_outliers_have_bounded_influence_at_any_magnitude", 1e300)
    assert "at magnitude 1e+300" in message


def test_the_kit_fails_a_new_rule_that_folds_a_nan():
    suite = _new_rule(lambda: _Rows(lambda x: np.median(x, axis=0)))
    with pytest.raises(pytest.fail.Exception, match="was aggregated"):
        suite.test_a_non_finite_contribution_is_refused(float("nan"))


def test_the_kit_fails_a_new_rule_that_accepts_fewer_than_it_declares():
    suite = _new_rule(lambda: _Rows(_finite_median), minimum_contributors=5)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        suite.test_too_few_contributors_are_refused_saying_how_many()
