"""The task contract suite: what every strategy relies on a task to do.

Subclass :class:`TaskContract` and point it at your task::

    class TestMyTask(TaskContract):
        component = "my-task"             # or "my_package.tasks:MyTask"
        options = {"hidden": 16}

What it checks, on a small shard of the task's own training data
(``shard_rows`` rows): ``init_state(seed)`` is a valid state (arrays and
JSON values) and a pure function of the seed; ``train_data()`` pairs its
rows and is the same every call; ``fit`` keeps keys, shapes and dtypes,
reports its realized work as a positive ``int`` and finite named metrics, is
bit-for-bit deterministic given its seed, trains (changes the model; set
``trains = False`` if it may not), and modifies none of its inputs (a
read-only state, as the wire delivers it, included); the keys stay those of
``init_state`` round after round, a state lacking a key is refused (not
loaded non-strictly), and integer arrays agree between fits on unequal
shards (fedavg refuses integers that differ);
``evaluate`` returns finite named numbers; every state it produces crosses
the wire unchanged. When the task offers them, the data-parallel pair
(``gradients`` then ``apply``) and the model-parallel pair (``stages`` then
``run_stage``) are checked too; otherwise those tests are skipped as not
applicable. So is a population (:mod:`meshkit.population`): its size is a
positive int, ``client_data(c)`` pairs its rows and is a pure function of the
options and ``c`` (the last client, made first by a fresh task, is the same
as made after the others), and a client out of range is refused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import pytest

from meshkit import wire
from meshkit.population import is_population
from meshkit.state import validate_state
from meshkit.task import create_task
from meshkit.testing import make_plugin_set
from meshkit.testing.support import ContractBase, assert_states_identical, snapshot

__all__ = ["TaskContract"]


class TaskContract(ContractBase):
    """Conformance tests every meshkit task must pass."""

    kind: ClassVar[str] = "task"
    #: Rows of the training data each check fits on (kept small: fast).
    shard_rows: ClassVar[int] = 64
    #: Whether one fit on ``shard_rows`` rows must change the model.
    trains: ClassVar[bool] = True

    def make(self, **overrides: Any) -> Any:
        """A fresh task (``component`` may also be ``"module:attribute"``)."""
        if self.component is None:
            pytest.fail(
                f"{type(self).__name__}: set `component = \"<registered name>\"` (or "
                f"\"module:attribute\", and `options = {{...}}` if it needs any) or "
                f"override make()", pytrace=False)
        pset = None
        if self.plugins is not None:
            pset = make_plugin_set(*self.plugins)
        return create_task(self.component, {**dict(self.options), **overrides}, pset)

    # -- helpers ---------------------------------------------------------------

    def _shard(self, task: Any) -> tuple[np.ndarray, np.ndarray]:
        x, y = task.train_data()
        return x[: self.shard_rows], y[: self.shard_rows]

    @staticmethod
    def _check_metrics(metrics: Any, what: str) -> None:
        assert isinstance(metrics, Mapping), (
            f"{what}: metrics must be a mapping of name -> number, got {type(metrics).__name__}")
        for name, value in metrics.items():
            assert isinstance(name, str) and name, f"{what}: metric name {name!r} is not a str"
            assert isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(
                value, bool), f"{what}: metric {name!r} is {value!r}, not a number"
            assert math.isfinite(float(value)), f"{what}: metric {name!r} is {value}"

    @staticmethod
    def _check_like(state: Any, model: Mapping[str, Any], what: str) -> None:
        assert isinstance(state, Mapping), f"{what}: expected a state (a mapping), got {state!r}"
        assert sorted(state) == sorted(model), (
            f"{what}: keys differ from the model's: got {sorted(state)}, expected "
            f"{sorted(model)}")
        for key, value in model.items():
            if isinstance(value, np.ndarray):
                got = state[key]
                assert isinstance(got, np.ndarray), (
                    f"{what}: {key!r} is a {type(got).__name__}, the model has an array")
                assert got.shape == value.shape and got.dtype == value.dtype, (
                    f"{what}: {key!r} is {got.dtype}{list(got.shape)}, the model has "
                    f"{value.dtype}{list(value.shape)} (keep each array's shape and dtype)")

    @staticmethod
    def _crosses_the_wire(state: Mapping[str, Any], what: str) -> None:
        encoded = wire.encode_state(state)
        body = np.concatenate([np.frombuffer(bytes(b), np.uint8) for b in encoded.buffers])
        back = wire.decode_state(body, flags=encoded.flags)
        assert_states_identical(back, state, what=f"{what}, sent over the wire")

    # -- the model and the data --------------------------------------------------

    def test_init_state_is_a_state_and_a_pure_function_of_the_seed(self) -> None:
        state = self.make().init_state(0)
        validate_state(state, where="init_state(0)")
        again = self.make().init_state(0)  # a fresh task: no hidden global state
        assert_states_identical(again, state, what="init_state(0) of a second task")
        self._crosses_the_wire(state, "init_state(0)")

    def test_the_buffers_and_key_groups_it_declares_are_keys_of_its_model(self) -> None:
        """``buffers()`` (never stepped by an outer optimizer) and ``key_groups()``
        (``[strategy] local_keys = ["@name"]``) name array keys of the model: a
        misspelt buffer would be stepped as a parameter, silently."""
        task = self.make()
        arrays = {k for k, v in task.init_state(0).items() if isinstance(v, np.ndarray)}
        buffers = getattr(task, "buffers", None)
        if callable(buffers):
            stray = sorted(set(buffers()) - arrays)
            assert not stray, f"buffers() names {stray}, which are not arrays of the model"
        groups = getattr(task, "key_groups", None)
        if callable(groups):
            for name, keys in dict(groups()).items():
                stray = sorted(set(keys) - arrays)
                assert not stray, (f"key_groups()[{name!r}] names {stray}, which are not "
                                   f"arrays of the model")

    def test_train_data_pairs_its_rows_and_is_stable(self) -> None:
        task = self.make()
        x, y = task.train_data()
        assert isinstance(x, np.ndarray) and isinstance(y, np.ndarray), (
            f"train_data() must return two numpy arrays, got {type(x).__name__} and "
            f"{type(y).__name__}")
        assert len(x) == len(y) >= 1, (
            f"train_data(): {len(x)} inputs but {len(y)} targets; strategies shard rows in "
            f"pairs")
        x2, y2 = self.make().train_data()
        assert np.array_equal(x, x2) and np.array_equal(y, y2), (
            "train_data() differs between two tasks built alike: every node must shard "
            "the same data")

    # -- fit -----------------------------------------------------------------------

    def test_fit_keeps_the_model_layout_and_reports_work_and_metrics(self) -> None:
        task = self.make()
        model = task.init_state(0)
        x, y = self._shard(task)
        result = task.fit(model, x, y, seed=1)
        for field in ("state", "examples", "metrics"):
            assert hasattr(result, field), (
                f"fit() must return a meshkit.task.FitResult (state, examples, metrics); "
                f"got {type(result).__name__} without {field!r}")
        self._check_like(result.state, model, "fit().state")
        assert isinstance(result.examples, (int, np.integer)) and not isinstance(
            result.examples, bool) and result.examples >= 1, (
            f"fit().examples must be the realized work as a positive int (fedavg's "
            f"weight), got {result.examples!r} for a shard of {len(x)} rows")
        self._check_metrics(result.metrics, "fit()")
        self._crosses_the_wire(result.state, "fit().state")

    def test_fit_is_deterministic_given_its_seed(self) -> None:
        results = []
        for _ in range(2):
            task = self.make()
            x, y = self._shard(task)
            results.append(task.fit(task.init_state(0), x, y, seed=7).state)
        assert_states_identical(results[1], results[0],
                                what="fit(seed=7) of a second task on the same shard")

    def test_fit_trains_the_model(self) -> None:
        if not self.trains:
            pytest.skip("declared: one fit may leave the model unchanged (trains = False)")
        task = self.make()
        model = task.init_state(0)
        x, y = self._shard(task)
        state = task.fit(model, x, y, seed=1).state
        changed = [k for k, v in model.items() if isinstance(v, np.ndarray)
                   and not np.array_equal(state[k], v)]
        assert changed, (
            "fit() returned the model unchanged: a fit that does not train makes every "
            "round a no-op (set trains = False if that is intended)")

    def test_fit_and_evaluate_modify_none_of_their_inputs(self) -> None:
        task = self.make()
        model = task.init_state(0)
        x, y = self._shard(task)
        before = snapshot({"model": model, "x": x, "y": y})
        task.fit(model, x, y, seed=1)
        task.evaluate(model)
        assert_states_identical(model, before["model"], what="the model after fit/evaluate")
        assert np.array_equal(x, before["x"]) and np.array_equal(y, before["y"]), (
            "fit() modified its training shard in place")

    def test_fit_keeps_the_keys_of_init_state_round_after_round(self) -> None:
        task = self.make()
        model = task.init_state(0)
        assert sorted(self.make().init_state(1)) == sorted(model), (
            "init_state(1) has other keys than init_state(0): the keys of a model must not "
            "depend on the seed")
        x, y = self._shard(task)
        second = task.fit(task.fit(model, x, y, seed=1).state, x, y, seed=2).state
        self._check_like(second, model, "fit() of the state a first fit returned (round 2)")

    def test_fit_refuses_a_state_that_lacks_a_key(self) -> None:
        task = self.make()
        model = task.init_state(0)
        arrays = [k for k, v in model.items() if isinstance(v, np.ndarray)]
        if not arrays:
            pytest.skip("the model has no arrays")
        dropped = sorted(arrays)[0]
        partial = {k: v for k, v in model.items() if k != dropped}
        x, y = self._shard(task)
        try:
            task.fit(partial, x, y, seed=1)
        except Exception as exc:  # a refusal names the key; anything else is a crash
            if dropped in str(exc):
                return
            pytest.fail(
                f"fit() of a state without {dropped!r} raised {type(exc).__name__}: {exc}, "
                f"which does not name the missing key: that is a crash, not a refusal; "
                f"check the state's keys first and say which is missing", pytrace=False)
        pytest.fail(
            f"fit() trained from a state without {dropped!r} instead of refusing it: a "
            f"task that loads non-strictly (torch's load_state_dict(strict=False)) hides "
            f"real key mismatches between the global model and its own", pytrace=False)

    def test_integer_arrays_agree_across_unequal_shards(self) -> None:
        task = self.make()
        model = task.init_state(0)
        x, y = task.train_data()
        small = max(1, self.shard_rows // 4)
        states = [task.fit(model, x[:rows], y[:rows], seed=1).state
                  for rows in (self.shard_rows, small)]
        for key, value in states[0].items():
            if isinstance(value, np.ndarray) and value.dtype.kind in "iub":
                other = states[1][key]
                assert np.array_equal(value, other), (
                    f"fit() on {self.shard_rows} rows and on {small} rows returned different "
                    f"{value.dtype} {key!r} ({value.tolist()} and {np.asarray(other).tolist()}):"
                    f" fedavg refuses integer arrays that differ between clients, so a "
                    f"federated run over unequal shards aborts in round 1. Carry a count as "
                    f"a float (meshkit.torch does, for BatchNorm's num_batches_tracked)")

    def test_fit_accepts_a_read_only_state_as_the_wire_delivers_it(self) -> None:
        task = self.make()
        model = task.init_state(0)
        frozen = {}
        for key, value in model.items():
            if isinstance(value, np.ndarray):
                value = value.copy()
                value.setflags(write=False)
            frozen[key] = value
        before = snapshot(frozen)
        x, y = self._shard(task)
        result = task.fit(frozen, x, y, seed=1)
        self._check_like(result.state, model, "fit() of a read-only state")
        assert_states_identical(frozen, before, what="a read-only input state after fit")

    # -- evaluate --------------------------------------------------------------------

    def test_evaluate_returns_finite_named_numbers(self) -> None:
        task = self.make()
        metrics = task.evaluate(task.init_state(0))
        self._check_metrics(metrics, "evaluate()")
        assert metrics, "evaluate() returned no metrics"

    # -- data-parallel (optional) ------------------------------------------------------

    def _needs(self, task: Any, *methods: str, strategy: str) -> None:
        missing = [m for m in methods if not callable(getattr(task, m, None))]
        if missing:
            pytest.skip(f"no {', '.join(missing)}(): the task does not offer {strategy}")

    def test_gradients_then_apply_keep_the_layout_and_are_deterministic(self) -> None:
        task = self.make()
        self._needs(task, "gradients", "apply", strategy="data-parallel")
        model = task.init_state(0)
        x, y = self._shard(task)
        before = snapshot(model)
        grads = task.gradients(model, x, y)
        assert isinstance(grads.examples, (int, np.integer)) and grads.examples >= 1, (
            f"gradients().examples must be a positive int, got {grads.examples!r}")
        for key, g in grads.state.items():
            assert key in model, f"gradients() has {key!r}, which the model does not"
            assert isinstance(g, np.ndarray) and g.shape == model[key].shape, (
                f"gradients() {key!r}: shape {getattr(g, 'shape', None)}, the parameter is "
                f"{model[key].shape}")
        self._crosses_the_wire(grads.state, "gradients().state")
        stepped = task.apply(model, grads.state)
        self._check_like(stepped, model, "apply()")
        assert_states_identical(model, before, what="the model after gradients/apply")
        again = self.make()
        assert_states_identical(again.apply(model, again.gradients(model, x, y).state), stepped,
                                what="gradients then apply on a second task")

    # -- model-parallel (optional) -------------------------------------------------------

    def test_stages_run_in_order_on_a_batch(self) -> None:
        task = self.make()
        self._needs(task, "stages", "run_stage", strategy="model-parallel")
        stages = list(task.stages())
        assert stages and all(isinstance(s, str) and s for s in stages), (
            f"stages() must name the graph's nodes in order, got {stages!r}")
        assert len(set(stages)) == len(stages), f"stages() repeats a name: {stages!r}"
        model = task.init_state(0)
        x, _ = self._shard(task)
        activation = x
        for stage in stages:
            activation = task.run_stage(model, stage, activation)
            assert isinstance(activation, np.ndarray), (
                f"run_stage(..., {stage!r}, ...) returned {type(activation).__name__}, "
                f"not a numpy array (activations travel between ranks as arrays)")
            assert len(activation) == len(x), (
                f"run_stage(..., {stage!r}, ...) turned a batch of {len(x)} rows into "
                f"{len(activation)}")

    # -- a population (optional) -----------------------------------------------------

    def test_a_population_makes_each_client_alone_from_its_number(self) -> None:
        task = self.make()
        if not is_population(task):
            pytest.skip("not a population: no population() and client_data()")
        size = task.population()
        assert isinstance(size, int) and not isinstance(size, bool) and size >= 1, (
            f"population() must be a positive int, got {size!r}")
        last = size - 1
        x, y = task.client_data(last)  # first thing this task makes
        assert len(x) == len(y) >= 1, (
            f"client_data({last}): {len(x)} inputs, {len(y)} targets; they must pair")
        other = self.make()
        for c in range(min(size, 3)):
            other.client_data(c)
        x2, y2 = other.client_data(last)
        assert np.array_equal(x, x2) and np.array_equal(y, y2), (
            f"client_data({last}) depends on what was made before it: a client must be a "
            f"pure function of the task's options and its number")
        with pytest.raises(Exception, match=str(size)):
            task.client_data(size)
