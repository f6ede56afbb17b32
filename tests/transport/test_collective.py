"""The mesh all-reduce (Group.mesh_all_reduce): a weighted ring over direct links, no coordinator fold."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from meshkit import AggregationError, MeshError, PeerLostError
from meshkit.node.config import NodeConfig
from meshkit.transport._collective import pack, unpack
from meshkit_tcp.testing import inproc_configs, run_ranks

from conftest import free_ports

SECRET = b"collective-test-secret"



def tcp_mesh(world: int, timeout: float = 5.0) -> list[NodeConfig]:
    peers = [f"127.0.0.1:{p}" for p in free_ports(world)]
    return [NodeConfig(rank=r, world=world, peers=peers, topology="mesh", secret=SECRET,
                       timeout=timeout) for r in range(world)]


def contribution(rank: int) -> dict:
    rng = np.random.default_rng(rank)
    return {"w": rng.standard_normal((7, 3)).astype(np.float32),
            "b": rng.standard_normal(5),                      # float64
            "h": rng.standard_normal(4).astype(np.float16),
            "odd": rng.standard_normal(1).astype(np.float32)}  # fewer elements than ranks


def expected_mean(ranks, weights) -> dict:
    total = sum(weights)
    states = [contribution(r) for r in ranks]
    return {k: sum(w * s[k].astype(np.float64) for s, w in zip(states, weights)) / total
            for k in states[0]}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_ring_gives_the_weighted_mean_on_every_rank_over_tcp(world: int) -> None:
    weights = [float(r + 1) for r in range(world)]
    results = run_ranks(tcp_mesh(world), lambda g: g.mesh_all_reduce(
        contribution(g.rank), weight=weights[g.rank])).join()
    want = expected_mean(range(world), weights)
    for rank, got in results.items():
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            assert got[key].dtype == contribution(0)[key].dtype, key
            assert got[key].shape == value.shape
            rtol = 2e-3 if got[key].dtype == np.float16 else 1e-6
            np.testing.assert_allclose(got[key], value, rtol=rtol, atol=1e-6)
    # Every rank holds the same bytes: the all-gather hands one sum round the ring.
    for rank in range(1, world):
        for key in want:
            assert results[rank][key].tobytes() == results[0][key].tobytes()


def test_a_subset_of_ranks_reduces_among_itself_and_rounds_repeat() -> None:
    configs = inproc_configs(4, topology="mesh")
    joined = threading.Barrier(4)

    def body(group):
        joined.wait(5)  # an inproc mesh forms only while every rank is there
        if group.rank == 0:
            return None
        out = []
        for step in range(3):  # rounds are numbered per set of participants
            out.append(group.mesh_all_reduce({"x": np.full(10, float(group.rank + step),
                                                            np.float32)}, ranks=[1, 2, 3]))
        return out

    results = run_ranks(configs, body).join()
    for rank in (1, 2, 3):
        for step, got in enumerate(results[rank]):
            np.testing.assert_allclose(got["x"], 2.0 + step)


def test_a_lost_peer_is_an_error_on_every_rank_within_the_timeout() -> None:
    configs = tcp_mesh(4, timeout=3.0)

    def body(group):
        if group.rank == 3:
            group.close()  # gone before the collective
            return None
        return group.mesh_all_reduce({"x": np.ones(1000, np.float32)})

    ranks = run_ranks(configs, body)
    ranks.join(30, raise_errors=False)
    assert sorted(ranks.errors) == [0, 1, 2], ranks.errors
    for error in ranks.errors.values():
        assert isinstance(error, PeerLostError), error


def test_layouts_that_differ_are_refused_on_every_rank() -> None:
    configs = inproc_configs(3, topology="mesh")
    joined = threading.Barrier(3)

    def body(group):
        joined.wait(5)  # nobody leaves before every link is up
        shape = 4 if group.rank != 2 else 5
        return group.mesh_all_reduce({"x": np.ones(shape, np.float32)})

    ranks = run_ranks(configs, body)
    ranks.join(30, raise_errors=False)
    assert sorted(ranks.errors) == [0, 1, 2], ranks.errors
    assert any(isinstance(e, AggregationError) and "layout" in str(e)
               for e in ranks.errors.values()), ranks.errors


def test_integer_arrays_and_json_values_are_refused_before_anything_moves() -> None:
    with pytest.raises(AggregationError, match="'n' is int64"):
        pack({"n": np.arange(3)}, 1.0, [0, 1])
    with pytest.raises(AggregationError, match="'lr' is a float"):
        pack({"lr": 0.1}, 1.0, [0, 1])


def test_pack_and_unpack_keep_dtypes_and_divide_by_the_weight() -> None:
    state = contribution(0)
    layout, buffers = pack(state, 2.0, [0])
    assert buffers[0][-1] == 2.0
    back = unpack(layout, buffers)
    for key, value in state.items():
        assert back[key].dtype == value.dtype
        np.testing.assert_allclose(back[key], value, rtol=1e-3 if value.dtype == np.float16
                                   else 1e-6)
    with pytest.raises(AggregationError, match="positive total weight"):
        unpack(*pack({"x": np.ones(2, np.float32)}, 0.0, [0]))


def test_a_star_has_no_direct_links_and_is_refused() -> None:
    configs = inproc_configs(2)
    joined = threading.Barrier(2)

    def body(group):
        joined.wait(5)
        return group.mesh_all_reduce({"x": np.ones(2, np.float32)}, timeout=1)

    ranks = run_ranks(configs, body)
    ranks.join(30, raise_errors=False)
    assert sorted(ranks.errors) == [0, 1], ranks.errors
    assert all(isinstance(e, MeshError) and "star" in str(e)
               for e in ranks.errors.values()), ranks.errors
