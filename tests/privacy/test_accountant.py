"""The accountant: ε of the Poisson-subsampled Gaussian against Google's dp-accounting."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from meshkit.privacy import Accountant, effective_noise_multiplier, epsilon_pld, epsilon_rdp

#: Computed once with dp-accounting 0.6 (benchmarks/privacy_reference.py).
REFERENCE = json.loads((Path(__file__).parent / "data" / "dp_accounting_reference.json")
                       .read_text())["rows"]


def _id(row: dict) -> str:
    return f"q={row['q']}-z={row['z']}-T={row['rounds']}-delta={row['delta']}"


@pytest.mark.parametrize("row", REFERENCE, ids=_id)
def test_pld_epsilon_is_within_one_percent_of_dp_accounting(row: dict) -> None:
    eps = epsilon_pld([(row["q"], row["z"], row["rounds"])], row["delta"])
    assert eps == pytest.approx(row["pld"], rel=0.01)


@pytest.mark.parametrize("row", REFERENCE, ids=_id)
def test_rdp_epsilon_is_within_one_percent_of_dp_accounting(row: dict) -> None:
    eps = epsilon_rdp([(row["q"], row["z"], row["rounds"])], row["delta"])
    assert eps == pytest.approx(row["rdp"], rel=0.01)


def test_the_issue_figures_poisson_005_z1_200_rounds() -> None:
    rounds = [(0.05, 1.0, 200)]
    assert epsilon_pld(rounds, 1e-5) == pytest.approx(4.77, abs=0.01)
    assert epsilon_rdp(rounds, 1e-5) == pytest.approx(5.37, abs=0.01)


def test_a_coarser_grid_never_reports_less_than_a_finer_one() -> None:
    # pessimistic discretisation: every grid gives an upper bound, and the
    # bound tightens as the grid is refined
    rounds = [(0.01, 1.0, 500)]
    coarse, fine = (epsilon_pld(rounds, 1e-5, interval=h) for h in (1e-2, 1e-3))
    assert coarse >= fine > 0


def test_more_rounds_more_noise_and_less_sampling_move_epsilon_the_right_way() -> None:
    base = epsilon_pld([(0.05, 1.0, 100)], 1e-5)
    assert epsilon_pld([(0.05, 1.0, 200)], 1e-5) > base
    assert epsilon_pld([(0.05, 2.0, 100)], 1e-5) < base
    assert epsilon_pld([(0.02, 1.0, 100)], 1e-5) < base
    assert epsilon_pld([], 1e-5) == 0.0


def test_groups_compose_as_their_rounds_would() -> None:
    split = epsilon_pld([(0.05, 1.0, 60), (0.05, 1.0, 40)], 1e-5, interval=1e-3)
    whole = epsilon_pld([(0.05, 1.0, 100)], 1e-5, interval=1e-3)
    assert split == pytest.approx(whole, rel=1e-3)


def test_accountant_state_round_trips_to_the_same_epsilon() -> None:
    acc = Accountant("pld", 1e-5)
    for _ in range(30):
        acc.compose(0.05, 1.0)
    acc.compose(0.1, 1.0, 5)
    again = Accountant("pld", 1e-5)
    again.load_state_dict(json.loads(json.dumps(acc.state_dict())))
    assert again.rounds == 35
    assert again.epsilon() == acc.epsilon()  # bit for bit
    assert acc.epsilon(extra=[(0.1, 1.0, 1)]) > acc.epsilon()


def test_a_checkpoint_from_another_accountant_is_refused() -> None:
    acc = Accountant("rdp", 1e-5)
    with pytest.raises(ValueError, match="'pld' at delta"):
        acc.load_state_dict(Accountant("pld", 1e-5).state_dict())


def test_effective_noise_multiplier_of_sum_and_count() -> None:
    # Andrew et al. 2021: (z^-2 + z_b^-2)^-1/2, below both
    z = effective_noise_multiplier(1.0, 10.0)
    assert z == pytest.approx(1 / math.sqrt(1.01))
    assert z < 1.0


@pytest.mark.parametrize("q, z, rounds", [(0.05, 1.0, 37), (0.01, 0.7, 200), (0.2, 2.0, 3)])
def test_the_one_round_distribution_worked_out_once_composes_to_the_same_bits(q, z, rounds):
    # A run composes the same one-round distribution every round: it is cached, with its
    # Chernoff curve; the composition must be the very bits of working it out afresh.
    from meshkit.privacy._accountant import _Pmf, _connect_dots, _one_round

    for direction in ("remove", "add"):
        fresh = _Pmf(*_connect_dots(q, z, 0.005, direction)).truncated().power(rounds)
        cached = _one_round(q, z, 0.005, direction).power(rounds)
        assert (cached.lo, cached.infinity) == (fresh.lo, fresh.infinity)
        np.testing.assert_array_equal(cached.masses, fresh.masses)
