"""The kernel's rule for every outer optimizer: it steps parameters only (meshkit.outer.step_parameters)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import meshkit.plugins
from meshkit import AggregationError
from meshkit.outer import parameter_keys, step_parameters, stepped_keys
from meshkit.train import LocalPool, StrategyContext

OPTIMIZERS = ["average", "nesterov", "fedavgm", "fedadagrad", "fedadam", "fedyogi"]


def batchnorm_state(shift: float = 0.0) -> dict:
    """What meshkit.torch makes of a BatchNorm layer: parameters, statistics, a counter."""
    return {
        "bn.weight": np.full(3, 1.0 + shift, np.float32),
        "bn.bias": np.full(3, shift, np.float32),
        "bn.running_mean": np.full(3, shift, np.float32),
        "bn.running_var": np.full(3, 1.0 + shift, np.float32),
        "bn.num_batches_tracked": np.array(10.0 + 10 * shift),  # a 0-d float64 count
        "steps": np.array([4 + int(10 * shift)], np.int64),
        "meta": {"layers": 1},
    }


BUFFERS = ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")


class Spy:
    """An outer optimizer that records what it was handed and steps like fedavgm (lr 2)."""

    def __init__(self) -> None:
        self.seen: list[set[str]] = []

    def step(self, global_state, consensus):
        self.seen.append(set(global_state))
        return {k: np.asarray(x) - 2 * (np.asarray(x) - consensus[k])
                for k, x in global_state.items()}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_an_optimizer_receives_only_the_parameters():
    spy = Spy()
    out = step_parameters(spy, batchnorm_state(), batchnorm_state(0.5), buffers=BUFFERS)
    assert spy.seen == [{"bn.weight", "bn.bias"}]
    assert float(out["bn.weight"][0]) == pytest.approx(2.0)  # stepped past the consensus


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_buffers_integers_and_json_take_the_consensus_with_their_dtype(name):
    opt = meshkit.plugins.create("outer_optimizer", name)
    state = batchnorm_state()
    for rnd in range(1, 4):
        consensus = batchnorm_state(0.1 * rnd)
        state = step_parameters(opt, state, consensus, buffers=BUFFERS)
        for key in (*BUFFERS, "steps"):
            assert np.array_equal(state[key], consensus[key]), (name, key, rnd)
            assert isinstance(state[key], np.ndarray)
            assert state[key].dtype == consensus[key].dtype
        assert state["meta"] == {"layers": 1}
        # fedavgm's momentum on a variance is what drove it negative before.
        assert (state["bn.running_var"] > 0).all()
        for key in ("bn.weight", "bn.bias"):
            assert state[key].dtype == np.float32 and np.isfinite(state[key]).all()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_0_d_parameter_is_stepped_by_every_optimizer(name):
    # Was: TypeError: return arrays must be of ArrayType (np.sqrt of a 0-d
    # array is a numpy scalar, not an array to write into).
    opt = meshkit.plugins.create("outer_optimizer", name)
    state = {"temperature": np.array(1.0, np.float32)}
    for _ in range(3):
        state = step_parameters(opt, state, {"temperature": np.array(0.5, np.float32)})
        value = state["temperature"]
        assert isinstance(value, np.ndarray) and value.shape == () and value.dtype == np.float32
        assert 0.0 < float(value) <= 1.0


def test_an_optimizer_that_drops_a_parameter_is_an_aggregation_error():
    class Lossy(Spy):
        def step(self, global_state, consensus):
            return {}

    with pytest.raises(AggregationError, match=r"missing \['bn.bias', 'bn.weight'\]"):
        step_parameters(Lossy(), batchnorm_state(), batchnorm_state(0.5), buffers=BUFFERS)


def test_parameter_keys_are_the_float_arrays_that_are_not_buffers():
    assert parameter_keys(batchnorm_state(), batchnorm_state(), buffers=BUFFERS) == [
        "bn.weight", "bn.bias"]


class BufferedTask:
    """A numpy task that declares a statistic as a buffer."""

    def buffers(self):
        return ["bn.running_var"]


def test_the_strategy_context_steps_by_the_tasks_buffers():
    spy = Spy()
    ctx = StrategyContext(task=BufferedTask(), aggregator=None, pool=LocalPool({}),
                          workers=[], rng=np.random.default_rng(0), outer=spy,
                          outer_name="spy")
    state = {"w": np.ones(2), "bn.running_var": np.ones(2)}
    out = ctx.outer_step(state, {"w": np.zeros(2), "bn.running_var": np.full(2, 0.5)})
    assert spy.seen == [{"w"}]
    assert np.array_equal(out["bn.running_var"], np.full(2, 0.5))
    assert np.array_equal(out["w"], np.full(2, -1.0))


@pytest.mark.parametrize("x, c, why", [
    (np.ones(2, np.float32), np.ones(3, np.float32), "'w' has shape (2,) in the global model "
                                                     "but (3,) in the consensus"),
    (np.ones(2, np.float32), np.ones(2, np.int32), "'w' is a float array in the global model "
                                                   "but not a float array in the consensus"),
    (np.ones(2, np.int64), np.ones(2, np.float64), "'w' is not a float array in the global "
                                                   "model but a float array in the consensus"),
    (np.ones(2, np.float32), 1.5, "'w' is a float array in the global model but not a float "
                                  "array in the consensus"),
])
def test_stepped_keys_refuses_a_mismatched_pair_the_same_way_whatever_its_types(x, c, why):
    # ndarrays take stepped_keys' fast path, numpy scalars and JSON the general one:
    # the same refusals either way.
    with pytest.raises(AggregationError) as err:
        stepped_keys({"w": x}, {"w": c}, name="average")
    assert str(err.value) == f"outer optimizer average: {why}"


def test_stepped_keys_steps_float_arrays_of_either_kind_and_skips_the_rest():
    g = {"a": np.ones(2, np.float32), "b": np.float32(1.0), "n": np.arange(2), "j": 3,
         "h": np.ones(1, ml_dtypes.bfloat16)}
    c = {"a": np.ones(2, ml_dtypes.bfloat16), "b": np.float32(2.0), "n": np.arange(2),
         "j": 4, "h": np.ones(1, np.float32)}
    assert stepped_keys(g, c, name="average") == ["a", "b", "h"]
