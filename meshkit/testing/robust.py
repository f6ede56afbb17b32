"""The robust-aggregator contract suite: the checks that catch the classic wrong implementations.

Subclass :class:`RobustAggregatorContract`, point it at your component and
say which rule it implements; pytest collects the inherited tests::

    class TestMyKrum(RobustAggregatorContract):
        component = "my-krum"
        options = {"f": 2}        # the rule's parameters, by their usual names
        rule = "krum"

``rule`` is one of :data:`RULES`; the rule's parameters are read from
``options`` under their conventional names (``f``, ``beta``, ``m``;
defaults as the built-ins'). The suite computes every expected value with
its own reference implementation of the rule, so a bug an author shares
between their code and their test's reference is still caught. What it
catches:

* a rule whose result depends on the order contributions arrive in
  (every rule; rounds of 15 heavy-tailed contributions, shuffled);
* a median of an even count taking one side instead of the mean of the
  two middle values;
* a trimmed mean that cuts by arrival position instead of sorting each
  coordinate, or cuts another count than ``floor(beta * n)``;
* Krum (and Multi-Krum, Bulyan's selection) scoring over the wrong number
  of neighbours (``n - f - 1``, ``n - f - 3``, all of them), counting a
  contributor as its own neighbour, or using distances instead of squared
  distances -- on rounds searched for where each of those picks another
  contribution than the right rule;
* a rule that accepts fewer contributors than it needs (Krum: n >= 2f + 3;
  Bulyan: n >= 4f + 3) or refuses without saying how many it needs;
* a stateful rule (``centered-clipping``) whose centre is not restored by
  ``load_state_dict`` after ``state_dict`` (a resumed run clipping around
  a fresh centre);
* a geometric median that is not one (the optimality condition fails).

**A new rule** (none of :data:`RULES`): leave ``rule`` unset and declare
how many outliers it tolerates (``outliers``, default ``options["f"]`` or 1)
and the fewest contributors it works with (``minimum_contributors``); the
suite then checks the properties every robust rule must have, with no
reference implementation of yours::

    class TestMyRule(RobustAggregatorContract):
        component = "my-rule"
        options = {"f": 2}
        minimum_contributors = 7

* the order contributions arrive in does not matter;
* ``f`` outliers have bounded influence at *any* finite magnitude (1e3 up
  to 1e300, colluding or spread, arriving first, in the middle or last): the
  result stays finite and within the honest contributions' range widened by
  their spread (and the round's reference, for a rule that uses one), so a
  mean, or a rule whose arithmetic overflows, fails;
* a non-finite contribution (NaN, +inf, -inf) is refused with
  :class:`meshkit.AggregationError` rather than folded or ignored silently;
* exactly ``minimum_contributors`` are accepted, and one fewer is refused
  with an error saying how many it needs.

Use it beside :class:`meshkit.testing.AggregatorContract` (strictness,
dtypes, JSON leaves, traits); the built-ins run both (tests/aggregation).
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Sequence

import numpy as np
import pytest

from meshkit.errors import AggregationError
from meshkit.testing.support import ContractBase, declared_traits

__all__ = ["RobustAggregatorContract", "RULES", "reference_krum_scores", "reference_bulyan"]

#: The rules the suite knows (the built-ins' names).
RULES = ("median", "trimmed-mean", "krum", "multi-krum", "bulyan", "geometric-median",
         "centered-clipping", "norm-bound")

State = Mapping[str, Any]


def reference_krum_scores(x: np.ndarray, f: int, *, neighbours: int | None = None,
                          squared: bool = True, self_neighbour: bool = False) -> np.ndarray:
    """Krum scores of the rows of ``x``; the keyword arguments make the classic mistakes."""
    n = len(x)
    d = np.array([[float(np.sum((a - b) ** 2)) for b in x] for a in x])
    if not squared:
        d = np.sqrt(d)
    k = max(1, n - f - 2) if neighbours is None else neighbours
    rows = []
    for i in range(n):
        others = np.sort(d[i]) if self_neighbour else np.sort(np.delete(d[i], i))
        rows.append(float(others[:k].sum()))
    return np.array(rows)


def reference_bulyan(x: np.ndarray, f: int) -> np.ndarray:
    """Bulyan (El Mhamdi et al. 2018) as Flower computes it, written out plainly.

    Ties (equal Krum scores, equal distances to the median) go to the
    lexicographically smaller contribution or value, so the result does not
    depend on arrival order; Flower breaks them by position.
    """
    remaining = list(range(len(x)))
    chosen = []
    for _ in range(len(x) - 2 * f):
        scores = reference_krum_scores(x[remaining], f)
        # Equal scores (mutual nearest neighbours): the lexicographically smaller row.
        best = min(range(len(remaining)),
                   key=lambda i: (scores[i], tuple(x[remaining[i]])))
        chosen.append(remaining.pop(best))
    selected = x[chosen]
    median = np.median(selected, axis=0)
    beta = len(chosen) - 2 * f
    out = np.empty(x.shape[1])
    for j in range(x.shape[1]):
        closest = sorted(range(len(selected)),
                         key=lambda i: (abs(selected[i, j] - median[j]), selected[i, j]))[:beta]
        out[j] = selected[closest, j].mean()
    return out


def _states(rows: np.ndarray) -> list[dict[str, Any]]:
    return [{"w": np.asarray(r, dtype=np.float64).copy()} for r in rows]


def _cloud(seed: int, n: int, d: int = 6) -> np.ndarray:
    """``n`` heavy-tailed points in ``d`` dimensions: distinct values, no ties."""
    return np.random.default_rng(seed).standard_t(2, size=(n, d)) * 3.0


class RobustAggregatorContract(ContractBase):
    """Conformance tests for a robust aggregator (see the module docstring)."""

    kind: ClassVar[str] = "aggregator"
    #: Which rule the component implements (one of :data:`RULES`), or None for
    #: a new rule, checked by the generic properties (module docstring).
    rule: ClassVar[str | None] = None
    #: A new rule: how many outliers it tolerates (default ``options["f"]``, else 1).
    outliers: ClassVar[int | None] = None
    #: A new rule: the fewest contributors it works with (fewer must be refused).
    minimum_contributors: ClassVar[int] = 1

    # -- helpers ---------------------------------------------------------

    def _rule(self) -> str:
        """The rule's name, or ``"new"`` for a rule the suite has no reference of."""
        if self.rule is None:
            return "new"
        if self.rule not in RULES:
            pytest.fail(f"{type(self).__name__}: set `rule` to one of {', '.join(RULES)}, or "
                        f"leave it unset for a new rule (got {self.rule!r})", pytrace=False)
        return str(self.rule)

    def _only(self, *rules: str) -> None:
        if self._rule() not in rules:
            pytest.skip(f"not a {' or '.join(rules)} rule")

    @property
    def f(self) -> int:
        if self.rule is None:
            return int(self.outliers if self.outliers is not None else self.options.get("f", 1))
        return int(self.options.get("f", 0))

    def minimum(self) -> int:
        """The fewest contributors the rule works with."""
        rule = self._rule()
        if rule == "new":
            return int(self.minimum_contributors)
        if rule in ("krum", "multi-krum"):
            return 2 * self.f + 3
        if rule == "bulyan":
            return 4 * self.f + 3
        return 1

    def run(self, rows: np.ndarray, agg: Any = None, reference: State | None = None) -> np.ndarray:
        agg = self.make() if agg is None else agg
        states = _states(rows)
        if reference is None and self.rule is None and declared_traits(agg).uses_reference:
            reference = {"w": np.zeros(rows.shape[1])}  # the updates are the rows themselves
        if reference is not None:
            return np.asarray(agg.aggregate(states, None, reference=reference)["w"])
        return np.asarray(agg.aggregate(states)["w"])

    # -- every rule ------------------------------------------------------

    def test_the_order_of_contributions_does_not_matter(self) -> None:
        self._rule()
        n = max(15, self.minimum())
        for seed in range(3):
            rows = _cloud(100 + seed, n)
            expected = self.run(rows)
            for shuffle in range(4):
                order = np.random.default_rng(seed * 10 + shuffle).permutation(n)
                got = self.run(rows[order])
                np.testing.assert_allclose(
                    got, expected, rtol=1e-9, atol=1e-12,
                    err_msg=f"{self.rule}: the result changed when the same {n} "
                            f"contributions arrived in another order (permutation {order})")

    def test_too_few_contributors_are_refused_saying_how_many(self) -> None:
        needed = self.minimum()
        if needed <= 1 and self.rule is None:
            self.run(_cloud(7, 1))  # a new rule declaring no minimum works with one
            return
        if needed <= 1:
            pytest.skip(f"{self.rule} works with one contributor")
        self.run(_cloud(7, needed))  # exactly enough: fine
        with pytest.raises(AggregationError) as info:
            self.run(_cloud(7, needed - 1))
        assert str(needed) in str(info.value), (
            f"{self.rule} refused {needed - 1} contributors without saying it needs "
            f"{needed}: {info.value}")

    # -- a new rule: the generic properties ------------------------------------

    @pytest.mark.parametrize("magnitude", [1e3, 1e20, 1e100, 1e155, 1e300], ids=lambda m: f"{m:g}")
    def test_f_outliers_have_bounded_influence_at_any_magnitude(self, magnitude: float) -> None:
        self._only("new")
        f = self.f
        n = max(self.minimum(), 4 * f + 6)
        rng = np.random.default_rng(31)
        honest = rng.uniform(-1.0, 1.0, (n - f, 6))
        low, high = honest.min(axis=0), honest.max(axis=0)
        if declared_traits(self.make()).uses_reference:  # clipped toward the reference (0)
            low, high = np.minimum(low, 0.0), np.maximum(high, 0.0)
        spread = high - low
        signs = np.where(np.arange(6) % 2 == 0, 1.0, -1.0)
        attacks = {
            "colluding": np.tile(magnitude * signs, (f, 1)),
            "spread": magnitude * signs * np.linspace(0.5, 1.0, f)[:, None],
        }
        for what, outliers in attacks.items():
            for arriving, at in (("first", 0), ("in the middle", (n - f) // 2), ("last", n - f)):
                rows = np.concatenate([honest[:at], outliers, honest[at:]])
                got = self.run(rows)
                inside = np.isfinite(got).all() and np.all(got >= low - spread) and \
                    np.all(got <= high + spread)
                assert inside, (
                    f"{f} {what} outlier(s) at magnitude {magnitude:g} among {n} contributions "
                    f"(arriving {arriving}) moved the result to {np.array2string(got, precision=3)}"
                    f", outside the honest contributions' range widened by their spread "
                    f"[{(low - spread).min():.3g}, {(high + spread).max():.3g}]: the rule "
                    f"declares it tolerates f = {f}, at any finite magnitude (does its "
                    f"arithmetic overflow, or do outliers keep a share of the result?)")

    @pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")],
                             ids=["nan", "inf", "-inf"])
    def test_a_non_finite_contribution_is_refused(self, value: float) -> None:
        self._only("new")
        rows = _cloud(41, max(self.minimum(), 2 * self.f + 5))
        rows[len(rows) // 2, 3] = value
        try:
            got = self.run(rows)
        except AggregationError:
            return
        except Exception as exc:
            pytest.fail(f"a contribution holding {value} should be refused with "
                        f"meshkit.AggregationError, got {type(exc).__name__}: {exc}",
                        pytrace=False)
        pytest.fail(f"a contribution holding {value} was aggregated (result "
                    f"{np.array2string(got, precision=3)}); refuse it with AggregationError so "
                    f"the round drops its sender instead of folding or silently ignoring it",
                    pytrace=False)

    # -- median ----------------------------------------------------------

    def test_an_even_count_median_is_the_mean_of_the_two_middle_values(self) -> None:
        self._only("median")
        rows = np.array([[0.0, 11.0], [10.0, 1.0], [1.0, 10.0], [11.0, 0.0]])
        np.testing.assert_allclose(self.run(rows), [5.5, 5.5], err_msg=(
            "median of an even count: expected the mean of the two middle values (as "
            "numpy and Flower's FedMedian), not one side"))

    def test_an_odd_count_median_is_the_middle_value(self) -> None:
        self._only("median")
        rows = np.array([[3.0], [-100.0], [2.0], [100.0], [1.0]])
        np.testing.assert_allclose(self.run(rows), [2.0])

    # -- trimmed mean ----------------------------------------------------

    def _beta(self) -> float:
        return float(self.options.get("beta", 0.2))

    def test_a_trimmed_mean_sorts_each_coordinate_before_cutting(self) -> None:
        self._only("trimmed-mean")
        n = 20
        cut = int(self._beta() * n)
        if cut == 0:
            pytest.skip("beta cuts nothing from 20 contributors")
        # The extremes arrive in the middle of the round, differently per coordinate.
        rng = np.random.default_rng(3)
        ranked = np.sort(rng.standard_t(2, size=(n, 5)) * 10.0, axis=0)
        rows = np.empty_like(ranked)
        middle = np.arange(n // 2 - cut, n // 2 + cut)
        ends = np.setdiff1d(np.arange(n), middle)
        for j in range(5):
            extremes = np.r_[0:cut, n - cut:n]
            rows[middle, j] = ranked[rng.permutation(extremes), j]
            rows[ends, j] = ranked[rng.permutation(np.arange(cut, n - cut)), j]
        expected = np.sort(rows, axis=0)[cut:n - cut].mean(axis=0)
        np.testing.assert_allclose(self.run(rows), expected, rtol=1e-12, err_msg=(
            "trimmed mean: each coordinate must be sorted before floor(beta * n) values are "
            "cut from each end; this result cut by arrival position"))

    def test_a_trimmed_mean_cuts_floor_of_beta_times_n(self) -> None:
        self._only("trimmed-mean")
        for n in (9, 11, 14):
            rows = _cloud(n, n)
            cut = int(self._beta() * n)
            expected = np.sort(rows, axis=0)[cut:n - cut].mean(axis=0)
            np.testing.assert_allclose(self.run(rows), expected, rtol=1e-12, err_msg=(
                f"trimmed mean of {n} with beta = {self._beta()}: expected floor(beta * n) = "
                f"{cut} cut from each end (Flower's FedTrimmedAvg, scipy's trim_mean)"))

    # -- krum, multi-krum, bulyan --------------------------------------------

    def _discriminating_round(self, n: int, m: int) -> np.ndarray:
        """A round where the right Krum selection differs from every classic mistake's."""
        f, right_k = self.f, max(1, n - self.f - 2)
        mistakes: list[dict[str, Any]] = [
            {"neighbours": k} for k in sorted({n - f - 1, max(1, n - f - 3), n - 1})
            if k != right_k]
        mistakes += [{"self_neighbour": True}, {"squared": False}]
        for seed in range(500):
            rows = _cloud(1000 + seed, n)

            def picks(**mistake: Any) -> set[int]:
                scores = reference_krum_scores(rows, f, **mistake)
                return set(np.argsort(scores, kind="stable")[:m].tolist())

            right = picks()
            if all(picks(**mistake) != right for mistake in mistakes):
                return rows
        raise AssertionError(f"no round of {n} found that tells Krum from its mistakes")

    def test_krum_scores_over_n_minus_f_minus_2_squared_distances(self) -> None:
        self._only("krum", "multi-krum")
        f, n = self.f, max(9, self.minimum() + 2)
        m = 1 if self.rule == "krum" else int(self.options.get("m", 0)) or n - f
        rows = self._discriminating_round(n, m)
        best = np.argsort(reference_krum_scores(rows, f), kind="stable")[:m]
        expected = rows[best].mean(axis=0)
        np.testing.assert_allclose(self.run(rows), expected, rtol=1e-12, err_msg=(
            f"{self.rule} with f = {f}: each score must sum the squared distances to the "
            f"n - f - 2 = {n - f - 2} nearest other contributions; this result picked "
            f"another selection"))

    def test_bulyan_matches_the_papers_rule(self) -> None:
        self._only("bulyan")
        f = self.f
        for seed in range(3):
            n = self.minimum() + seed
            rows = _cloud(50 + seed, n)
            np.testing.assert_allclose(self.run(rows), reference_bulyan(rows, f), rtol=1e-12,
                                       err_msg=f"bulyan with n = {n}, f = {f}")

    # -- geometric median --------------------------------------------------

    def test_the_geometric_median_is_optimal(self) -> None:
        self._only("geometric-median")
        rows = _cloud(8, 12)
        z = self.run(rows)
        distance = np.linalg.norm(rows - z, axis=1)
        # The subgradient of sum ||z - x_i|| at z: small next to any single term (1).
        gradient = np.linalg.norm(((z - rows) / np.maximum(distance, 1e-12)[:, None]).sum(0))
        assert gradient < 0.05, (
            f"geometric median: the optimality condition fails (|sum (z - x_i)/||z - x_i||| "
            f"= {gradient:.3g}); this is not the minimiser of the summed distances")

    # -- stateful rules ----------------------------------------------------

    def test_the_centre_is_restored_on_resume(self) -> None:
        self._only("centered-clipping")
        rng = np.random.default_rng(21)
        reference = {"w": np.zeros(6)}
        rounds = [rng.standard_normal((9, 6)) * 3.0 + 2.0 for _ in range(3)]
        straight = self.make()
        expected = [self.run(r, straight, reference) for r in rounds]
        first = self.make()
        self.run(rounds[0], first, reference)
        saved = first.state_dict()
        resumed = self.make()
        resumed.load_state_dict(saved)
        got = [self.run(r, resumed, reference) for r in rounds[1:]]
        fresh = self.run(rounds[1], self.make(), reference)
        assert not np.allclose(fresh, expected[1]), (
            "these rounds cannot tell a carried centre from a fresh one; the check is void")
        for i, (a, b) in enumerate(zip(got, expected[1:]), start=2):
            np.testing.assert_allclose(a, b, rtol=1e-12, err_msg=(
                f"round {i} after load_state_dict(state_dict()) differs from the run that "
                f"never stopped: the centre is not restored on resume"))

    def test_updates_are_measured_from_the_reference(self) -> None:
        self._only("centered-clipping", "norm-bound")
        rows = _cloud(4, 9)
        shift = np.full(6, 1000.0)
        at_zero = self.run(rows, reference={"w": np.zeros(6)})
        shifted = self.run(rows + shift, reference={"w": shift})
        np.testing.assert_allclose(shifted - shift, at_zero, rtol=1e-9, atol=1e-9, err_msg=(
            f"{self.rule}: the same updates around another global model gave another "
            f"update; the rule must work on contribution - reference"))
