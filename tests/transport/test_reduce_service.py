"""The star reduce service (meshkit/transport/_reduce.py) over the in-process transport."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from meshkit import AggregationError, MeshError, PeerLostError, plugins
from meshkit.aggregation import streaming
from meshkit.transport import TAG_SCATTER, RoundResult
from meshkit_tcp.inproc import InprocLinks, InprocTransport
from meshkit_tcp.testing import inproc_configs, run_ranks


@pytest.fixture
def fedavg():
    return plugins.create("aggregator", "fedavg")


def contribution(rank: int) -> dict:
    return {"w": np.full((2, 3), float(rank), np.float32), "b": np.array([rank, -rank], np.float64),
            "meta": {"lr": 0.1 * rank}}


def test_a_round_is_the_weighted_mean_over_every_worker(fedavg) -> None:
    configs = inproc_configs(4)
    coordinator = configs[0].connect()
    try:
        ranks = run_ranks(configs[1:], lambda g: g.all_reduce(contribution(g.rank), weight=g.rank))
        result = coordinator.reduce_round(fedavg)
        scattered = ranks.join()
    finally:
        coordinator.close()
    assert isinstance(result, RoundResult)
    assert sorted(result.contributors) == [1, 2, 3] and result.dead == []
    assert result.total_weight == pytest.approx(6.0)
    expected = (1 * 1 + 2 * 2 + 3 * 3) / 6
    np.testing.assert_allclose(result.consensus["w"], expected, rtol=1e-6)
    assert result.consensus["w"].dtype == np.float32
    assert result.consensus["meta"]["lr"] == pytest.approx(0.1 * expected)
    for rank, state in scattered.items():
        np.testing.assert_allclose(state["w"], expected, rtol=1e-6)
        np.testing.assert_allclose(state["b"], [expected, -expected], rtol=1e-12)


def test_the_outer_optimizer_steps_the_consensus_before_the_scatter(fedavg) -> None:
    class HalfStep:
        """x <- x - 0.5 * (x - consensus): a visible, hand-checkable step."""

        def step(self, global_state, consensus):
            return {k: global_state[k] - 0.5 * (global_state[k] - consensus[k]) for k in consensus}

        def state_dict(self):
            return {}

        def load_state_dict(self, d):
            pass

    configs = inproc_configs(3)
    coordinator = configs[0].connect()
    try:
        ranks = run_ranks(configs[1:], lambda g: g.all_reduce({"x": np.full(2, 2.0 * g.rank)}))
        result = coordinator.reduce_round(fedavg, HalfStep(), {"x": np.full(2, 10.0)})
        scattered = ranks.join()
    finally:
        coordinator.close()
    np.testing.assert_allclose(result.consensus["x"], 3.0)  # mean of 2 and 4
    np.testing.assert_allclose(result.state["x"], 6.5)  # 10 - 0.5 * (10 - 3)
    for state in scattered.values():
        np.testing.assert_allclose(state["x"], 6.5)


def test_the_builtin_average_outer_optimizer_scatters_the_consensus(fedavg) -> None:
    average = plugins.create("outer_optimizer", "average")
    configs = inproc_configs(3)
    coordinator = configs[0].connect()
    try:
        ranks = run_ranks(configs[1:], lambda g: g.all_reduce({"x": np.full(2, float(g.rank))}))
        result = coordinator.reduce_round(fedavg, average, {"x": np.zeros(2)})
        scattered = ranks.join()
    finally:
        coordinator.close()
    for state in scattered.values():
        np.testing.assert_allclose(state["x"], 1.5)
    np.testing.assert_allclose(result.state["x"], 1.5)


def test_a_silent_worker_is_declared_dead_and_the_round_completes_without_it(fedavg) -> None:
    configs = inproc_configs(4, timeout=1.0)
    coordinator = configs[0].connect()
    release = threading.Event()
    try:
        def worker(group):
            if group.rank == 3:
                release.wait(10)  # never contributes to round 0
                with pytest.raises(PeerLostError):
                    group.all_reduce({"w": np.ones(3)})
                return "lost"
            return group.all_reduce({"w": np.full(3, float(group.rank))}, weight=1.0)

        ranks = run_ranks(configs[1:], worker)
        coordinator.wait_for_workers(timeout=5)
        result = coordinator.reduce_round(fedavg, timeout=0.5)
        release.set()
        scattered = ranks.join()
    finally:
        coordinator.close()
    assert sorted(result.contributors) == [1, 2]
    assert result.dead == [3]
    assert "sent no contribution to reduce round 0 within 0.5 s" in result.ledger[3]
    np.testing.assert_allclose(scattered[1]["w"], 1.5, rtol=1e-6)
    assert scattered[3] == "lost"


def test_a_worker_that_leaves_mid_round_is_dropped_and_survivors_get_their_mean(fedavg) -> None:
    configs = inproc_configs(5, timeout=5.0)
    coordinator = configs[0].connect()
    try:
        def worker(group):
            if group.rank == 4:
                return "left"  # run_ranks closes the group: gone before contributing
            return group.all_reduce({"w": np.full(4, float(group.rank))}, weight=group.rank)

        ranks = run_ranks(configs[1:], worker)
        coordinator.wait_for_workers(timeout=5)
        result = coordinator.reduce_round(fedavg)
        scattered = ranks.join()
    finally:
        coordinator.close()
    assert sorted(result.contributors) == [1, 2, 3]
    assert 4 in result.ledger
    expected = (1 + 4 + 9) / 6
    for rank in (1, 2, 3):
        np.testing.assert_allclose(scattered[rank]["w"], expected, rtol=1e-6)


def test_every_worker_dead_ends_the_service_with_peer_lost(fedavg) -> None:
    configs = inproc_configs(3, timeout=0.3)
    coordinator = configs[0].connect()
    try:
        run_ranks(configs[1:], lambda g: None).join()
        with pytest.raises(PeerLostError, match="every worker is dead.*rank 1.*rank 2"):
            coordinator.reduce_round(fedavg)
        with pytest.raises(PeerLostError, match="every worker is dead"):
            coordinator.reduce_round(fedavg)
    finally:
        coordinator.close()


def test_contributions_that_disagree_abort_the_round_on_every_rank(fedavg) -> None:
    configs = inproc_configs(3)
    coordinator = configs[0].connect()
    try:
        def worker(group):
            shape = 3 if group.rank == 1 else 4
            with pytest.raises(AggregationError, match="the coordinator refused reduce round 0"):
                group.all_reduce({"w": np.ones(shape)})
            # The service carries on: the next round works.
            return group.all_reduce({"w": np.full(2, float(group.rank))})

        ranks = run_ranks(configs[1:], worker)
        coordinator.wait_for_workers(timeout=5)
        with pytest.raises(AggregationError, match="'w'"):
            coordinator.reduce_round(fedavg)
        result = coordinator.reduce_round(fedavg)
        scattered = ranks.join()
    finally:
        coordinator.close()
    assert result.round == 1
    np.testing.assert_allclose(scattered[2]["w"], 1.5)


def test_a_negative_weight_is_refused_before_it_is_sent() -> None:
    configs = inproc_configs(2)
    coordinator = configs[0].connect()
    worker = configs[1].connect()
    try:
        with pytest.raises(AggregationError, match="finite and >= 0"):
            worker.all_reduce({"w": np.ones(2)}, weight=-1.0)
    finally:
        worker.close()
        coordinator.close()


def test_the_coordinator_may_fold_its_own_contribution(fedavg) -> None:
    configs = inproc_configs(2)
    coordinator = configs[0].connect()
    try:
        ranks = run_ranks(configs[1:], lambda g: g.all_reduce({"x": np.array([3.0])}, weight=3))
        result = coordinator.reduce_round(fedavg, contribution={"x": np.array([-1.0])}, weight=1)
        scattered = ranks.join()
    finally:
        coordinator.close()
    assert result.contributors[0] == 0 and sorted(result.contributors) == [0, 1]
    np.testing.assert_allclose(scattered[1]["x"], [2.0])  # (-1*1 + 3*3) / 4


def test_all_reduce_raises_rather_than_returning_a_local_value_when_the_coordinator_is_gone() -> None:
    configs = inproc_configs(2, timeout=0.3)
    coordinator = configs[0].connect()
    worker = configs[1].connect()
    try:
        coordinator.close()
        with pytest.raises(PeerLostError):
            worker.all_reduce({"w": np.ones(2)})
    finally:
        worker.close()


def test_a_coordinator_that_never_runs_the_round_times_the_worker_out() -> None:
    configs = inproc_configs(2, timeout=0.2)
    coordinator = configs[0].connect()
    worker = configs[1].connect()
    try:
        with pytest.raises(PeerLostError, match="consensus of reduce round 0"):
            worker.all_reduce({"w": np.ones(2)}, timeout=0.2)
    finally:
        worker.close()
        coordinator.close()


def test_roles_are_enforced() -> None:
    configs = inproc_configs(2)
    coordinator = configs[0].connect()
    worker = configs[1].connect()
    try:
        with pytest.raises(MeshError, match="call group.reduce_round"):
            coordinator.all_reduce({"w": np.ones(2)})
        with pytest.raises(MeshError, match="only the coordinator"):
            worker.reduce_round(object())
        with pytest.raises(MeshError, match="global_state"):
            coordinator.reduce_round(plugins.create("aggregator", "fedavg"), outer=object())
    finally:
        worker.close()
        coordinator.close()


class PlainMean:
    """A third-party aggregator with only aggregate() (no streaming form)."""

    def aggregate(self, states, weights=None):
        weights = [1.0] * len(states) if weights is None else list(weights)
        return {"w": sum(w * s["w"] for s, w in zip(states, weights)) / sum(weights)}


def test_an_aggregator_without_begin_is_refused_naming_the_buffering_wrapper() -> None:
    configs = inproc_configs(2)
    coordinator = configs[0].connect()
    try:
        with pytest.raises(MeshError, match=r"needs a streaming aggregator \(one with begin"
                                            r"\(\).*meshkit\.aggregation\.streaming"):
            coordinator.reduce_round(PlainMean())
        with pytest.raises(MeshError, match="needs a streaming aggregator"):
            coordinator.reduce_round(None)
    finally:
        coordinator.close()


def test_a_plain_aggregator_wrapped_in_streaming_reduces_a_buffered_round() -> None:
    configs = inproc_configs(3)
    coordinator = configs[0].connect()
    try:
        ranks = run_ranks(configs[1:], lambda g: g.all_reduce({"w": np.full(2, float(g.rank))},
                                                             weight=g.rank))
        result = coordinator.reduce_round(streaming(PlainMean()))
        scattered = ranks.join()
    finally:
        coordinator.close()
    assert sorted(result.contributors) == [1, 2]
    expected = (1 * 1 + 2 * 2) / 3
    np.testing.assert_allclose(result.consensus["w"], expected)
    for state in scattered.values():
        np.testing.assert_allclose(state["w"], expected)


def test_bf16_on_the_wire_keeps_accumulation_wide_and_control_frames_exact(fedavg) -> None:
    class Bf16:
        bf16_wire = True

    configs = inproc_configs(3)
    transport = InprocTransport(Bf16())
    coordinator = transport.connect(configs[0])
    value = np.float32(1.0 + 2 ** -12)  # not representable in bf16
    try:
        def worker(group):
            model = group.all_reduce({"w": np.full(4, value, np.float32)})
            control = group.all_reduce({"w": np.full(4, value, np.float32)}, kind="control")
            return model, control

        threads = []
        results = {}
        for config in configs[1:]:
            def body(config=config):
                group = transport.connect(config)
                try:
                    results[config.rank] = worker(group)
                finally:
                    group.close()
            threads.append(threading.Thread(target=body))
            threads[-1].start()
        model_round = coordinator.reduce_round(fedavg)
        control_round = coordinator.reduce_round(fedavg, kind="control")
        for thread in threads:
            thread.join(10)
    finally:
        coordinator.close()
    model, control = results[1]
    assert model["w"].dtype == np.float32 and control["w"].dtype == np.float32
    assert model["w"][0] == np.float32(1.0)  # rounded through bf16 on the wire
    assert control["w"][0] == value  # control traffic stays exact
    assert model_round.consensus["w"].dtype == np.float32
    assert control_round.consensus["w"][0] == value


def test_many_rounds_keep_their_numbers_in_step(fedavg) -> None:
    configs = inproc_configs(3)
    coordinator = configs[0].connect()
    try:
        ranks = run_ranks(configs[1:], lambda g: [
            g.all_reduce({"i": np.array([float(i + g.rank)])})["i"][0] for i in range(5)])
        rounds = [coordinator.reduce_round(fedavg).round for _ in range(5)]
        results = ranks.join()
    finally:
        coordinator.close()
    assert rounds == [0, 1, 2, 3, 4]
    assert results[1] == pytest.approx([1.5 + i for i in range(5)])


def test_a_rank_that_never_finishes_reading_the_scatter_is_dropped_and_the_round_returns(
        fedavg, monkeypatch) -> None:
    """A trickling reader never trips the stall timeout; the scatter's own deadline must."""
    configs = inproc_configs(4, timeout=0.5)
    coordinator = configs[0].connect()
    real_transmit = InprocLinks.transmit
    rank3_dropped = threading.Event()

    def on_dead(rank, reason):
        if rank == 3:
            rank3_dropped.set()

    def trickling_transmit(links, peer, message, timeout):
        if links.rank == 0 and message.dst == 3 and message.tag == TAG_SCATTER:
            # Stands for a reader that keeps making a little progress: the
            # write ends only when the coordinator drops the link.
            if not rank3_dropped.wait(30):
                raise AssertionError("the scatter to rank 3 was never cut off")
            raise PeerLostError("link to rank 3 dropped")
        return real_transmit(links, peer, message, timeout)

    monkeypatch.setattr(InprocLinks, "transmit", trickling_transmit)
    coordinator.on_dead = on_dead
    try:
        ranks = run_ranks(configs[1:], lambda g: g.all_reduce(contribution(g.rank), weight=1.0))
        result = coordinator.reduce_round(fedavg)
        scattered = ranks.join(raise_errors=False)
    finally:
        coordinator.close()
    assert result.dead == [3] and "reads too slowly" in coordinator.dead[3]
    assert sorted(result.contributors) == [1, 2, 3]
    np.testing.assert_allclose(result.consensus["w"], 2.0, rtol=1e-6)
    for rank in (1, 2):
        np.testing.assert_allclose(scattered[rank]["w"], 2.0, rtol=1e-6)
    assert 3 not in scattered and isinstance(ranks.errors[3], PeerLostError)
