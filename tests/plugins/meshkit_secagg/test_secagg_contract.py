"""The built-in ``secagg+`` passes meshkit's secure-aggregation contract suite, and the suite
fails schemes that break what the kernel's round relies on."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import meshkit
from meshkit.testing import SecureAggregationContract


class TestSecAggPlus(SecureAggregationContract):
    component = "secagg+"
    # Eight clients on the complete graph, five shares of seven: a round survives losing three.
    options = {"degree": 0, "threshold": 5, "clip_range": 1.0}


class TestSecAggPlusSparseWide(SecureAggregationContract):
    component = "secagg+"
    clients = 12
    options = {"degree": 6, "threshold": 4, "clip_range": 2.0, "modulus_bits": 48}


# -- the suite fails broken schemes ------------------------------------------


class _Unmasked:
    """SecAgg+ whose clients send their quantised update as is (the masks forgotten)."""

    def __init__(self, scheme: Any) -> None:
        self.inner = scheme

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def client(self, *args: Any) -> Any:
        side = self.inner.client(*args)
        plain = type("Plain", (), {"__getattr__": lambda s, n: getattr(side, n),
                                   "mask": lambda s, q, excluded: _pad(q, side.mask(q, excluded))})
        return plain()


def _pad(quantised: np.ndarray, masked: np.ndarray) -> np.ndarray:
    out = masked.copy()
    out[:quantised.size] = quantised
    return out


class _OffByOne:
    """SecAgg+ whose server reveals a total one off in its first coordinate."""

    def __init__(self, scheme: Any) -> None:
        self.inner = scheme

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def server(self, *args: Any) -> Any:
        side = self.inner.server(*args)
        original = side.finish

        def finish() -> Any:
            result = original()
            result.total[0] += 1
            return result
        side.finish = finish
        return side


def _broken(wrapper: type) -> SecureAggregationContract:
    options = TestSecAggPlus.options

    def make(self: Any, **_: Any) -> Any:
        return wrapper(meshkit.plugins.create("secure_aggregation", "secagg+", options))
    return type("Broken", (SecureAggregationContract,), {"make": make})()


def test_the_suite_fails_a_scheme_that_does_not_mask():
    with pytest.raises(AssertionError, match="it is not masked"):
        _broken(_Unmasked).test_a_masked_input_hides_its_update_and_masks_cancel_only_in_the_full_sum()


def test_the_suite_fails_a_sum_that_is_not_exact():
    with pytest.raises(AssertionError, match="not the sum mod 2\\*\\*modulus_bits"):
        _broken(_OffByOne).test_the_unmasked_sum_is_the_exact_sum_of_the_quantised_updates()
