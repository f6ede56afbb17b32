"""The discovery responder survives oversized tables and hostile datagrams."""

from __future__ import annotations

import socket


from meshkit import wire
from meshkit.transport.discovery import DiscoveryServer, discover

SECRET = b"review-r1-secret-0123456789"


def test_a_discovery_table_too_big_for_one_datagram_still_answers_star_workers() -> None:
    # The answer to a hello carried every known rank; past ~2,700 ranks it no
    # longer fit in a UDP datagram, sealing it raised inside the responder's
    # thread, and discovery died for every rank still to come.
    world = 5000
    with DiscoveryServer(SECRET, world, data_port=4000, host="127.0.0.1", port=0) as server:
        with server._cv:  # as if 3,000 workers had already said hello
            for rank in range(1, 3001):
                server._table[rank] = ("127.0.0.1", 4000 + rank, f"{rank:032x}")
        for rank in (3001, 3002):
            found = discover(SECRET, rank=rank, world=world, data_port=4000 + rank,
                             disc_port=server.port, via="127.0.0.1", timeout=3.0)
            assert found.peers[0] == "127.0.0.1:4000"


def test_a_deeply_nested_discovery_datagram_is_ignored_not_fatal_to_the_responder() -> None:
    # json.loads raises RecursionError (not ValueError) on deep nesting; it
    # escaped the responder's thread and discovery stopped answering anyone.
    with DiscoveryServer(SECRET, 2, data_port=4000, host="127.0.0.1", port=0) as server:
        deep = wire.seal_datagram(SECRET, b"[" * 20_000 + b"]" * 20_000)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.sendto(deep, ("127.0.0.1", server.port))
        found = discover(SECRET, rank=1, world=2, data_port=4001, disc_port=server.port,
                         via="127.0.0.1", timeout=3.0)
        assert found.peers[0] == "127.0.0.1:4000"
        assert server.ignored == 1
