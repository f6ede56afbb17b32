"""The segmented ring: segments of odd sizes, the lazily packed contribution, a failed send."""

from __future__ import annotations

import itertools
import queue

import numpy as np
import pytest
from meshkit_tcp.testing import run_ranks

import meshkit.transport._collective as collective
from meshkit import PeerLostError
from meshkit.node.config import NodeConfig
from meshkit.transport._collective import contribution, pack, ring_sum, segments

from meshkit.train import free_ports
SECRET = b"collective-segments-secret"


def _mesh(world: int) -> list[NodeConfig]:
    peers = [f"127.0.0.1:{p}" for p in free_ports(world)]
    return [NodeConfig(rank=r, world=world, peers=peers, topology="mesh", secret=SECRET,
                       timeout=5.0) for r in range(world)]


def _state(rank: int) -> dict:
    rng = np.random.default_rng(100 + rank)
    return {"a": rng.standard_normal(37).astype(np.float32),
            "b": rng.standard_normal((5, 3)),                              # float64
            "c": rng.standard_normal(11).astype(np.float16),
            "d": rng.standard_normal((6, 4)).astype(np.float32)[:, ::2],  # not contiguous
            "e": np.zeros(0, np.float32)}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("segment_bytes", [4, 12, 64, 1 << 20])
def test_segments_cover_every_element_once_in_bounded_pieces(n: int, segment_bytes: int) -> None:
    buffers = [np.zeros(61, np.float32), np.zeros(2, np.float64)]
    plan = segments(buffers, n, segment_bytes)
    assert len(plan) == n
    seen = [np.zeros(len(b), int) for b in buffers]
    for c, chunk in enumerate(plan):
        assert chunk, "every chunk moves at least one frame"
        for b, lo, hi in chunk:
            assert (hi - lo) * buffers[b].itemsize <= max(segment_bytes, buffers[b].itemsize)
            # Inside chunk c of its buffer.
            if hi > lo:
                assert len(buffers[b]) * c // n <= lo < hi <= len(buffers[b]) * (c + 1) // n
            seen[b][lo:hi] += 1
    for count in seen:
        assert (count == 1).all()
    with pytest.raises(ValueError):
        segments(buffers, n, 0)


@pytest.mark.parametrize("weight", [1.0, 2.5])
def test_contribution_gives_what_pack_puts_in_any_range(weight: float) -> None:
    state = _state(0)
    layout, full = pack(state, weight, [0, 1])
    _, empty = pack(state, weight, [0, 1], fill=False)
    own = contribution(layout, state, weight)
    rng = np.random.default_rng(7)
    for b, buffer in enumerate(full):
        cuts = sorted({0, len(buffer), *rng.integers(0, len(buffer), 6).tolist()})
        for lo, hi in itertools.pairwise(cuts):
            out = empty[b][lo:hi]
            source = own(b, lo, hi, out)
            got = out if source is None else source
            np.testing.assert_array_equal(got, buffer[lo:hi])
    # Reading straight from the state only happens when nothing needs scaling.
    assert (own(0, 0, 5, empty[0][:5]) is None) == (weight != 1.0)


@pytest.mark.parametrize("world", [2, 3])
def test_a_ring_of_many_odd_segments_gives_the_exact_weighted_mean(
        world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collective, "SEGMENT_BYTES", 20)  # 5 float32s: every chunk split
    weights = [1.0, 3.0, 0.5][:world]
    results = run_ranks(_mesh(world), lambda g: g.mesh_all_reduce(
        _state(g.rank), weight=weights[g.rank])).join()
    total = sum(weights)
    for key in _state(0):
        want = sum(w * _state(r)[key].astype(np.float64) for r, w in enumerate(weights)) / total
        for rank in range(world):
            got = results[rank][key]
            assert got.dtype == _state(0)[key].dtype and got.shape == want.shape
            rtol = 2e-3 if got.dtype == np.float16 else 1e-6
            np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-6)
            assert got.tobytes() == results[0][key].tobytes()


def test_a_send_that_fails_on_the_sender_thread_ends_the_ring() -> None:
    inbox: queue.Queue = queue.Queue()
    sent = []

    def send(dst: int, frame) -> None:
        if len(sent) == 2:
            raise PeerLostError("the link to rank 1 broke")
        sent.append(frame["k"])

    def take():
        item = inbox.get(timeout=5)  # bounded: the interrupt must come well before
        if isinstance(item, BaseException):
            raise PeerLostError(f"gave up: {item}")
        return item

    buffers = [np.ones(64, np.float32)]  # chunks of 32: 8 segments of 4 each
    with pytest.raises(PeerLostError, match="gave up: the link to rank 1 broke"):
        ring_sum(buffers, [0, 1], 0, 1, 1, send, take, segment_bytes=16, interrupt=inbox.put)
    assert sent == [0, 1]
