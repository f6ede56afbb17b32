"""Review of numerics and the conformance kit: each test failed before its fix."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from meshkit import plugins
from meshkit.aggregation import MeanFold, begin, check_contributions
from meshkit.errors import AggregationError, StateError

STATEFUL = ["nesterov", "fedavgm", "fedadagrad", "fedadam", "fedyogi"]


# -- outer optimizers ------------------------------------------------------------


@pytest.mark.parametrize("name", STATEFUL)
def test_an_optimizer_reloads_its_own_state_for_a_model_without_float_arrays(name):
    # A Python filter's {"mu": 1.5} state has nothing to step: the optimizer
    # counts rounds but holds no moments, and resuming must still work.
    opt = plugins.create("outer_optimizer", name, {})
    new = opt.step({"mu": 1.5, "n": np.arange(2)}, {"mu": 1.0, "n": np.arange(2)})
    assert new["mu"] == 1.0
    restored = plugins.create("outer_optimizer", name, {})
    restored.load_state_dict(opt.state_dict())
    assert restored.state_dict()["t"] == 1
    assert restored.step({"mu": 1.0}, {"mu": 0.5}) == {"mu": 0.5}


@pytest.mark.parametrize("name", STATEFUL)
def test_a_checkpoint_past_round_0_without_moments_is_refused_for_a_float_model(name):
    opt = plugins.create("outer_optimizer", name, {})
    opt.load_state_dict({"optimizer": name, "t": 3})
    x = {"w": np.ones(2, np.float32)}
    with pytest.raises(StateError, match="round 3 but holds no moment buffers"):
        opt.step(x, {"w": np.zeros(2, np.float32)})


# -- weights ---------------------------------------------------------------------


def _fold(weights: list[Any], *, weighted: bool = True) -> dict[str, Any]:
    fold = MeanFold(weighted=weighted)
    for i, w in enumerate(weights):
        fold.add({"w": np.full(3, float(i + 1), np.float32)}, w, source=f"rank {i + 1}")
    return fold.result()


def test_huge_finite_weights_are_averaged_not_an_overflow_traceback():
    out = _fold([1e308, 1e308])
    np.testing.assert_array_equal(out["w"], np.full(3, 1.5, np.float32))
    weights = check_contributions([{"w": np.ones(2)}] * 2, [1e308, 1e308])
    assert weights == [1e308, 1e308]


def test_an_integer_weight_beyond_float_range_is_an_aggregation_error():
    with pytest.raises(AggregationError, match="rank 1 has weight"):
        _fold([10 ** 400])


def test_unequal_allreduce_weights_are_shown_so_they_visibly_differ():
    with pytest.raises(AggregationError) as info:
        _fold([0.1, np.float32(0.1)], weighted=False)
    message = str(info.value)
    assert "has weight 0.10000000149011612 but rank 1 has 0.1;" in message


# -- JSON leaves -----------------------------------------------------------------


@pytest.mark.parametrize("values", [[10 ** 400, 10 ** 400], [1, 10 ** 400], [10 ** 400, 1]])
def test_a_json_integer_beyond_float_range_is_an_aggregation_error(values):
    fold = MeanFold()
    with pytest.raises(AggregationError, match=r"aggregating 'cfg\.n'") as info:
        for i, v in enumerate(values):
            fold.add({"cfg": {"n": v}}, 1.0, source=f"rank {i + 1}")
        fold.result()
    assert "float64" in str(info.value)


@pytest.mark.parametrize("weights", [[1.0, 1.0], [1.0, 1e6]])
def test_a_json_number_whose_weighted_sum_overflows_is_refused_not_inf(weights):
    fold = MeanFold()
    fold.add({"w": np.ones(2, np.float32), "cfg": {"big": 1e303 * 1e5}}, weights[0],
             source="rank 1")
    fold.add({"w": np.ones(2, np.float32), "cfg": {"big": 1.5e303 * 1e5}}, weights[1],
             source="rank 2")
    with pytest.raises(AggregationError, match=r"aggregating 'cfg\.big'.*overflowed") as info:
        fold.result()
    assert info.value.contributors == ["rank 1", "rank 2"]


def test_json_numbers_that_do_not_overflow_still_average():
    fold = MeanFold()
    fold.add({"cfg": {"big": 1e300}}, 1.0)
    fold.add({"cfg": {"big": 3e300}}, 1.0)
    assert fold.result() == {"cfg": {"big": 2e300}}


@pytest.mark.parametrize("retain", [0, 1])
def test_one_bf16_contributor_with_nan_payloads_is_the_identity_bit_for_bit(retain):
    import warnings

    from meshkit.state import BFLOAT16

    bits = np.array([0x7FC1, 0xFFC0, 0x7F81, 0x7F80, 0x0001, 0x8000, 0x3F80], np.uint16)
    state = {"w": bits.view(BFLOAT16)}
    fold = MeanFold(allow_nonfinite=True, retain=retain)
    fold.add(state, 2.5, source="rank 1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # allowed NaNs are no reason to warn
        out = fold.result()
    assert out["w"].dtype == BFLOAT16
    assert out["w"].view(np.uint16).tolist() == bits.tolist()


# -- the buffering fold ----------------------------------------------------------


class _Median:
    """A plain aggregator (no begin()) that applies the built-in strictness."""

    name = "median"

    def aggregate(self, states, weights=None):
        check_contributions(states, weights, name=self.name)
        return {k: np.median(np.stack([s[k] for s in states]), axis=0) for k in states[0]}


def test_the_buffering_fold_names_contributors_by_their_source():
    fold = begin(_Median())
    for rank in (3, 5, 11):
        state = {"w": np.ones(2)} if rank != 11 else {"v": np.ones(2)}
        fold.add(state, 1.0, source=f"rank {rank}")
    with pytest.raises(AggregationError) as info:
        fold.result()
    message = str(info.value)
    assert "from rank 11, but rank 3 sent it" in message
    assert "contributor #" not in message


def test_the_buffering_fold_leaves_a_default_label_alone_and_maps_two_digit_ones():
    fold = begin(_Median())
    for i in range(12):
        fold.add({"w": np.ones(2)} if i != 11 else {"w": np.ones(3)}, 1.0,
                 source=None if i < 11 else "rank 12")
    with pytest.raises(AggregationError, match="rank 12 sent shape"):
        fold.result()


# -- the conformance kit ---------------------------------------------------------


def test_the_outer_contract_accepts_a_numpy_scalar_in_state_dict():
    from meshkit.testing import OuterOptimizerContract

    class Counting:
        """A correct optimizer (average) that counts rounds in a numpy int."""

        def __init__(self) -> None:
            self.rounds = np.int64(0)

        def step(self, global_state, consensus):
            self.rounds += 1
            return dict(consensus)

        def state_dict(self):
            return {"rounds": self.rounds}

        def load_state_dict(self, d):
            self.rounds = np.int64(d["rounds"])

    class Suite(OuterOptimizerContract):
        def make(self, **overrides):
            return Counting()

    suite = Suite()
    suite.test_state_dict_holds_only_arrays_and_json()
    suite.test_a_fresh_state_round_trips()
    suite.test_a_restored_optimizer_continues_bit_for_bit(np.float32)



def _nested(depth: int):
    value = 0
    for _ in range(depth):
        value = [value]
    return value


def test_json_nested_past_the_bound_is_refused_not_a_recursion_error():
    """A 900-deep JSON leaf decoded fine and then blew the fold's stack."""
    from meshkit.state import MAX_JSON_DEPTH, validate_state

    deep = {"meta": _nested(900)}
    fold = begin(plugins.create("aggregator", "fedavg"))
    with pytest.raises(AggregationError, match="nested more than 64 levels"):
        fold.add(deep, 1.0, source="rank 1")
    with pytest.raises(StateError, match="nested more than 64 levels"):
        validate_state(deep)
    ok = {"meta": _nested(MAX_JSON_DEPTH)}
    validate_state(ok)
    fold = begin(plugins.create("aggregator", "fedavg"))
    fold.add(ok, 1.0, source="rank 1")
    fold.add(ok, 3.0, source="rank 2")
    assert fold.result() == ok


def test_the_wire_refuses_json_nested_past_the_bound():
    from meshkit.errors import WireError
    from meshkit.wire import decode_state, encode_state

    def body(state):
        return b"".join(bytes(b) for b in encode_state(state).buffers)

    assert decode_state(body({"meta": _nested(64)}))["meta"] == _nested(64)
    # A hostile peer encodes what a well-behaved one never would.
    with pytest.raises(WireError, match="'meta': JSON nested more than 64 levels"):
        decode_state(body({"meta": _nested(65)}))
