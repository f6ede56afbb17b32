"""Distributed DP (``[privacy] placement = "distributed"``): the Skellam accountant against an
independent reference, the noise in the unmasked sum, dropouts raising ε, and the refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshkit import RefusedError
from meshkit.config import parse_config
from meshkit.privacy import (SkellamAccountant, epsilon_skellam, field_levels, plan_skellam,
                             skellam_rdp, subsampled_rdp)
from meshkit.privacy._accountant import _rdp as gaussian_rdp
from meshkit.train import build_components
from meshkit.train._coordinator.plan import resolve
from meshkit_privacy.distributed import DistributedSkellam
from meshkit_secagg import SecAggParams, simulate_round

REFERENCE = Path(__file__).parent / "data" / "skellam_reference.json"


def _reference() -> dict[str, Any]:
    return json.loads(REFERENCE.read_text())


@pytest.mark.parametrize("case", _reference()["cases"],
                         ids=lambda c: f"z{c['noise_multiplier']}-q{c['q']}-T{c['rounds']}")
def test_the_accountant_is_within_one_percent_of_the_mpmath_reference(case):
    # benchmarks/skellam_reference.py: exact Skellam divergences at 50 digits (no closed form)
    ours = epsilon_skellam([(case["q"], case["mu"], case["l2"], case["l1"], case["rounds"])],
                           case["delta"])
    assert ours == pytest.approx(float(case["epsilon"]), rel=0.01)


def test_the_closed_form_bounds_the_exact_divergence_from_above():
    for case in _reference()["cases"]:
        for order, exact in case["exact_rdp"].items():
            bound = skellam_rdp(int(order), case["mu"], case["l2"], case["l1"])
            assert float(exact) <= bound


@pytest.mark.parametrize("mixture", _reference()["mixtures"],
                         ids=lambda m: f"z{m['noise_multiplier']}-q{m['q']}-a{m['order']}")
def test_the_expansion_is_the_exact_mixture_and_the_add_direction_is_below_it(mixture):
    # benchmarks/skellam_reference.py sums both directions of the subsampled mixture itself
    # at 50 digits (no expansion): the binomial expansion of the remove direction is exact,
    # the add direction never exceeds it (docs/privacy.md, "Accounting"), and Zhu and
    # Wang's general bound, which the accountant used before, lies above both (equal at α = 2,
    # where it has no j >= 3 terms to triple).
    remove, add = float(mixture["exact_remove"]), float(mixture["exact_add"])
    assert float(mixture["expansion"]) == pytest.approx(remove, rel=1e-12)
    assert add <= remove
    assert float(mixture["zhu_wang_bound"]) >= remove
    # and the accountant's float64 expansion, with the closed-form per-order bound, bounds
    # the exact remove direction from above and stays within 2 % of it (the closed form is
    # itself 1.5 % above the exact divergence at order 32, 16.001 against 15.771)
    ours = subsampled_rdp(mixture["order"], mixture["q"], mixture["mu"], mixture["l2"],
                          mixture["l1"])
    assert remove <= ours <= remove * 1.02


def _divergence(p: np.ndarray, m: np.ndarray, alpha: float) -> float:
    """D_α(p‖m), summed in logs (the pairs below span hundreds of orders of magnitude)."""
    logs = alpha * np.log(p) + (1 - alpha) * np.log(m)
    top = float(logs.max())
    return (top + math.log(float(np.exp(logs - top).sum()))) / (alpha - 1)


def test_for_a_pair_a_bijection_swaps_adding_never_costs_more_than_removing():
    # The lemma behind counting one direction: P and Q = P∘σ for an involution σ of the
    # outputs (k -> Δ - k for Skellam noise), M = (1-q)P + qQ; then D_α(P‖M) <= D_α(M‖P)
    # for every real α > 1 and q in [0, 1]. Random pairs on 2·20 points, σ swapping halves.
    rng = np.random.default_rng(3)
    for _ in range(2000):
        half = rng.exponential(size=20) ** rng.uniform(1, 6)
        other = rng.exponential(size=20) ** rng.uniform(1, 6)
        p = np.concatenate([half, other])
        p /= p.sum()
        q_dist = np.concatenate([p[20:], p[:20]])  # Q = P∘σ
        q, alpha = rng.uniform(0, 1), rng.uniform(1.01, 40)
        m = (1 - q) * p + q * q_dist
        remove, add = _divergence(m, p, alpha), _divergence(p, m, alpha)
        assert add <= remove * (1 + 1e-9) + 1e-12
    # Without the symmetry the lemma fails: P uniform on two points, Q a point mass.
    p, q_dist = np.array([0.5, 0.5]), np.array([1.0, 1e-300])
    m = 0.5 * p + 0.5 * q_dist
    assert _divergence(p, m, 2.0) > _divergence(m, p, 2.0)


def test_with_the_gaussians_divergences_the_expansion_is_the_sampled_gaussians():
    # On a fine grid the Skellam's per-order bound is the Gaussian's α/(2z²) (its correction
    # is O(1/μ)); the expansion then reproduces Mironov et al.'s A_α for integer α, which
    # meshkit's Gaussian RDP accountant computes by its own code.
    grid, z = float(1 << 20), 1.3
    for q in (0.01, 0.05, 0.3):
        for alpha in (2, 3, 8, 32, 64):
            ours = subsampled_rdp(alpha, q, (z * grid) ** 2, grid, grid)
            assert ours == pytest.approx(gaussian_rdp(q, z, float(alpha)), rel=1e-8)


def _plan(cohort: int = 10, length: int = 20_000, bits: int = 32, z: float = 1.0,
          clip: float = 2.0) -> Any:
    return plan_skellam(clip_norm=clip, noise_multiplier=z, cohort=cohort, length=length,
                        levels=field_levels(bits, cohort), bits=bits)


def test_a_population_grid_is_the_same_whoever_is_sampled():
    # docs/privacy.md, "The adding client's own noise share": with the grid planned for the
    # run's 500 clients, a cohort of n and one of n + 1 (the same clients and u) have the same
    # grid and Δ₂, and their shares, μ/n each or μ/(n + 1) each, sum to the same Sk(μ): the
    # release with u is the one without u shifted by u's rounded update, the pair the
    # accountant bounds. Every cohort up to the population fits its share of the field.
    population, bits, length, z = 500, 25, 650, 1.07

    def plan(n: int, whole: int | None = population) -> Any:
        return plan_skellam(clip_norm=1.0, noise_multiplier=z, cohort=n, length=length,
                            levels=field_levels(bits, n), bits=bits, population=whole)

    first = plan(1)
    mu = (z * first.scale) ** 2
    for n in range(1, population + 1):
        each = plan(n)
        assert (each.scale, each.bound, each.half) == (first.scale, first.bound,
                                                      field_levels(bits, n) // 2)
        assert each.sum_variance(n) == pytest.approx(mu, rel=1e-12)
    # Planned per cohort (no population), the grid widens as the cohort shrinks: u's
    # presence would change the grid, and the release's lattice would tell the cohort size.
    assert plan(25, None).scale > plan(26, None).scale > first.scale
    with pytest.raises(ValueError, match="smaller than the cohort"):
        plan(population + 1)


def _clipped(rng: np.random.Generator, length: int, norm: float) -> np.ndarray:
    update = rng.normal(size=length)
    return update * (norm / np.linalg.norm(update))


def test_the_unmasked_sum_carries_the_calibrated_noise():
    # 10 clients mask Skellam-noised updates in a real SecAgg+ round: what the coordinator
    # unmasks deviates from the exact sum of the clipped updates with variance (z S)^2.
    n, length, clip, z = 10, 20_000, 2.0, 1.0
    plan = _plan(n, length, clip=clip, z=z)
    params = SecAggParams(clients=n, degree=0, threshold=6, clip_range=1.0, modulus_bits=32)
    rng = np.random.default_rng(7)
    updates = {c: _clipped(rng, length, clip * 0.999) for c in range(n)}
    inputs = {c: plan.encode(u, np.random.default_rng(100 + c), np.uint32)[0]
              for c, u in updates.items()}
    for vector in inputs.values():  # each client's input stays within its share of the field
        assert int(vector.max()) <= 2 * plan.half <= params.levels
    round_ = simulate_round(params, inputs, bytes(32))
    released = plan.decode(round_.result.total, len(round_.result.contributors))
    deviation = released - sum(updates.values())
    # rounding adds at most n/4 grid steps^2 of variance, far below the noise's
    expected = (z * clip) ** 2 + n / 4 / plan.scale ** 2
    # the sample variance of 20,000 near-Gaussian draws: relative sd sqrt(2/20000) = 1 %;
    # a 10 % bound is 10 sd (the chance of a false failure is below 1e-20)
    assert float(np.var(deviation)) == pytest.approx(expected, rel=0.10)
    assert abs(float(np.mean(deviation))) < 10 * z * clip / math.sqrt(length)
    # the exact, noiseless sum is never what is released
    assert float(np.max(np.abs(deviation))) > z * clip


def test_survivors_carry_only_their_own_noise_and_the_accountant_says_so():
    n, length, clip = 10, 20_000, 1.0
    plan = _plan(n, length, clip=clip)
    params = SecAggParams(clients=n, degree=0, threshold=6, clip_range=1.0, modulus_bits=32)
    inputs = {c: plan.encode(np.zeros(length), np.random.default_rng(c), np.uint32)[0]
              for c in range(n)}
    gone = {0, 1, 2, 3}
    round_ = simulate_round(params, inputs, bytes(32), drop_before_sharing=gone)
    survivors = len(round_.result.contributors)
    assert survivors == n - len(gone)
    released = plan.decode(round_.result.total, survivors)
    noise = plan.sum_variance(survivors) / plan.scale ** 2  # 6/10 of (z S)^2
    assert float(np.var(released)) == pytest.approx(noise, rel=0.10)
    assert noise == pytest.approx(0.6 * clip ** 2, rel=1e-9)


def test_a_dropout_raises_epsilon_and_each_round_is_reported():
    mech = DistributedSkellam(clip_norm=1.0, noise_multiplier=1.0)
    mech.plan_round(cohort=20, length=650, bits=25)
    planned = mech.epsilon_after(0.05)
    full = mech.finish_round(0.05, 20)
    assert full["epsilon"] == pytest.approx(planned, rel=1e-9)
    assert full["noise_multiplier_realized"] == pytest.approx(1.0, rel=1e-3)
    lossy = DistributedSkellam(clip_norm=1.0, noise_multiplier=1.0)
    lossy.plan_round(cohort=20, length=650, bits=25)
    dropped = lossy.finish_round(0.05, 12)  # 8 of 20 dropped: 60 % of the noise
    assert dropped["round_epsilon"] > full["round_epsilon"] * 1.2
    assert dropped["epsilon"] > full["epsilon"]
    assert dropped["noise_multiplier_realized"] == pytest.approx(math.sqrt(0.6), rel=1e-3)
    # composed: a later full round leaves the lossy run above the clean one
    assert lossy.finish_round(0.05, 20)["epsilon"] > mech.finish_round(0.05, 20)["epsilon"]


def test_the_accountant_round_trips_its_state():
    acc = SkellamAccountant(1e-5)
    acc.compose(0.05, 1e8, 1e4, 1e6)
    acc.compose(0.05, 1e8, 1e4, 1e6)
    acc.compose(0.05, 6e7, 1e4, 1e6)
    again = SkellamAccountant(1e-5)
    again.load_state_dict(json.loads(json.dumps(acc.state_dict())))
    assert again.rounds == 3 and again.epsilon() == acc.epsilon()
    with pytest.raises(ValueError, match="accountant"):
        SkellamAccountant(1e-6).load_state_dict(acc.state_dict())


def test_conditional_rounding_keeps_the_accounted_bound_and_refuses_an_unclipped_update():
    plan = _plan(5, 1000, clip=1.0)
    rng = np.random.default_rng(1)
    for _ in range(20):
        rounded = plan.round(_clipped(rng, 1000, 1.0), rng)
        assert float(np.linalg.norm(rounded)) <= plan.bound
    with pytest.raises(Exception, match="not clipped"):
        plan.round(_clipped(rng, 1000, 1.5), rng)


def test_a_field_too_narrow_for_the_grid_is_refused_naming_what_would_do():
    with pytest.raises(RefusedError, match=r"modulus_bits = (\d+)") as info:
        _plan(cohort=1000, length=100_000, bits=20)
    need = int(info.value.args[0].split("modulus_bits = ")[2].split()[0].rstrip(","))
    _plan(cohort=1000, length=100_000, bits=need)  # what it names does fit
    with pytest.raises(RefusedError):
        _plan(cohort=1000, length=100_000, bits=need - 1)


def _config(**tables: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "run": {"out": "unused", "seed": 1}, "mesh": {"workers": 2},
        "strategy": {"rounds": 2, "clients": 40, "fraction": 0.25, "sampling": "poisson"},
        "privacy": {"name": "dp-fixed", "placement": "distributed", "clip": "client"},
        "secure_aggregation": {"name": "secagg+"}}
    for name, table in tables.items():
        if table is None:
            config.pop(name)
        else:
            config[name] = {**config.get(name, {}), **table}
    return config


def _build(config: dict[str, Any]) -> dict[str, Any]:
    return build_components(resolve(parse_config(config)))


def test_a_distributed_config_builds_the_skellam_mechanism():
    built = _build(_config())
    assert isinstance(built["privacy"], DistributedSkellam)


@pytest.mark.parametrize("change, says", [
    ({"secure_aggregation": None}, "Add \\[secure_aggregation\\]"),
    ({"compression": {"name": "quantize", "bits": 8}}, "Drop \\[compression\\]"),
    ({"privacy": {"accountant": "pld"}}, "accountant = \"skellam\""),
    ({"privacy": {"name": "dp-adaptive"}}, "adaptive clipping"),
])
def test_what_distributed_dp_cannot_honour_is_refused_with_the_fix(change, says):
    config = _config(**change)
    if config["privacy"]["name"] == "dp-adaptive":
        config["privacy"] = {"name": "dp-adaptive", "placement": "distributed",
                             "clip": "client"}
    with pytest.raises(RefusedError, match=says):
        _build(config)


def test_a_skellam_accountant_with_central_noise_is_refused():
    with pytest.raises(RefusedError, match="does not account"):
        _build(_config(privacy={"placement": "central", "accountant": "skellam"}))
