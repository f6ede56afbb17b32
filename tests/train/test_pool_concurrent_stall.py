"""GroupPool writes a model-sized request on a thread per link (issue 39): a stalled worker
holds up only its own link, requests to one rank keep their order, and the bytes counted
out are every byte written."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np

from meshkit.node.config import NodeConfig
from meshkit.train import TAG_REPLY, TAG_REQUEST, GroupPool
from meshkit.train import _pool

SECRET = b"pool-concurrent-secret"
#: Above CONCURRENT_BYTES and far above what the kernel's socket buffers can swallow.
BIG = 16 << 20


def coordinator(world: int, timeout: float):
    return NodeConfig(rank=0, world=world, topology="star", bind="127.0.0.1:0", secret=SECRET,
                      timeout=timeout).connect()


def worker(rank: int, world: int, address: str, timeout: float):
    return NodeConfig(rank=rank, world=world, peers=[address], topology="star", secret=SECRET,
                      timeout=timeout).connect()


class _UnreadSocket:
    """A receiving end that stops reading (its process hung): reads block until released."""

    def __init__(self, sock: socket.socket, release: threading.Event) -> None:
        self._sock = sock
        self._release = release

    def recv_into(self, *args, **kwargs):
        self._release.wait(30)
        raise OSError("released by the test")

    def __getattr__(self, name):
        return getattr(self._sock, name)


def state_request() -> dict:
    return {"op": "set_state", "state": {"w": np.arange(BIG // 4, dtype=np.float32)}}


def answer(group, count: int, seen: list) -> None:
    """A worker acknowledging ``count`` set_state requests, recording each one's seq."""
    for _ in range(count):
        request = group.recv(0, TAG_REQUEST, timeout=20)
        seen.append((request["seq"], float(request["state/w"][-1])))
        group.send(0, TAG_REPLY, {"seq": request["seq"]})


def test_a_stalled_worker_does_not_hold_up_the_state_going_to_the_others() -> None:
    """Rank 1 stops reading before the state is sent to it first, then to rank 2. Rank 2
    gets its state and answers while rank 1's write is still under way (before this
    change the pool wrote to rank 1 until its stall timeout declared it dead, and only
    then to rank 2); rank 1 is declared dead by that timeout, and its ticket fails."""
    hub = coordinator(3, timeout=4.0)
    one, two = (worker(r, 3, hub.address, 4.0) for r in (1, 2))
    release = threading.Event()
    try:
        assert hub.wait_for_workers(timeout=10) == [1, 2]
        channel = one.links._channels[0]
        channel._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        hub.links._channels[1]._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        channel._sock = _UnreadSocket(channel._sock, release)
        seen: list = []
        server = threading.Thread(target=answer, args=(two, 1, seen), daemon=True)
        server.start()
        pool = GroupPool(hub)
        first = pool.send(1, state_request(), timeout=30.0)
        second = pool.send(2, state_request(), timeout=30.0)
        reply = pool.receive()
        assert reply.seq == second and reply.ok, reply
        # Rank 1's write is still waiting on its socket: nobody has declared it dead.
        assert 1 not in pool.dead
        assert pool._writers[1].is_alive()
        lost = pool.receive()  # bounded: the link's stall timeout (4 s) ends the write
        assert lost.seq == first and lost.payload is None
        assert "send failed" in lost.error or "took no data" in lost.error, lost.error
        assert 1 in pool.dead and 2 not in pool.dead
        server.join(10)
        pool.close()
    finally:
        release.set()
        for group in (one, two, hub):
            group.close()


