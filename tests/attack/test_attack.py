"""The attack contract and the built-in attacks, on hand-computed updates."""

from __future__ import annotations

from statistics import NormalDist

import numpy as np
import pytest

import meshkit
from meshkit import AggregationError, ConfigError
from meshkit.attack import (AttackRound, attack_rng, choose_attackers, from_update,
                            tamper_contribution, to_update)


def attack(name: str, **options):
    return meshkit.plugins.create("attack", name, options)


def round_(honest=(), contributors=5, attackers=1, client=0, seed=0) -> AttackRound:
    return AttackRound(client=client, contributors=contributors, attackers=attackers,
                       rng=attack_rng(0, seed), honest=list(honest))


REFERENCE = {"w": np.array([1.0, 1.0], np.float32), "n": np.array(3, np.int64), "m": {"a": 1}}
MINE = {"w": np.array([1.5, 0.0], np.float32), "n": np.array(3, np.int64), "m": {"a": 1}}


def test_an_update_is_the_contribution_minus_the_reference_over_float_leaves():
    update = to_update(MINE, REFERENCE)
    assert list(update) == ["w"]
    np.testing.assert_array_equal(update["w"], [0.5, -1.0])
    back = from_update(MINE, {"w": np.array([-0.5, 1.0])}, REFERENCE)
    assert back["w"].dtype == np.float32 and back["n"] is MINE["n"] and back["m"] == {"a": 1}
    np.testing.assert_array_equal(back["w"], [0.5, 2.0])


def test_sign_flip_sends_minus_factor_times_the_update():
    out = tamper_contribution(attack("sign-flip", factor=3.0), MINE, REFERENCE, round_())
    np.testing.assert_allclose(out["w"], [1 - 1.5, 1 + 3.0])


def test_scale_sends_factor_times_the_update():
    out = tamper_contribution(attack("scale"), MINE, REFERENCE, round_())
    np.testing.assert_allclose(out["w"], [1 + 5.0, 1 - 10.0])


def test_same_value_sets_every_coordinate_of_the_update():
    out = tamper_contribution(attack("same-value", value=2.0), MINE, REFERENCE, round_())
    np.testing.assert_allclose(out["w"], [3.0, 3.0])


def test_gaussian_noise_is_seeded_by_the_run_round_and_client():
    a = tamper_contribution(attack("gaussian", sigma=2.0), MINE, REFERENCE, round_(seed=4))
    b = tamper_contribution(attack("gaussian", sigma=2.0), MINE, REFERENCE, round_(seed=4))
    c = tamper_contribution(attack("gaussian", sigma=2.0), MINE, REFERENCE, round_(seed=5))
    np.testing.assert_array_equal(a["w"], b["w"])
    assert not np.array_equal(a["w"], c["w"])


def test_ipm_sends_minus_epsilon_times_the_honest_mean():
    honest = [{"w": np.array([1.0, 2.0])}, {"w": np.array([3.0, 4.0])}]
    out = attack("ipm", epsilon=0.5).tamper({"w": np.zeros(2)}, round_(honest))
    np.testing.assert_allclose(out["w"], [-1.0, -1.5])


def test_alie_sends_the_honest_mean_minus_z_max_deviations():
    honest = [{"w": np.array([0.0, 10.0])}, {"w": np.array([2.0, 10.0])}]
    # n = 20, f = 4: s = floor(11) - 4 = 7; z = Phi^-1(13 / 20).
    z = NormalDist().inv_cdf(13 / 20)
    assert z == pytest.approx(0.3853, abs=1e-4)
    out = attack("alie").tamper({"w": np.zeros(2)}, round_(honest, contributors=20,
                                                           attackers=4))
    np.testing.assert_allclose(out["w"], [1.0 - z * 1.0, 10.0])
    given = attack("alie", z=2.0).tamper({"w": np.zeros(2)}, round_(honest))
    np.testing.assert_allclose(given["w"], [-1.0, 10.0])


@pytest.mark.parametrize("name", ["ipm", "alie"])
def test_an_omniscient_attack_without_honest_updates_is_refused(name):
    with pytest.raises(AggregationError, match="no honest contribution"):
        attack(name).tamper({"w": np.zeros(2)}, round_())


def test_label_flip_poisons_the_labels_not_the_update():
    flip = attack("label-flip")
    assert flip.poisons_data
    x, y = flip.poison(np.zeros((3, 2)), np.array([0, 3, 9]), classes=10)
    np.testing.assert_array_equal(y, [9, 6, 0])


def test_a_poisoned_contribution_that_is_not_finite_is_refused():
    with pytest.raises(AggregationError, match="non-finite values in 'w'; lower"):
        tamper_contribution(attack("scale", factor=1e308), MINE, REFERENCE, round_())


def test_attackers_are_the_listed_clients_or_a_seeded_fraction():
    assert choose_attackers(10, explicit=[7, 2, 2]) == (2, 7)
    chosen = choose_attackers(20, fraction=0.2, seed=3)
    assert len(chosen) == 4 and chosen == choose_attackers(20, fraction=0.2, seed=3)
    assert chosen != choose_attackers(20, fraction=0.2, seed=4)
    with pytest.raises(ConfigError, match=r"clients: \[12\] are not clients of this run"):
        choose_attackers(10, explicit=[12])
    with pytest.raises(ConfigError, match="rounds to no attacker"):
        choose_attackers(3, fraction=0.1)


def test_every_built_in_attack_is_listed_with_a_summary():
    names = meshkit.plugins.available("attack")
    assert set(names) == {"sign-flip", "scale", "gaussian", "label-flip", "ipm", "alie",
                          "same-value"}
    assert all(c.summary for c in names.values())


def test_fraction_of_a_small_run_keeps_the_permutation_its_figures_were_made_with():
    # docs/robustness.md's matrix: 4 of 20 clients from one seeded permutation.
    order = np.random.default_rng([0, 0xA77AC]).permutation(20)
    assert tuple(choose_attackers(20, fraction=0.2, seed=0)) == tuple(sorted(order[:4]))


def test_fraction_of_a_population_is_exact_and_costs_nothing_per_client(monkeypatch):
    # 100,000 clients: no permutation of every client, no list of 20,000 ids (issue 35, 13).
    def no_generator(*args, **kwargs):
        raise AssertionError("choose_attackers drew from a generator over every client")

    monkeypatch.setattr(np.random, "default_rng", no_generator)
    chosen = choose_attackers(100_000, fraction=0.2, seed=7)
    monkeypatch.undo()
    assert len(chosen) == 20_000 and chosen.bijection is not None
    # Membership is exact: precisely `count` clients are in, each id once.
    members = list(chosen)
    assert len(members) == len(set(members)) == 20_000
    assert all(c in chosen for c in members[:500])
    outside = sorted(set(range(2_000)) - set(members))
    assert outside and not any(c in chosen for c in outside)
    assert -1 not in chosen and 100_000 not in chosen
    # Seeded: the same run seed, the same attackers; another seed, others.
    assert choose_attackers(100_000, fraction=0.2, seed=7) == chosen
    assert choose_attackers(100_000, fraction=0.2, seed=8) != chosen
    assert chosen.describe().startswith("20,000 of 100,000 (e.g. [")
