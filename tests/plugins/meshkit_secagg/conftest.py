"""What the secure-aggregation tests share: a round's parameters and quantised updates."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

from meshkit_secagg import SecAggParams, quantize

#: The public seed every round in these tests uses.
ROUND_SEED = b"meshkit tests: round 7"


@pytest.fixture
def round_seed() -> bytes:
    return ROUND_SEED


@pytest.fixture
def updates() -> Callable[[SecAggParams, int], dict[int, np.ndarray]]:
    """``updates(params, length)``: one quantised update per client id 0..clients-1, from seed 0."""

    def make(params: SecAggParams, length: int) -> dict[int, np.ndarray]:
        rng = np.random.default_rng(0)
        return {c: quantize(rng.normal(0.0, params.clip_range / 2, size=length), params)
                for c in range(params.clients)}

    return make


def plaintext_sum(updates: dict[int, np.ndarray], clients: tuple[int, ...]) -> np.ndarray:
    """The exact integer sum of the quantised updates of ``clients`` (uint64; no modulus needed)."""
    return np.sum([updates[c].astype(np.uint64) for c in clients], axis=0, dtype=np.uint64)


@pytest.fixture
def exact_sum() -> Callable[[dict[int, np.ndarray], tuple[int, ...]], np.ndarray]:
    return plaintext_sum
