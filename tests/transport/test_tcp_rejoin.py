"""A star coordinator lets a dead rank's restarted node back in, but only when taken back."""

from __future__ import annotations

import threading

import pytest

from meshkit import PeerLostError
from meshkit.node.config import NodeConfig

SECRET = b"tcp-rejoin-secret-0123"


def coordinator(world: int):
    return NodeConfig(rank=0, world=world, topology="star", bind="127.0.0.1:0", secret=SECRET,
                      timeout=5.0).connect()


def worker(rank: int, world: int, address: str):
    return NodeConfig(rank=rank, world=world, peers=[address], topology="star",
                      secret=SECRET, timeout=5.0).connect()


def wait_until(group, predicate, timeout: float = 5.0) -> bool:
    """Wait on the tcp group's own condition (notified on every link change), bounded."""
    with group.links._lock:
        return group.links._lock.wait_for(predicate, timeout)


def test_a_restarted_rank_is_returning_until_taken_back_then_live_again():
    g0 = coordinator(2)
    first = worker(1, 2, g0.address)
    try:
        g0.wait_for_workers(timeout=5)
        first.close()  # the node goes away (its process died, say)
        assert wait_until(g0, lambda: 1 in g0.dead)
        second = worker(1, 2, g0.address)  # restarted with the same rank and secret
        try:
            assert wait_until(g0, lambda: g0.returning == [1])
            # Dead until the rounds take it back: no work can be sent to it yet.
            assert 1 in g0.dead and g0.live_ranks == []
            with pytest.raises(PeerLostError, match="rank 1 is dead"):
                g0.send(1, 0x10, {"x": 1})
            second.send(0, 0x10, {"hello": "again"})
            assert g0.take_back() == [1]
            assert g0.dead == {} and g0.returning == [] and g0.live_ranks == [1]
            # What it sent while returning was kept for the coordinator.
            assert g0.recv(1, 0x10, timeout=5) == {"hello": "again"}
            g0.send(1, 0x10, {"x": 2})
            assert second.recv(0, 0x10, timeout=5) == {"x": 2}
            assert g0.take_back() == []
        finally:
            second.close()
    finally:
        g0.close()


def test_a_returning_rank_that_drops_again_before_it_is_taken_back_stays_dead():
    g0 = coordinator(2)
    first = worker(1, 2, g0.address)
    try:
        g0.wait_for_workers(timeout=5)
        first.close()
        assert wait_until(g0, lambda: 1 in g0.dead)
        second = worker(1, 2, g0.address)
        assert wait_until(g0, lambda: g0.returning == [1])
        second.close()
        assert wait_until(g0, lambda: g0.returning == [])
        assert 1 in g0.dead and g0.take_back() == []
    finally:
        g0.close()


def test_a_restart_that_races_its_predecessors_link_drop_is_admitted(monkeypatch):
    # The ledger marks a death before the group drops the old link; a restarted
    # node handshaking in between must wait for that drop, not be refused as
    # a duplicate rank. Hold the drop until the restarted node is being admitted.
    g0 = coordinator(2)
    first = worker(1, 2, g0.address)
    second = None
    try:
        g0.wait_for_workers(timeout=5)
        admitting = threading.Event()
        drop, problem = g0.links.drop, g0.links._rank_problem

        waited: list[bool] = []

        def held_drop(peer):
            waited.append(admitting.wait(10))
            drop(peer)

        def seen_problem(rank, role):
            admitting.set()
            return problem(rank, role)

        monkeypatch.setattr(g0.links, "drop", held_drop)
        monkeypatch.setattr(g0.links, "_rank_problem", seen_problem)
        first.close()
        assert wait_until(g0, lambda: 1 in g0.dead)
        second = worker(1, 2, g0.address)
        assert wait_until(g0, lambda: g0.returning == [1])
        assert g0.take_back() == [1] and g0.live_ranks == [1]
        # The race was really set up: the drop was held until the restart was admitted.
        assert waited == [True]
    finally:
        if second is not None:
            second.close()
        g0.close()


def test_a_restart_right_after_the_first_join_is_not_refused_as_a_duplicate(monkeypatch):
    # The coordinator's admitting thread reserves a rank while it welcomes it. It used to
    # release the reservation only after registering the link -- after the ledger said
    # "joined" -- so a node that joined, left and restarted before that thread ran again (a
    # loaded machine) found its own old reservation: "duplicate rank". Hold the first
    # admitting thread just after it registered the link, until the restart is through.
    g0 = coordinator(2)
    register = g0.links._register
    hold, held = threading.Event(), threading.Event()

    def held_register(rank, channel):
        register(rank, channel)
        if not held.is_set():
            held.set()
            hold.wait(20)

    monkeypatch.setattr(g0.links, "_register", held_register)
    first = worker(1, 2, g0.address)
    second = None
    try:
        assert held.wait(5)
        g0.wait_for_workers(timeout=5)
        first.close()
        assert wait_until(g0, lambda: 1 in g0.dead)
        second = worker(1, 2, g0.address)  # refused as a duplicate before
        assert wait_until(g0, lambda: g0.returning == [1])
        assert g0.take_back() == [1] and g0.live_ranks == [1]
    finally:
        hold.set()
        if second is not None:
            second.close()
        g0.close()
