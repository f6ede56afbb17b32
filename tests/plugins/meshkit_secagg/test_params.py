"""A round's parameters: the modulus headroom refusal, and degree/threshold from dropout and corruption."""

from __future__ import annotations

import math

import pytest

from meshkit import RefusedError
from meshkit_secagg import MIN_LEVEL_BITS, SecAggParams, choose_degree


def test_a_modulus_too_small_for_the_cohort_is_refused_with_the_figure_it_needs() -> None:
    with pytest.raises(RefusedError) as caught:
        SecAggParams(clients=100, degree=0, threshold=50, clip_range=1.0, modulus_bits=20)
    message = str(caught.value)
    assert "100 clients" in message and "7 bits of headroom" in message
    assert f"modulus_bits >= {MIN_LEVEL_BITS + 7}" in message
    SecAggParams(clients=100, degree=0, threshold=50, clip_range=1.0,
                 modulus_bits=MIN_LEVEL_BITS + 7)


def test_the_levels_leave_headroom_for_every_client_at_once() -> None:
    for clients, bits in [(2, 17), (100, 32), (1000, 40), (65536, 64)]:
        params = SecAggParams(clients=clients, degree=0, threshold=1, clip_range=2.0,
                              modulus_bits=bits)
        assert clients * params.levels < 2 ** bits
        assert (clients + 1) * params.levels >= 2 ** bits - clients


def test_levels_stop_where_float64_stops_holding_integers() -> None:
    from meshkit_secagg import quantize
    params = SecAggParams(clients=3, degree=0, threshold=1, clip_range=1.0, modulus_bits=64)
    assert params.levels == 2 ** 53
    top = quantize([5.0], params)
    assert top.dtype == "uint64" and int(top[0]) == 2 ** 53


@pytest.mark.parametrize("field,value,match", [
    ("threshold", 0, "threshold must be 1 to"),
    ("threshold", 11, "threshold must be 1 to"),
    ("clip_range", 0.0, "clip_range"),
    ("clip_range", math.inf, "clip_range"),
    ("modulus_bits", 65, "modulus_bits"),
    ("clients", 1, "clients must be"),
])
def test_a_value_out_of_range_is_refused(field: str, value: object, match: str) -> None:
    options = {"clients": 20, "degree": 10, "threshold": 6, "clip_range": 1.0, "modulus_bits": 32}
    options[field] = value
    with pytest.raises(ValueError, match=match):
        SecAggParams(**options)  # type: ignore[arg-type]


def test_the_effective_degree_is_even_and_at_most_the_complete_graph() -> None:
    def degree(d: int, n: int = 20) -> int:
        return SecAggParams(clients=n, degree=d, threshold=1, clip_range=1.0).effective_degree
    assert (degree(0), degree(5), degree(6), degree(18), degree(40)) == (19, 6, 6, 18, 19)


def _tail(population: int, marked: int, draws: int, at_least: int) -> float:
    return sum(math.comb(marked, k) * math.comb(population - marked, draws - k)
               for k in range(at_least, min(marked, draws) + 1)) / math.comb(population, draws)


@pytest.mark.parametrize("n,dropout,corruption", [(1000, 0.1, 0.0), (1000, 0.05, 0.05),
                                                  (10000, 0.1, 0.1)])
def test_the_chosen_degree_meets_both_conditions_and_is_logarithmic(
        n: int, dropout: float, corruption: float) -> None:
    degree, t = choose_degree(n, dropout, corruption, sigma=20)
    assert 0 < degree < n - 1 and degree % 2 == 0 and degree // 2 < t <= degree
    dropped, corrupted = math.floor(dropout * (n - 1)), math.ceil(corruption * (n - 1))
    assert n * _tail(n - 1, dropped, degree, degree - t + 1) <= 2 ** -20
    if corrupted:
        assert n * _tail(n - 1, corrupted, degree, t) <= 2 ** -20
    assert degree < 40 * math.log2(n)  # far below n: SecAgg+'s point


def test_a_small_cohort_gets_the_complete_graph() -> None:
    # 40 % of 8 others may drop: no sparse graph keeps t survivors around everyone.
    degree, t = choose_degree(9, dropout=0.4)
    assert degree == 0 and t == 5


def test_the_threshold_is_a_strict_majority_of_a_clients_holders() -> None:
    # Half of 9 others may drop: t = 5 of the 10 holders would survive it, but two halves
    # told different survivor sets would then each reach t (issue 41); 6 of 10 cannot.
    with pytest.raises(RefusedError, match="not even the complete graph"):
        choose_degree(10, dropout=0.5)
    for clients in range(3, 40):
        degree, t = choose_degree(clients, dropout=0.1)
        holders = (clients - 1 if degree == 0 else degree) + 1
        assert 2 * t > holders, clients


def test_too_much_dropout_and_corruption_together_is_refused() -> None:
    with pytest.raises(RefusedError, match="not even the complete graph"):
        choose_degree(50, dropout=0.5, corruption=0.5)


def test_integer_inputs_narrow_the_field_to_their_bits_plus_the_sums_headroom() -> None:
    # A compressor's int8 codes for 100 clients: 8 + ceil(log2 100) = 15 bits, far below
    # the 16 bits per client the scheme's own quantiser needs, and exact.
    params = SecAggParams(clients=100, degree=0, threshold=50, clip_range=1.0,
                          modulus_bits=15, input_bits=8)
    assert params.levels >= 255 and 100 * 255 < 2 ** 15
    with pytest.raises(RefusedError, match="cannot hold the exact sum of 100 inputs of 8 bits; "
                                           "it needs 15"):
        SecAggParams(clients=100, degree=0, threshold=50, clip_range=1.0, modulus_bits=14,
                     input_bits=8)


def test_the_scheme_plans_the_narrow_field_for_integer_inputs() -> None:
    from meshkit_secagg import SecAggPlus, SecAggPlusOptions

    scheme = SecAggPlus(SecAggPlusOptions(degree=0))
    assert scheme.traits.integer_inputs
    assert scheme.plan(100, input_bits=8).modulus_bits == 15
    assert scheme.plan(100).modulus_bits == 32  # its own quantiser: [secure_aggregation]'s
    assert scheme.params(clients=100, degree=0, threshold=51, clip_range=1.0, modulus_bits=15,
                         input_bits=8).input_bits == 8
