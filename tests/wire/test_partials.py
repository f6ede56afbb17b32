"""What a receiver keeps of cut transfers stays bounded in bytes, count and time (issue 39)."""

from __future__ import annotations

import numpy as np
import pytest

from meshkit import wire
from meshkit.errors import ConfigError
from meshkit.wire._partials import (
    COMPLETED,
    EVICTED,
    EXPIRED,
    LAYOUT,
    RESUMED,
    UNKNOWN,
    Partial,
)


def _partial(name: str, total: int = 1000, done: int = 1, rank: int = 1,
             key: bytes | None = None) -> Partial:
    return Partial(id=name.encode().ljust(16, b"."), total=total, count=4,
                   size=-(-total // 4), kind=3, tag=9, sender=rank, flags=0, peer_rank=rank,
                   peer_key=key, body=np.zeros(total, np.uint8), done=done)


def _claim(store: wire.PartialStore, p: Partial, **change: object) -> tuple[object, int]:
    fields = {"total": p.total, "count": p.count, "size": p.size, "rank": p.peer_rank,
              "key": p.peer_key}
    fields.update(change)
    return store.claim(p.id, b"d" * 16, fields["total"], fields["count"], fields["size"],
                       fields["rank"], fields["key"])


def test_the_oldest_partials_are_evicted_to_stay_within_max_bytes():
    store = wire.PartialStore(max_bytes=2500)
    a, b, c = _partial("a"), _partial("b"), _partial("c")
    assert store.park(a) and store.park(b) and store.nbytes == 2000
    assert store.park(c)  # 3000 > 2500: the oldest goes
    assert store.nbytes == 2000 and b"a".ljust(16, b".") not in store
    assert store.evicted == 1
    assert _claim(store, a) == (None, EVICTED)
    partial, status = _claim(store, b)
    assert (partial, status) == (b, RESUMED) and b.digest == b"d" * 16
    assert store.nbytes == 1000  # claimed: out of the store


def test_at_most_max_partials_are_kept():
    store = wire.PartialStore(max_partials=2)
    for name in "abc":
        store.park(_partial(name))
    assert len(store) == 2 and store.evicted == 1


def test_a_partial_bigger_than_the_whole_budget_is_not_kept():
    store = wire.PartialStore(max_bytes=999)
    big = _partial("big")
    assert not store.park(big)
    assert len(store) == 0 and store.nbytes == 0
    assert _claim(store, big) == (None, EVICTED)


def test_a_partial_with_nothing_verified_is_not_kept():
    store = wire.PartialStore()
    assert not store.park(_partial("none", done=0))
    assert len(store) == 0


def test_a_partial_expires_after_its_ttl():
    now = [0.0]
    store = wire.PartialStore(ttl=10.0, clock=lambda: now[0])
    p = _partial("p")
    store.park(p)
    now[0] = 10.0
    assert _claim(store, p) == (p, RESUMED)  # at the ttl: still kept
    store.park(p)
    now[0] = 20.5
    assert _claim(store, p) == (None, EXPIRED)
    assert store.expired == 1 and store.nbytes == 0


def test_another_peer_cannot_claim_a_partial_and_it_stays_for_its_sender():
    store = wire.PartialStore()
    p = _partial("p", rank=1, key=b"k" * 32)
    store.park(p)
    assert _claim(store, p, rank=2) == (None, UNKNOWN)
    assert _claim(store, p, key=b"x" * 32) == (None, UNKNOWN)
    assert _claim(store, p, key=None) == (None, UNKNOWN)
    assert p.id in store
    assert _claim(store, p) == (p, RESUMED)


def test_an_offer_with_another_layout_discards_the_partial():
    store = wire.PartialStore()
    p = _partial("p")
    store.park(p)
    assert _claim(store, p, total=p.total + 1) == (None, LAYOUT)
    assert len(store) == 0
    assert "size, segment count or segment size" in wire.Answer(0, LAYOUT).reason


def test_a_partial_parked_again_replaces_its_older_self():
    store = wire.PartialStore()
    p = _partial("p")
    store.park(p)
    p.done = 3
    store.park(p)
    assert len(store) == 1 and store.nbytes == p.total


@pytest.mark.parametrize("bad", [{"max_bytes": -1}, {"max_partials": -1}, {"ttl": 0}])
def test_a_store_with_impossible_bounds_is_refused(bad):
    with pytest.raises(ConfigError, match="partial store needs"):
        wire.PartialStore(**bad)


def test_only_its_own_sender_starting_a_transfer_over_discards_its_partial():
    store = wire.PartialStore()
    p = _partial("p", rank=1)
    store.park(p)
    store.discard(p.id, 2, None)
    assert p.id in store
    store.discard(p.id, 1, None)
    assert p.id not in store


def test_a_completed_transfer_is_answered_completed_to_its_sender_only():
    store = wire.PartialStore()
    p = _partial("p", rank=1)
    store.completed(p.id, 1, None)
    assert _claim(store, p) == (None, COMPLETED)
    assert _claim(store, p, rank=2) == (None, UNKNOWN)


def test_one_peers_cut_transfers_never_evict_another_peers_partials():
    # Issue 39: the bounds were shared, so a peer cut often pushed out what another
    # would resume. Each peer now has its own quota (2 partials, 2500 bytes here).
    store = wire.PartialStore(max_bytes=10_000, max_partials=16, peer_bytes=2500,
                              peer_partials=2)
    mine = _partial("mine", rank=1)
    assert store.park(mine)
    theirs = [_partial(f"t{i}", rank=2) for i in range(6)]
    for p in theirs:
        assert store.park(p)  # each evicts rank 2's own oldest, never rank 1's
    assert store.peer_nbytes(2) == 2000 and store.peer_nbytes(1) == 1000
    assert store.evicted == 4
    assert _claim(store, theirs[0]) == (None, EVICTED)
    assert _claim(store, mine) == (mine, RESUMED)


def test_a_peer_over_its_byte_quota_evicts_its_own_oldest():
    store = wire.PartialStore(max_bytes=10_000, peer_bytes=2500)
    a, b, c = (_partial(n, rank=3) for n in "abc")
    other = _partial("o", rank=4, total=2500)
    assert store.park(other) and store.park(a) and store.park(b) and store.park(c)
    assert store.peer_nbytes(3) == 2000 and store.peer_nbytes(4) == 2500
    assert a.id not in store and other.id in store


def test_a_full_store_keeps_the_partials_it_holds_and_refuses_a_new_peers():
    store = wire.PartialStore(max_bytes=2000, peer_bytes=2000)
    a, b = _partial("a", rank=1), _partial("b", rank=1)
    assert store.park(a) and store.park(b)
    late = _partial("late", rank=2)
    assert not store.park(late)  # rank 1's partials stay; rank 2's is not kept
    assert a.id in store and b.id in store
    assert _claim(store, late) == (None, EVICTED)


def test_a_partial_bigger_than_its_peers_quota_is_not_kept():
    store = wire.PartialStore(max_bytes=10_000, peer_bytes=999)
    assert not store.park(_partial("big"))
    assert len(store) == 0


@pytest.mark.parametrize("bad", [{"peer_bytes": -1}, {"peer_partials": -1}])
def test_a_store_with_an_impossible_peer_quota_is_refused(bad):
    with pytest.raises(ConfigError, match="partial store needs"):
        wire.PartialStore(**bad)
