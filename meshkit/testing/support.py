"""Helpers shared by the contract suites: building the component, comparing states."""

from __future__ import annotations

import copy
import json
import math
import threading
import zlib
from typing import Any, Callable, ClassVar, Mapping, Sequence

import attrs
import numpy as np
import pytest

from meshkit import plugins
from meshkit.aggregation import aggregator_traits, uses_reference
from meshkit.testing import make_plugin_set

__all__ = [
    "Call",
    "declared_traits",
    "round_reference",
    "ContractBase",
    "bfloat16",
    "float_dtypes",
    "tolerance",
    "assert_states_close",
    "assert_states_identical",
    "snapshot",
    "json_leaves_ok",
    "model_states",
    "MODEL_BUFFERS",
]

try:  # a meshkit dependency, but keep the kit usable without it
    from ml_dtypes import bfloat16
except ImportError:  # pragma: no cover
    bfloat16 = None


class Call:
    """``fn()`` run on a daemon thread, for a test to join with a bound.

    :meth:`result` returns what ``fn`` returned or raises what it raised, in
    the test's thread; a call still running after ``timeout`` fails the test
    (saying ``why`` it should have) instead of hanging it.
    """

    def __init__(self, fn: Callable[[], Any], name: str = "meshkit-test-call", *,
                 why: str = "") -> None:
        self.name = name
        self.why = why
        self._outcome: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._outcome["value"] = fn()
        except BaseException as exc:  # handed to the test thread by result()
            self._outcome["error"] = exc

    def result(self, timeout: float = 10.0) -> Any:
        """``fn``'s return value (or its exception, raised here) within ``timeout`` s."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            pytest.fail(f"{self.name} did not finish within {timeout:g} s"
                        + (f": {self.why}" if self.why else ""), pytrace=False)
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome["value"]


def declared_traits(aggregator: Any) -> Any:
    """The :class:`meshkit.AggregatorTraits` ``aggregator`` declares, as the kit reads them.

    ``meshkit.aggregation.aggregator_traits`` decides; an aggregator written
    before traits existed said the same with ``uses_reference = True`` and a
    ``state_dict()``/``load_state_dict()`` pair, and either spelling counts.
    """
    traits = aggregator_traits(aggregator)
    keeps_state = callable(getattr(aggregator, "state_dict", None)) and \
        callable(getattr(aggregator, "load_state_dict", None))
    return attrs.evolve(traits, uses_reference=traits.uses_reference or uses_reference(aggregator),
                        stateful=traits.stateful or keeps_state)


def round_reference(state: Mapping[str, Any], scale: float = 0.5) -> dict[str, Any]:
    """A round's reference (the global model sent) shaped like ``state``: same keys and dtypes.

    Float arrays get values of their own, seeded by the key (so every call
    gives the same reference for the same keys, whatever the contributions);
    integer arrays and JSON leaves are copied from ``state``.
    """
    out: dict[str, Any] = {}
    for key, value in state.items():
        array = value if isinstance(value, np.ndarray) else None
        if array is not None and (array.dtype.kind == "f" or (
                bfloat16 is not None and array.dtype == bfloat16)):
            rng = np.random.default_rng(zlib.crc32(key.encode("utf-8")))
            out[key] = np.asarray(scale * rng.standard_normal(array.shape)).astype(array.dtype)
        else:
            out[key] = snapshot(value)
    return out


def float_dtypes() -> list[Any]:
    """The floating dtypes a model state may hold (bf16 when ml_dtypes is present)."""
    dtypes: list[Any] = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)]
    if bfloat16 is not None:
        dtypes.append(np.dtype(bfloat16))
    return dtypes


def tolerance(dtype: Any) -> dict[str, float]:
    """``rtol``/``atol`` for comparing results held in ``dtype``."""
    dtype = np.dtype(dtype)
    if dtype == np.float64:
        return {"rtol": 1e-12, "atol": 1e-12}
    if dtype == np.float32:
        return {"rtol": 1e-5, "atol": 1e-6}
    if dtype.kind == "f" and dtype.itemsize == 2 or (bfloat16 is not None and dtype == bfloat16):
        return {"rtol": 2e-2, "atol": 2e-2}
    return {"rtol": 0.0, "atol": 0.0}


class ContractBase:
    """How a contract suite finds the component it checks.

    Set ``component`` (the registered name) and, if needed, ``options`` (the
    config table as a dict) and ``plugins`` (the plugin modules to load
    instead of the installed entry points). Or override :meth:`make` to build
    the object yourself.
    """

    kind: ClassVar[str] = ""
    component: ClassVar[str | None] = None
    options: ClassVar[Mapping[str, Any]] = {}
    plugins: ClassVar[Sequence[Any] | None] = None

    def make(self, **overrides: Any) -> Any:
        """A fresh component built from ``options`` (with ``overrides`` applied)."""
        if self.component is None:
            pytest.fail(
                f"{type(self).__name__}: set `component = \"<registered name>\"` (and "
                f"`options = {{...}}` if it needs any) or override make()", pytrace=False)
        options = {**dict(self.options), **overrides}
        if self.plugins is not None:
            return make_plugin_set(*self.plugins).create(self.kind, self.component, options)
        return plugins.create(self.kind, self.component, options)


def _leaf_problem(value: Any) -> bool:
    return not isinstance(value, (np.ndarray, np.generic))


def assert_states_close(actual: Mapping[str, Any], expected: Mapping[str, Any], *,
                        what: str, rtol: float | None = None, atol: float | None = None,
                        check_dtype: bool = True) -> None:
    """Same keys; arrays close (tolerance from their dtype) and same dtype/shape; JSON equal."""
    assert isinstance(actual, Mapping), f"{what}: expected a mapping (a state), got {actual!r}"
    assert sorted(actual) == sorted(expected), (
        f"{what}: keys differ: got {sorted(actual)}, expected {sorted(expected)}")
    for key in expected:
        _assert_leaf_close(actual[key], expected[key], f"{what}: key {key!r}",
                           rtol=rtol, atol=atol, check_dtype=check_dtype)


def _assert_leaf_close(actual: Any, expected: Any, what: str, *, rtol: float | None,
                       atol: float | None, check_dtype: bool) -> None:
    if isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), (
            f"{what}: expected a numpy array, got {type(actual).__name__}")
        assert actual.shape == expected.shape, (
            f"{what}: expected shape {expected.shape}, got {actual.shape}")
        if check_dtype:
            assert actual.dtype == expected.dtype, (
                f"{what}: expected dtype {expected.dtype}, got {actual.dtype} "
                f"(return each array in its input dtype)")
        tol = tolerance(expected.dtype)
        if rtol is not None:
            tol["rtol"] = rtol
        if atol is not None:
            tol["atol"] = atol
        a = actual.astype(np.float64) if actual.dtype.kind in "fc" or actual.dtype == bfloat16 \
            else actual
        e = expected.astype(np.float64) if expected.dtype.kind in "fc" or \
            expected.dtype == bfloat16 else expected
        np.testing.assert_allclose(a, e, rtol=tol["rtol"], atol=tol["atol"], err_msg=what,
                                   equal_nan=True)
        return
    if isinstance(expected, float) and isinstance(actual, (int, float)):
        assert math.isclose(actual, expected, rel_tol=rtol or 1e-9, abs_tol=atol or 1e-9), (
            f"{what}: expected {expected!r}, got {actual!r}")
        return
    if isinstance(expected, Mapping):
        assert isinstance(actual, Mapping), f"{what}: expected an object, got {actual!r}"
        assert sorted(actual) == sorted(expected), (
            f"{what}: keys differ: got {sorted(actual)}, expected {sorted(expected)}")
        for k in expected:
            _assert_leaf_close(actual[k], expected[k], f"{what}.{k}", rtol=rtol, atol=atol,
                               check_dtype=check_dtype)
        return
    if isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), (
            f"{what}: expected {expected!r}, got {actual!r}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_leaf_close(a, e, f"{what}[{i}]", rtol=rtol, atol=atol,
                               check_dtype=check_dtype)
        return
    assert actual == expected, f"{what}: expected {expected!r}, got {actual!r}"


def assert_states_identical(actual: Mapping[str, Any], expected: Mapping[str, Any], *,
                            what: str) -> None:
    """Bit-for-bit: same keys, same dtypes and shapes, same bytes; JSON equal."""
    assert isinstance(actual, Mapping), f"{what}: expected a mapping (a state), got {actual!r}"
    assert sorted(actual) == sorted(expected), (
        f"{what}: keys differ: got {sorted(actual)}, expected {sorted(expected)}")
    for key in expected:
        _assert_leaf_identical(actual[key], expected[key], f"{what}: key {key!r}")


def _assert_leaf_identical(actual: Any, expected: Any, what: str) -> None:
    if isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), (
            f"{what}: expected a numpy array, got {type(actual).__name__}")
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
            f"{what}: expected {expected.dtype}{list(expected.shape)}, "
            f"got {actual.dtype}{list(actual.shape)}")
        # Not `assert a == b` on the bytes: pytest would explain a failure by
        # diffing their reprs, quadratic in the array's size (minutes for a
        # few KiB when CI is set and explanations are not truncated).
        if not _same_bytes(actual, expected):
            raise AssertionError(f"{what}: values differ bit-for-bit (max abs difference "
                                 f"{_max_diff(actual, expected)})")
        return
    if isinstance(expected, Mapping):
        assert isinstance(actual, Mapping) and sorted(actual) == sorted(expected), (
            f"{what}: expected {expected!r}, got {actual!r}")
        for k in expected:
            _assert_leaf_identical(actual[k], expected[k], f"{what}.{k}")
        return
    if isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), (
            f"{what}: expected {expected!r}, got {actual!r}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_leaf_identical(a, e, f"{what}[{i}]")
        return
    assert type(actual) is type(expected) and actual == expected, (
        f"{what}: expected {expected!r}, got {actual!r}")


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    try:
        return float(np.nanmax(np.abs(a.astype(np.float64) - b.astype(np.float64))))
    except (TypeError, ValueError):
        return float("nan")


def snapshot(state: Any) -> Any:
    """A deep copy (arrays copied), to check later that nothing was mutated."""
    if isinstance(state, np.ndarray):
        return state.copy()
    if isinstance(state, Mapping):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, list):
        return [snapshot(v) for v in state]
    return copy.deepcopy(state)


def _numeric_scalar(value: Any) -> bool:
    return value.dtype.kind in "biuf" or (bfloat16 is not None and value.dtype == bfloat16)


def json_leaves_ok(tree: Any, where: str = "state") -> list[str]:
    """Leaves that are neither numpy arrays nor JSON values (an empty list is good)."""
    problems: list[str] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, np.ndarray):
            return
        if isinstance(value, np.generic) and _numeric_scalar(value):
            return  # a numpy scalar is a 0-d array in the state model
        if isinstance(value, Mapping):
            for k, v in value.items():
                if not isinstance(k, str):
                    problems.append(f"{path}: key {k!r} is not a string")
                walk(v, f"{path}.{k}")
            return
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")
            return
        if value is None or isinstance(value, (bool, int, float, str)):
            try:
                json.dumps(value, allow_nan=False)
            except ValueError:
                problems.append(f"{path}: {value!r} is not valid JSON")
            return
        problems.append(f"{path}: {type(value).__name__} is neither a numpy array nor JSON")

    walk(tree, where)
    return problems


#: The keys of :func:`model_states` that are buffers (statistics, counters), not parameters.
MODEL_BUFFERS = ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "steps")


def model_states(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` contributions shaped like a real model's, with the leaves toy states lack.

    What ``meshkit.torch`` makes of a conv + BatchNorm layer: float32
    parameters, positive running statistics, BatchNorm's
    ``num_batches_tracked`` as a 0-d float64 count (different per
    contributor, as clients see different batch counts), an int64 buffer
    that is identical everywhere, a 0-d float32 parameter, and a numpy
    *scalar* (``np.float32``, what ``x.sum()`` returns) that the wire cannot
    carry as such. An aggregator or optimizer must hand back every array leaf
    as an ``ndarray`` of its input's shape and dtype: a numpy scalar in a
    result fails on the wire in round 2 of a real run
    (``cannot put state key ... it is a numpy float64 scalar``).
    """
    rng = np.random.default_rng(seed)
    return [{
        "conv.weight": rng.standard_normal((4, 3)).astype(np.float32),
        "bn.weight": (1.0 + 0.1 * rng.standard_normal(4)).astype(np.float32),
        "bn.bias": (0.1 * rng.standard_normal(4)).astype(np.float32),
        "bn.running_mean": (0.1 * rng.standard_normal(4)).astype(np.float32),
        "bn.running_var": rng.uniform(0.5, 1.5, 4).astype(np.float32),
        "bn.num_batches_tracked": np.array(float(10 + rng.integers(0, 5))),
        "steps": np.array(7, np.int64),
        "temperature": np.array(1.0 + 0.1 * rng.standard_normal(), np.float32),
        "gain": np.float32(1.0 + 0.1 * rng.standard_normal()),
    } for _ in range(n)]
