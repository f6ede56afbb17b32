"""The Group API over the in-process transport: routing, mailboxes, refusals, timeouts, ledger."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from meshkit import AuthenticationError, ConfigError, PeerLostError, WireError, plugins
from meshkit.node.config import NodeConfig
from meshkit.transport import ANY, RESERVED_TAGS, TAG_REDUCE, TAG_SCATTER, Message
from meshkit_tcp import inproc
from meshkit_tcp.testing import inproc_configs, run_ranks


def test_star_workers_reach_each_other_through_the_coordinator() -> None:
    configs = inproc_configs(4)
    coordinator = configs[0].connect()
    try:
        def worker(group):
            group.recv(0, 1)  # start once every worker joined: relays need both ends
            if group.rank == 1:
                group.send(2, 7, {"x": np.arange(3), "note": "from 1"})
                return None
            if group.rank == 2:
                return group.recv(1, 7)
            group.send(0, 9, {"hello": 3})
            return None

        ranks = run_ranks(configs[1:], worker)
        for rank in coordinator.wait_for_workers(timeout=5):
            coordinator.send(rank, 1, {})
        src, state = coordinator.recv(ANY, 9)
        results = ranks.join()
    finally:
        coordinator.close()
    assert (src, state) == (3, {"hello": 3})
    assert results[2]["note"] == "from 1"
    np.testing.assert_array_equal(results[2]["x"], np.arange(3))


def test_a_full_mesh_of_four_ranks_sends_directly() -> None:
    configs = inproc_configs(4, topology="mesh")
    barrier = threading.Barrier(4)

    def rank(group):
        for dst in range(4):
            if dst != group.rank:
                group.send(dst, 1, {"from": group.rank})
        got = sorted(group.recv(src, 1)["from"] for src in range(4) if src != group.rank)
        barrier.wait(5)
        return got

    results = run_ranks(configs, rank).join()
    assert results == {r: [s for s in range(4) if s != r] for r in range(4)}


def test_the_receiver_gets_a_copy_not_the_senders_array() -> None:
    configs = inproc_configs(2)
    coordinator = configs[0].connect()
    try:
        array = np.zeros(3)

        def worker(group):
            group.send(0, 1, {"a": array})
            array[:] = 5.0  # after send returned: must not leak into the receiver

        run_ranks(configs[1:], worker).join()
        received = coordinator.recv(1, 1)["a"]
    finally:
        coordinator.close()
    np.testing.assert_array_equal(received, np.zeros(3))


def test_a_worker_with_the_wrong_secret_is_refused() -> None:
    configs = inproc_configs(3)
    coordinator = configs[0].connect()
    try:
        bad = NodeConfig(rank=1, world=3, peers=configs[0].peers, transport="inproc",
                         secret=b"not-the-secret-0123", timeout=2)
        with pytest.raises(AuthenticationError, match="wrong secret"):
            bad.connect()
    finally:
        coordinator.close()


def test_a_transport_refuses_to_connect_without_a_secret() -> None:
    config = NodeConfig(rank=0, world=2, peers=["inproc://no-secret"], transport="inproc")
    with pytest.raises(ConfigError, match="no secret"):
        config.connect()


def test_world_mismatch_and_duplicate_rank_name_what_differed() -> None:
    configs = inproc_configs(3)
    coordinator = configs[0].connect()
    try:
        wrong_world = NodeConfig(rank=1, world=4, peers=configs[0].peers, transport="inproc",
                                 secret=configs[0].secret, timeout=2)
        with pytest.raises(WireError, match="world of 4.*has 3"):
            wrong_world.connect()
        first = configs[1].connect()
        try:
            with pytest.raises(WireError, match="rank 1 is already connected.*duplicate rank"):
                configs[1].connect()
            assert coordinator.live_ranks == [1]
        finally:
            first.close()
    finally:
        coordinator.close()


def test_reserved_tags_and_bad_payloads_are_refused() -> None:
    configs = inproc_configs(2)
    coordinator = configs[0].connect()
    worker = configs[1].connect()
    try:
        with pytest.raises(ValueError, match="retired protocol"):
            worker.send(0, TAG_REDUCE, {})
        with pytest.raises(ValueError, match="retired protocol"):
            coordinator.send(1, TAG_SCATTER, {})
        with pytest.raises(ValueError, match="a tag must be an int"):
            worker.send(0, -1, {})
        with pytest.raises(WireError, match="mapping"):
            worker.send(0, 1, [1, 2])  # type: ignore[arg-type]
        with pytest.raises(WireError, match="reserved"):
            worker.send(0, 1, {"__meshkit__": 1})
        with pytest.raises(ValueError, match="only available on the coordinator"):
            worker.recv(ANY, 1)
        assert RESERVED_TAGS == 0xFFFF0000
    finally:
        worker.close()
        coordinator.close()


def test_recv_times_out_with_a_message_naming_the_peer() -> None:
    configs = inproc_configs(2, timeout=0.2)
    coordinator = configs[0].connect()
    worker = configs[1].connect()
    try:
        with pytest.raises(PeerLostError, match="waiting for a message with tag 0x5 from rank 1: nothing arrived within"):
            coordinator.recv(1, 5)
    finally:
        worker.close()
        coordinator.close()


def test_a_closed_worker_is_in_the_dead_ledger_and_recv_from_it_fails() -> None:
    configs = inproc_configs(3)
    coordinator = configs[0].connect()
    try:
        one = configs[1].connect()
        two = configs[2].connect()
        assert coordinator.wait_for_workers(timeout=2) == [1, 2]
        one.send(0, 3, {"last": True})
        one.close()
        # A frame completed before the rank left is still delivered ...
        assert coordinator.recv(1, 3) == {"last": True}
        # ... then the loss is reported, not a hang.
        with pytest.raises(PeerLostError, match="rank 1 is dead: closed its connection"):
            coordinator.recv(1, 3)
        assert 1 in coordinator.dead and coordinator.live_ranks == [2]
        with pytest.raises(WireError, match="declared dead"):
            configs[1].connect()
        two.close()
    finally:
        coordinator.close()


def test_a_worker_sees_the_coordinator_leave() -> None:
    configs = inproc_configs(2)
    coordinator = configs[0].connect()
    worker = configs[1].connect()
    try:
        coordinator.close()
        with pytest.raises(PeerLostError, match="coordinator|rank 0"):
            worker.recv(0, 1)
        with pytest.raises(PeerLostError):
            worker.send(0, 1, {})
    finally:
        worker.close()


def test_wait_for_workers_names_the_missing_ranks() -> None:
    configs = inproc_configs(3)
    coordinator = configs[0].connect()
    one = configs[1].connect()
    try:
        with pytest.raises(PeerLostError, match=r"rank\(s\) \[2\] never joined"):
            coordinator.wait_for_workers(timeout=0.1)
    finally:
        one.close()
        coordinator.close()


def test_the_transport_is_selected_by_name_through_the_plugin_registry() -> None:
    assert {"tcp", "inproc"} <= set(plugins.available("transport"))
    configs = inproc_configs(1)
    group = configs[0].connect()
    try:
        assert (group.rank, group.world_size, group.is_coordinator) == (0, 1, True)
        assert group.address.startswith("inproc://")
    finally:
        group.close()


def test_a_hub_is_forgotten_once_every_rank_left() -> None:
    configs = inproc_configs(2)
    hub = configs[0].peers[0]
    groups = [c.connect() for c in configs]
    assert hub in inproc._hubs
    for group in groups:
        group.close()
    assert hub not in inproc._hubs


def test_a_message_for_a_worker_that_has_not_joined_yet_waits_for_it() -> None:
    configs = inproc_configs(3)
    coordinator = configs[0].connect()
    early = configs[1].connect()
    try:
        early.send(2, 4, {"hello": "from 1"})  # rank 2 is not there yet
        late = configs[2].connect()
        try:
            assert late.recv(1, 4, timeout=5) == {"hello": "from 1"}
        finally:
            late.close()
    finally:
        early.close()
        coordinator.close()


def test_messages_held_for_a_rank_that_never_joins_are_freed_when_it_is_declared_dead():
    configs = inproc_configs(4)
    coordinator = configs[0].connect()
    worker = configs[1].connect()
    try:
        worker.send(3, 7, {"x": np.zeros(4)})  # rank 3 has not joined: held by the relay
        ledger = coordinator._ledger
        with ledger.cv:
            assert ledger.cv.wait_for(lambda: 3 in ledger._held, 5)
        coordinator.declare_dead(3, "never joined")
        assert 3 not in ledger._held
    finally:
        worker.close()
        coordinator.close()


@pytest.mark.parametrize("payload", [{"": 1}, {"t": (1, 2)}, {"d": {"x": [1, (2,)]}}])
@pytest.mark.parametrize("transport", ["inproc", "tcp"])
def test_both_transports_refuse_what_json_would_change(transport, payload):
    if transport == "inproc":
        configs = inproc_configs(2)
    else:
        coordinator_config = NodeConfig(rank=0, world=2, topology="star", bind="127.0.0.1:0",
                                        secret=b"test-secret-0123456", timeout=5)
        configs = [coordinator_config]
    coordinator = configs[0].connect()
    if transport == "tcp":
        configs.append(NodeConfig(rank=1, world=2, topology="star",
                                  peers=[coordinator.address], secret=b"test-secret-0123456", timeout=5))
    worker = configs[1].connect()
    try:
        assert coordinator.wait_for_workers(timeout=5) == [1]
        with pytest.raises(WireError):
            worker.send(0, 7, payload)
        worker.send(0, 7, {"ok": [1, 2]})  # the link still works
        assert coordinator.recv(1, 7, timeout=5) == {"ok": [1, 2]}
    finally:
        worker.close()
        coordinator.close()


def test_a_diverted_tag_goes_to_its_handler_in_order_and_back_to_recv_when_declined() -> None:
    configs = inproc_configs(2)
    coordinator = configs[0].connect()
    worker = configs[1].connect()
    try:
        coordinator.wait_for_workers(timeout=5)
        coordinator.send(1, 5, {"n": 0})
        taken: list[int] = []
        declined = threading.Event()

        def handler(payload):
            if payload["n"] >= 3:
                declined.set()
                return False  # and every later one: recv gets them, in order
            taken.append(payload["n"])
            return True

        # What was queued before the divert is handed back first, oldest first.
        assert worker.divert(0, 5, handler) == [{"n": 0}]
        assert not worker.inline_delivery  # inproc delivers on the sender's thread
        for n in range(1, 5):
            coordinator.send(1, 5, {"n": n})
        coordinator.send(1, 6, {"other": True})  # another tag is not diverted
        assert declined.wait(5)
        assert taken == [1, 2]
        assert [worker.recv(0, 5, timeout=5)["n"] for _ in range(2)] == [3, 4]
        assert worker.recv(0, 6, timeout=5) == {"other": True}
        with pytest.raises(ValueError, match="already diverted"):
            worker.divert(0, 5, handler)
        worker.undivert(0, 5, handler)
        coordinator.send(1, 5, {"n": 1})
        assert worker.recv(0, 5, timeout=5) == {"n": 1} and taken == [1, 2]
    finally:
        worker.close()
        coordinator.close()


def test_a_frame_on_a_retired_tag_is_dropped_not_queued() -> None:
    # An older peer still speaking the star reduce service (removed in issue 21).
    configs = inproc_configs(2)
    coordinator = configs[0].connect()
    worker = configs[1].connect()
    try:
        worker._send_message(Message(1, 0, TAG_REDUCE, {"w": np.ones(2)}))
        worker.send(0, 7, {"after": True})
        assert coordinator.recv(1, 7) == {"after": True}  # delivered in order, after it
        with pytest.raises(PeerLostError):
            coordinator.recv(1, TAG_REDUCE, timeout=0.05)
    finally:
        worker.close()
        coordinator.close()