def test_requests_to_one_rank_keep_their_order_and_every_byte_is_counted(monkeypatch) -> None:
    """Big and small requests to the same ranks, interleaved: each rank gets them in the
    order they were sent (a small one after a big one waits for its write), and
    ``bytes_out`` grows by what a one-at-a-time write counts for the same requests."""
    hub = coordinator(3, timeout=10.0)
    workers = [worker(r, 3, hub.address, 10.0) for r in (1, 2)]
    try:
        assert hub.wait_for_workers(timeout=10) == [1, 2]
        seen = {1: [], 2: []}
        servers = [threading.Thread(target=answer, args=(g, 3, seen[g.rank]), daemon=True)
                   for g in workers]
        for s in servers:
            s.start()
        pool = GroupPool(hub)

        def requests(tag: float) -> list:
            big = state_request()
            big["state"]["w"][-1] = tag
            small = {"op": "set_state", "state": {"w": np.full(4, tag + 0.5, np.float32)}}
            return [big, small, big]

        before = hub.bytes_out
        order = {rank: [] for rank in (1, 2)}
        for request in requests(7.0):
            for rank in (1, 2):
                order[rank].append(pool.send(rank, request, timeout=30.0))
        replies = [pool.receive() for _ in range(6)]
        assert all(r.ok for r in replies)
        # Read as a round's row reads them: right after the replies (a writer thread adds
        # its bytes as its write returns, which may be after the worker has answered: the
        # pool waits for it before handing the reply on).
        sent = hub.bytes_out - before
        for s in servers:
            s.join(10)
        pool.close()
        for rank in (1, 2):
            assert [seq for seq, _ in seen[rank]] == order[rank]
            assert [last for _, last in seen[rank]] == [7.0, 7.5, 7.0]
        # The same requests (and tickets) written one at a time count the same bytes.
        monkeypatch.setattr(_pool, "CONCURRENT_BYTES", 1 << 62)
        pool = GroupPool(hub)
        servers = [threading.Thread(target=answer, args=(g, 3, []), daemon=True)
                   for g in workers]
        for s in servers:
            s.start()
        before = hub.bytes_out
        for request in requests(7.0):
            for rank in (1, 2):
                pool.send(rank, request, timeout=30.0)
        for _ in range(6):
            assert pool.receive().ok
        assert not pool._writers
        assert hub.bytes_out - before == sent
        assert sent > 4 * BIG
        for s in servers:
            s.join(10)
    finally:
        for group in (*workers, hub):
            group.close()


def test_a_request_deadline_starts_when_its_write_is_done() -> None:
    """While its write is under way a request cannot expire; once written, its timeout runs."""
    owes = _pool._Outstanding()
    owes.push(5, 0.01, {"op": "set_state"})
    owes.writing = 5
    assert owes.deadline() == float("inf")
    start = time.monotonic()
    owes.written(5)
    assert owes.writing == 0
    assert start <= owes.deadline() - 0.01 <= time.monotonic()


def test_a_reply_is_handed_on_only_once_its_requests_bytes_are_counted() -> None:
    """The transport counts a write's bytes as the write returns; the worker may answer
    before the writer thread gets there. Here the writer is held after its write until the
    reply has arrived: ``receive`` must still return with the request's bytes counted (a
    round's ``bytes_down`` read right after its replies would otherwise miss them)."""
    hub = coordinator(2, timeout=10.0)
    one = worker(1, 2, hub.address, 10.0)
    replied = threading.Event()
    try:
        assert hub.wait_for_workers(timeout=10) == [1]
        sent = hub.links._sent
        held = []

        def sent_late(nbytes: int) -> None:
            if threading.current_thread().name.startswith("meshkit-pool-write-"):
                held.append(replied.wait(20))  # until the reply frame is in
            sent(nbytes)

        hub.links._sent = sent_late
        recv = hub.recv

        def recv_then_mark(*args, **kwargs):
            frame = recv(*args, **kwargs)
            replied.set()
            return frame

        hub.recv = recv_then_mark
        server = threading.Thread(target=answer, args=(one, 1, []), daemon=True)
        server.start()
        pool = GroupPool(hub)
        before = hub.bytes_out
        seq = pool.send(1, state_request(), timeout=30.0)
        reply = pool.receive()
        counted = hub.bytes_out - before
        assert reply.seq == seq and reply.ok, reply
        assert held == [True]  # the writer was held until the reply was in
        assert counted > BIG
        server.join(10)
        pool.close()
    finally:
        replied.set()
        for group in (one, hub):
            group.close()
