"""A simulated round: the result of the real state machines, with every upload and CPU second counted."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

from meshkit_secagg import CHECK_ELEMENTS, SEALED_SIZE, STAGES, SecAggParams, simulate_round

Updates = Callable[[SecAggParams, int], dict[int, np.ndarray]]


def test_uploads_are_counted_per_stage(updates: Updates, round_seed: bytes) -> None:
    params = SecAggParams(clients=6, degree=4, threshold=3, clip_range=1.0, modulus_bits=32)
    run = simulate_round(params, updates(params, 100), round_seed, drop_after_masking=[2])
    # id + uint32 vector (the update and the count check), 5 arrive
    assert run.upload_bytes["mask"] == 5 * (8 + 4 * (100 + CHECK_ELEMENTS))
    assert run.upload_bytes["share"] == 6 * (8 + 4 * (8 + 8 + SEALED_SIZE))
    assert run.upload_bytes["advertise"] == 6 * (8 + 3 * 32)
    assert set(run.client_seconds) <= set(STAGES) and set(run.server_seconds) <= set(STAGES)
    assert run.result.dropped == (2,)


def test_updates_of_different_lengths_are_refused(round_seed: bytes) -> None:
    params = SecAggParams(clients=3, degree=0, threshold=2, clip_range=1.0, modulus_bits=20)
    with pytest.raises(ValueError, match="one length"):
        simulate_round(params, {0: np.zeros(3, np.uint32), 1: np.zeros(4, np.uint32),
                                2: np.zeros(3, np.uint32)}, round_seed)


@pytest.mark.parametrize("stage", ["drop_after_masking", "drop_before_unmasking"])
def test_four_clients_with_threshold_three_survive_one_dropout(
        updates: Updates, round_seed: bytes, stage: str) -> None:
    # Bonawitz et al. §4 and Flower's secaggplus_mod: each client holds a share of its own
    # secrets, so t-of-(k + 1) tolerates n - t = 1 dropout here (with t-of-k, none).
    params = SecAggParams(clients=4, degree=0, threshold=3, clip_range=1.0, modulus_bits=32)
    inputs = updates(params, 50)
    run = simulate_round(params, inputs, round_seed, **{stage: [1]})
    summed = [0, 2, 3] if stage == "drop_after_masking" else [0, 1, 2, 3]
    expected = np.zeros(50, np.uint32)
    for client in summed:
        expected += inputs[client]
    assert run.result.contributors == tuple(summed)
    np.testing.assert_array_equal(run.result.total, expected)
