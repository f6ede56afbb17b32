"""The outer optimizer contract suite.

Subclass :class:`OuterOptimizerContract` and point it at your component::

    class TestFedAvgM(OuterOptimizerContract):
        component = "fedavgm"
        options = {"lr": 1.0, "momentum": 0.9}
        # options under which it must behave exactly like `average`:
        noop_options = {"lr": 1.0, "momentum": 0.0}

What it checks: one sign convention (the pseudo-gradient is ``g = global -
consensus`` and a fresh optimizer steps toward the consensus), a converged
model stays put, keys/shapes/dtypes are kept (each array in its input dtype),
inputs are not modified, ``state_dict()`` is a snapshot of arrays and JSON
values that, loaded into a fresh optimizer, continues the run bit for bit,
and ``average``-equivalence under ``noop_options`` when declared.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Mapping

import numpy as np
import pytest

from meshkit.errors import MeshError
from meshkit.outer import step_parameters
from meshkit.wire import encode_state
from meshkit.testing.support import (
    ContractBase,
    assert_states_close,
    assert_states_identical,
    float_dtypes,
    json_leaves_ok,
    MODEL_BUFFERS,
    model_states,
    snapshot,
)

__all__ = ["OuterOptimizerContract"]


def _model(dtype: Any = np.float32, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((3, 4)).astype(dtype),
            "b": rng.standard_normal(5).astype(dtype)}


def _consensus(global_state: Mapping[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """A consensus a small step away from ``global_state`` (the workers trained)."""
    rng = np.random.default_rng(seed)
    return {k: (v.astype(np.float64) - 0.1 * rng.standard_normal(v.shape)).astype(v.dtype)
            for k, v in global_state.items()}


def _checkpoint(tree: Any) -> Any:
    """What a checkpoint does to a state dict: arrays copied, JSON through text."""
    if isinstance(tree, np.ndarray):
        return tree.copy()
    if isinstance(tree, np.generic):
        return tree.item()  # as meshkit's checkpoint stores a numpy scalar
    if isinstance(tree, Mapping):
        return {k: _checkpoint(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_checkpoint(v) for v in tree]
    return json.loads(json.dumps(tree))


class OuterOptimizerContract(ContractBase):
    """Conformance tests every meshkit outer optimizer must pass."""

    kind: ClassVar[str] = "outer_optimizer"

    #: Options under which the optimizer must behave like ``average``
    #: (adopt the consensus), e.g. ``{"lr": 1.0, "momentum": 0.0}``; None
    #: when no setting makes it a no-op.
    noop_options: ClassVar[Mapping[str, Any] | None] = None
    #: The first step from a fresh state moves every coordinate toward the
    #: consensus (the DiLoCo/FedOpt sign convention).
    descends: ClassVar[bool] = True

    @pytest.mark.parametrize("dtype", float_dtypes(), ids=str)
    def test_a_step_keeps_keys_shapes_and_dtypes(self, dtype: Any) -> None:
        opt = self.make()
        x = _model(dtype)
        for r in range(2):
            new = opt.step(x, _consensus(x, seed=r + 1))
            assert sorted(new) == sorted(x), f"round {r}: keys {sorted(new)} != {sorted(x)}"
            for k, v in x.items():
                assert isinstance(new[k], np.ndarray), (
                    f"round {r}, key {k!r}: expected a numpy array, got {type(new[k]).__name__}")
                assert new[k].dtype == v.dtype and new[k].shape == v.shape, (
                    f"round {r}, key {k!r}: a {v.dtype}{list(v.shape)} model came back as "
                    f"{new[k].dtype}{list(new[k].shape)}; return each array in its input dtype")
                assert np.all(np.isfinite(new[k].astype(np.float64))), (
                    f"round {r}, key {k!r}: non-finite values after a step")
            x = new

    def test_integer_arrays_and_json_values_survive_a_step(self) -> None:
        """A state is arrays *and* JSON values (DESIGN §4); what is not a float
        parameter is not stepped: it adopts the consensus, under the same key."""
        opt = self.make()
        x = {**_model(), "seen": np.array([3, 4], np.int64), "meta": {"mu": 1.5}}
        c = {**_consensus(_model(), seed=4), "seen": np.array([5, 6], np.int64),
             "meta": {"mu": 2.5}}
        for r in range(2):
            new = opt.step(snapshot(x), snapshot(c))
            assert sorted(new) == sorted(x), (
                f"round {r}: keys {sorted(new)} != {sorted(x)}; an outer optimizer must keep "
                f"integer arrays and JSON values, not only the float parameters")
            assert isinstance(new["seen"], np.ndarray) and new["seen"].dtype == np.int64 \
                and np.array_equal(new["seen"], c["seen"]), (
                f"round {r}: the int64 array 'seen' came back as {new['seen']!r}; it should "
                f"adopt the consensus {c['seen']!r}")
            assert new["meta"] == c["meta"], (
                f"round {r}: the JSON value 'meta' came back as {new['meta']!r}; it should "
                f"adopt the consensus {c['meta']!r}")
            x = new

    def test_a_real_models_state_steps_under_the_kernels_rule(self) -> None:
        """What a run hands the optimizer (:func:`meshkit.outer.step_parameters`): the
        parameters of a BatchNorm-shaped model, 0-d ones and numpy scalars among them.
        Each must come back an ndarray of its dtype and shape, finite; the buffers
        take the consensus, whatever the optimizer."""
        opt = self.make()
        x, *consensi = model_states(4, seed=3)
        for r, c in enumerate(consensi):
            new = step_parameters(opt, snapshot(x), snapshot(c), buffers=MODEL_BUFFERS,
                                  name=str(self.component))
            for k, v in x.items():
                got = new[k]
                assert isinstance(got, np.ndarray), (
                    f"round {r}, key {k!r}: expected a numpy array, got "
                    f"{type(got).__name__} (a numpy scalar cannot go on the wire)")
                assert got.dtype == np.asarray(v).dtype and got.shape == np.shape(v), (
                    f"round {r}, key {k!r}: a {np.asarray(v).dtype}{list(np.shape(v))} value "
                    f"came back as {got.dtype}{list(got.shape)}")
                assert np.all(np.isfinite(got.astype(np.float64))), (
                    f"round {r}, key {k!r}: non-finite values after a step")
            for k in MODEL_BUFFERS:
                assert np.array_equal(new[k], c[k]), (
                    f"round {r}: buffer {k!r} is {new[k]!r}, not the consensus {c[k]!r}")
            encode_state(new)
            x = new

    def test_a_step_does_not_modify_its_inputs(self) -> None:
        opt = self.make()
        x = _model()
        c = _consensus(x, seed=1)
        x0, c0 = snapshot(x), snapshot(c)
        opt.step(x, c)
        assert_states_identical(x, x0, what="global_state after step")
        assert_states_identical(c, c0, what="consensus after step")

    def test_a_converged_model_stays_put(self) -> None:
        opt = self.make()
        x = _model(np.float64)
        new = opt.step(snapshot(x), snapshot(x))
        assert_states_close(new, x, what="step(x, consensus=x) from a fresh optimizer",
                            rtol=1e-9, atol=1e-12)

    def test_the_first_step_moves_toward_the_consensus(self) -> None:
        if not self.descends:
            pytest.skip("the optimizer declares descends = False")
        opt = self.make()
        x = _model(np.float64)
        c = _consensus(x, seed=2)
        new = opt.step(snapshot(x), c)
        for k in x:
            toward = np.sign(c[k] - x[k])
            moved = np.sign(new[k] - x[k])
            assert np.array_equal(moved, toward), (
                f"key {k!r}: the step moved away from the consensus at "
                f"{int(np.sum(moved != toward))} coordinates; the pseudo-gradient is "
                f"g = global - consensus and an optimizer descends on it")

    def test_state_dict_holds_only_arrays_and_json(self) -> None:
        opt = self.make()
        x = _model()
        opt.step(x, _consensus(x, seed=3))
        state = opt.state_dict()
        assert isinstance(state, Mapping), f"state_dict() must return a mapping, got {state!r}"
        problems = json_leaves_ok(state, "state_dict()")
        assert not problems, "; ".join(problems)

    def test_state_dict_is_a_snapshot_not_a_live_view(self) -> None:
        opt = self.make()
        x = _model()
        x = opt.step(x, _consensus(x, seed=4))
        saved = opt.state_dict()
        frozen = snapshot(saved)
        opt.step(x, _consensus(x, seed=5))
        assert_states_identical(saved, frozen, what="a state_dict() taken before another step")

    def test_a_fresh_state_round_trips(self) -> None:
        fresh = self.make()
        other = self.make()
        other.load_state_dict(_checkpoint(fresh.state_dict()))
        x = _model()
        c = _consensus(x, seed=6)
        assert_states_identical(other.step(snapshot(x), snapshot(c)), fresh.step(x, c),
                                what="fresh optimizer vs one loaded from a fresh state_dict")

    @pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=str)
    def test_a_restored_optimizer_continues_bit_for_bit(self, dtype: Any) -> None:
        opt = self.make()
        x = _model(dtype)
        for r in range(2):
            x = opt.step(x, _consensus(x, seed=10 + r))
        restored = self.make()
        restored.load_state_dict(_checkpoint(opt.state_dict()))
        y = snapshot(x)
        for r in range(2, 4):
            c = _consensus(x, seed=10 + r)
            x = opt.step(x, c)
            y = restored.step(y, snapshot(c))
            assert_states_identical(y, x, what=f"round {r} after restoring the checkpoint")

    def test_behaves_as_average_when_configured_as_a_no_op(self) -> None:
        if self.noop_options is None:
            pytest.skip("no noop_options declared")
        opt = self.make(**dict(self.noop_options))
        x = _model()
        for r in range(3):
            c = _consensus(x, seed=20 + r)
            x = opt.step(x, c)
            assert_states_close(x, c, what=f"round {r} with noop_options {self.noop_options}")

    def test_a_consensus_missing_a_key_is_refused(self) -> None:
        opt = self.make()
        x = _model()
        c = _consensus(x, seed=30)
        del c["b"]
        try:
            result = opt.step(x, c)
        except MeshError as exc:
            assert "b" in str(exc), f"the error should name the key 'b': {exc}"
            return
        except Exception as exc:
            pytest.fail(f"a consensus without key 'b' should raise a meshkit.MeshError "
                        f"naming it, got {type(exc).__name__}: {exc}", pytrace=False)
        pytest.fail(f"a consensus without key 'b' was stepped silently (result keys "
                    f"{sorted(result)}); the global model would lose or freeze 'b'",
                    pytrace=False)
