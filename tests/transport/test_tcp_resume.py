"""A star link cut part-way comes back and its cut message continues (issue 39).

Real sockets on 127.0.0.1: the worker dials the coordinator through
``tests/support/cutting_proxy.py``, a protocol-blind proxy that cuts the
first connection after a set number of bytes and counts what crosses each
one, so "the bytes sent after the reconnect" are the proxy's count.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from meshkit import PeerLostError, wire
from meshkit.node.config import NodeConfig
from meshkit.testing.support import Call
from tests.support.cutting_proxy import CuttingProxy

SECRET = b"tcp-resume-secret-0123456789"
SEGMENT = 4 * wire.SEGMENT_UNIT  # 256 KiB
PARAMS = 2 << 20  # 8 MiB of float32: 32 segments
TAG = 0x10


def _config(rank: int, **kw: Any) -> NodeConfig:
    return NodeConfig(rank=rank, world=2, topology="star", secret=SECRET, timeout=10.0,
                      segment_bytes=SEGMENT, **kw)


def _model(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal(PARAMS).astype(np.float32), "round": seed}


def _message_wire(nbytes: int) -> int:
    """What a resumable message of ``nbytes`` costs on the wire: its lead and every
    segment as a frame (docs/wire.md §2.4, §2.5)."""
    frame = wire.HEADER_SIZE + wire.BODY_TAG_SIZE
    return frame + wire.RESUME_LEAD.size + -(-nbytes // SEGMENT) * frame + nbytes


def _wait(group: Any, predicate: Any, timeout: float = 20.0) -> bool:
    with group.links._lock:
        return group.links._lock.wait_for(predicate, timeout)


@pytest.fixture
def star():
    """A coordinator with resume on, and a proxy in front of it whose first link is cut."""
    made: list[Any] = []

    def build(cut: int | None, resume: float = 20.0,
              down_cut: int | None = None) -> tuple[Any, Any, CuttingProxy]:
        g0 = _config(0, bind="127.0.0.1:0", resume_seconds=resume).connect()
        made.append(g0)
        host, port = g0.address.rsplit(":", 1)
        proxy = CuttingProxy((host, int(port)), cuts=[cut], down_cuts=[down_cut])
        made.append(proxy)
        g1 = _config(1, peers=[f"127.0.0.1:{proxy.address[1]}"],
                     resume_seconds=resume).connect()
        made.append(g1)
        g0.wait_for_workers(timeout=10)
        return g0, g1, proxy

    yield build
    for thing in reversed(made):
        thing.close()


def test_a_contribution_cut_at_half_continues_after_the_worker_redials(star):
    model = _model(1)
    nbytes = wire.encode_state(model).nbytes
    g0, g1, proxy = star(cut=nbytes // 2)
    before = proxy.link(0).up  # the handshake: the link is idle once joined
    sending = Call(lambda: g1.send(0, TAG, model), "worker send")
    got = g0.recv(1, TAG, timeout=30)
    sending.result(30)
    np.testing.assert_array_equal(got["w"], model["w"])
    assert got["round"] == 1
    assert proxy.link(0).cut.is_set()
    # What of the message the first link did not carry, plus one segment, bounds
    # what crossed after the reconnect (its handshake and offer included); a
    # restart would send all of it again.
    remainder = _message_wire(nbytes) - (proxy.link(0).up - before)
    after = proxy.link(1).up
    assert after < remainder + SEGMENT, (after, remainder)
    assert g1.links.redials == 1 and g0.links.replaced == 1
    assert g1.links.resumed_bytes > nbytes // 4
    # No death, no return: rank 1 is live throughout and the link still works.
    assert g0.dead == {} and g0.returning == [] and g0.live_ranks == [1]
    g0.send(1, TAG, {"ok": 1})
    assert g1.recv(0, TAG, timeout=10) == {"ok": 1}


def test_the_state_out_cut_at_half_continues_after_the_worker_redials(star):
    model = _model(2)
    nbytes = wire.encode_state(model).nbytes
    g0, g1, proxy = star(cut=None, down_cut=nbytes // 2)
    before = proxy.link(0).down
    sending = Call(lambda: g0.send(1, TAG, model), "coordinator send")
    got = g1.recv(0, TAG, timeout=30)
    sending.result(30)
    np.testing.assert_array_equal(got["w"], model["w"])
    assert proxy.link(0).cut.is_set()
    assert g1.links.redials == 1 and g0.links.replaced == 1
    remainder = _message_wire(nbytes) - (proxy.link(0).down - before)
    after = proxy.link(1).down
    assert after < remainder + SEGMENT, (after, remainder)
    assert g0.links.resumed_bytes > nbytes // 4
    assert g0.dead == {} and g0.live_ranks == [1]


def test_with_resume_off_a_cut_link_is_a_dead_worker_as_before(star):
    model = _model(3)
    nbytes = wire.encode_state(model).nbytes
    g0, g1, proxy = star(cut=nbytes // 2, resume=0.0)
    try:  # the kernel's buffers may take the rest before the cut is felt
        g1.send(0, TAG, model)
    except PeerLostError:
        pass
    assert _wait(g0, lambda: 1 in g0.dead)
    assert _wait(g1, lambda: 0 in g1.dead)
    assert len(proxy.links) == 1 and g1.links.redials == 0


def test_a_worker_that_cannot_redial_in_time_loses_the_coordinator(star):
    model = _model(4)
    nbytes = wire.encode_state(model).nbytes
    g0, g1, proxy = star(cut=nbytes // 2, resume=1.0)
    proxy.close()  # nothing to redial
    with pytest.raises(PeerLostError):
        g1.send(0, TAG, model)
    assert _wait(g1, lambda: 0 in g1.dead)
    assert g1.links.redials == 0
    assert _wait(g0, lambda: 1 in g0.dead)


def test_a_new_node_claiming_a_held_rank_ends_the_hold_and_returns():
    # A redial says so in its handshake role; a node started afresh (its old
    # process died) does not, so the coordinator stops holding the cut link,
    # declares the rank dead and admits the new node as returning, at once.
    g0 = _config(0, bind="127.0.0.1:0", resume_seconds=600.0).connect()
    host, port = g0.address.rsplit(":", 1)
    proxy = CuttingProxy((host, int(port)))
    try:
        old = _config(1, peers=[f"127.0.0.1:{proxy.address[1]}"]).connect()  # no redial
        g0.wait_for_workers(timeout=10)
        proxy.link(0).close()  # the cut: the old node gives up, rank 0 holds the link
        assert _wait(old, lambda: 0 in old.dead)
        new = _config(1, peers=[g0.address]).connect()
        try:
            assert _wait(g0, lambda: g0.returning == [1])
            assert "restarted" in g0.dead[1] and g0.links.replaced == 0
        finally:
            new.close()
        old.close()
    finally:
        proxy.close()
        g0.close()


def test_a_redial_the_coordinator_does_not_hold_is_refused_and_the_worker_gives_up():
    # resume on at the worker only: the coordinator declared rank 1 dead at the cut
    # and refuses its redial (start the node again) instead of taking it back.
    g0 = _config(0, bind="127.0.0.1:0").connect()
    host, port = g0.address.rsplit(":", 1)
    proxy = CuttingProxy((host, int(port)))
    try:
        g1 = _config(1, peers=[f"127.0.0.1:{proxy.address[1]}"], resume_seconds=600.0).connect()
        g0.wait_for_workers(timeout=10)
        proxy.link(0).close()
        assert _wait(g1, lambda: 0 in g1.dead)
        assert g1.links.redials == 0 and len(proxy.links) == 2
        assert _wait(g0, lambda: any("start the node again" in r for r in g0.refused))
        g1.close()
    finally:
        proxy.close()
        g0.close()
