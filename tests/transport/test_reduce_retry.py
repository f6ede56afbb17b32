"""Reduce rounds: a contribution that failed to encode, or that the aggregator refuses."""

from __future__ import annotations


import numpy as np
import pytest

from meshkit import plugins
from meshkit.errors import AggregationError, WireError
from meshkit_tcp.testing import inproc_configs, run_ranks

SECRET = b"review-r1-secret-0123456789"


def test_a_worker_whose_contribution_could_not_be_encoded_can_retry_the_same_round() -> None:
    # all_reduce counted the round before sending: a payload the wire refused
    # (nothing sent) still moved the worker on a round, so its corrected retry
    # arrived as "round 1" and the coordinator declared it dead.

    configs = inproc_configs(2, timeout=5.0)
    coordinator = configs[0].connect()
    try:
        def worker(group):
            with pytest.raises(WireError):
                group.all_reduce({"w": np.array([1 + 2j])})  # complex: not a wire dtype
            return group.all_reduce({"w": np.array([2.0])})

        ranks = run_ranks(configs[1:], worker)
        coordinator.wait_for_workers(timeout=5)
        result = coordinator.reduce_round(plugins.create("aggregator", "fedavg"))
        scattered = ranks.join()
    finally:
        coordinator.close()
    assert result.contributors == [1] and result.dead == []
    # The ledger is the whole ledger after the round: a worker that got its
    # scatter may already have left, but nobody was dropped for a protocol fault.
    assert all("left the mesh" in why for why in result.ledger.values()), result.ledger
    np.testing.assert_allclose(scattered[1]["w"], [2.0])


def test_a_coordinator_contribution_the_aggregator_refuses_aborts_the_round_for_workers() -> None:
    # The coordinator's own contribution was folded outside the abort guard:
    # when the aggregator refused it, the workers were never told and waited
    # out their whole timeout for a scatter that could not come.

    configs = inproc_configs(2, timeout=30.0)
    coordinator = configs[0].connect()
    fedavg = plugins.create("aggregator", "fedavg")
    try:
        def worker(group):
            with pytest.raises(AggregationError, match="refused reduce round 0"):
                group.all_reduce({"w": np.ones(2)}, timeout=5.0)
            return group.all_reduce({"w": np.full(2, 3.0)}, timeout=5.0)

        ranks = run_ranks(configs[1:], worker)
        coordinator.wait_for_workers(timeout=5)
        with pytest.raises(AggregationError, match="finite"):  # e.g. 0 examples / 0
            coordinator.reduce_round(fedavg, contribution={"w": np.ones(2)},
                                     weight=float("nan"))
        result = coordinator.reduce_round(fedavg, contribution={"w": np.full(2, 1.0)})
        scattered = ranks.join()
    finally:
        coordinator.close()
    assert result.round == 1 and sorted(result.contributors) == [0, 1]
    np.testing.assert_allclose(scattered[1]["w"], [2.0, 2.0])
