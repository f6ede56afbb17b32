"""The transport contract suite.

Subclass :class:`TransportContract` and point it at your transport::

    class TestMyWire(TransportContract):
        component = "mywire"
        options = {}

Each test forms a real star of ``world_size`` ranks (the coordinator binds
:meth:`coordinator_address`, workers dial the address it reports), with every
rank a thread of the test process, and closes it afterwards. Override
:meth:`coordinator_address` (and :meth:`node_config`) if your transport
addresses ranks differently.

What it checks: ranks and world size; a state crosses exactly (arrays bit for
bit, dtypes kept, JSON values equal); frames are matched by tag and arrive in
order within a tag; the coordinator can take the next frame from any rank;
workers reach each other through the coordinator; a large frame arrives
intact; a peer that vanishes is a :class:`meshkit.PeerLostError` naming it,
never a hang; the coordinator goes on hearing the survivors when a rank is
gone; a connection without a secret is refused.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable, ClassVar, Iterator

import numpy as np
import pytest

from meshkit.errors import MeshError, PeerLostError
from meshkit.node.config import NodeConfig
from meshkit.testing.support import (Call, ContractBase, assert_states_identical, bfloat16,
                                     model_states)
from meshkit.transport import ANY

__all__ = ["TransportContract"]

_hub_counter = itertools.count()

#: Why a call the contract runs on a thread must come back.
_BOUNDED = "a blocking call must honour its timeout"


class TransportContract(ContractBase):
    """Conformance tests every meshkit transport must pass."""

    kind: ClassVar[str] = "transport"

    #: Ranks in the star each test forms (the coordinator plus workers).
    world_size: ClassVar[int] = 3
    #: Seconds every blocking call may take (NodeConfig.timeout).
    timeout: ClassVar[float] = 5.0
    #: Bytes of the large frame test (float32 elements x 4).
    large_frame_bytes: ClassVar[int] = 16 << 20
    #: The shared secret the test star uses.
    secret: ClassVar[bytes] = b"meshkit-transport-contract-secret"

    # -- forming a star ------------------------------------------------------

    def coordinator_address(self) -> str:
        """Where rank 0 listens: port 0 on loopback (``inproc://...`` for in-process)."""
        if self.component == "inproc":
            return f"inproc://contract-{next(_hub_counter)}-{id(self):x}"
        return "127.0.0.1:0"

    def node_config(self, rank: int, world: int, address: str, *,
                    secret: bytes | None = None) -> Any:
        return NodeConfig(rank=rank, world=world, peers=(address,), topology="star",
                          transport=self.component or "", timeout=self.timeout,
                          secret=self.secret if secret is None else secret)

    def connect_star(self, world: int | None = None) -> list[Any]:
        """Groups for ranks ``0..world-1``, connected; the caller closes them."""
        world = world or self.world_size
        transport = self.make()
        coordinator = transport.connect(self.node_config(0, world, self.coordinator_address()))
        groups = [coordinator]
        try:
            address = coordinator.address

            def connect(rank: int) -> Any:
                return transport.connect(self.node_config(rank, world, address))

            calls = [Call(functools.partial(connect, r), f"connect rank {r}", why=_BOUNDED)
                     for r in range(1, world)]
            groups += [c.result(self.timeout * 2) for c in calls]
            joined = coordinator.wait_for_workers(self.timeout)
            assert sorted(joined) == list(range(1, world)), (
                f"wait_for_workers() returned {joined}, expected ranks 1..{world - 1}")
        except BaseException:
            for g in groups:
                g.close()
            raise
        return groups

    @pytest.fixture
    def star(self) -> Iterator[list[Any]]:
        groups = self.connect_star()
        yield groups
        for g in groups:
            g.close()

    def later(self, fn: Callable[[], Any], name: str = "rank call") -> Call:
        return Call(fn, name, why=_BOUNDED)

    # -- tests ---------------------------------------------------------------

    def test_ranks_and_world_size(self, star: list[Any]) -> None:
        for rank, group in enumerate(star):
            assert group.rank == rank, f"group {rank} reports rank {group.rank}"
            assert group.world_size == self.world_size

    def test_a_state_crosses_exactly(self, star: list[Any]) -> None:
        rng = np.random.default_rng(0)
        state: dict[str, Any] = {
            "w": rng.standard_normal((3, 5)).astype(np.float32),
            "d": rng.standard_normal(4),
            "h": rng.standard_normal(6).astype(np.float16),
            "i": np.arange(7, dtype=np.int64),
            "mask": np.array([True, False, True]),
            "scalar": np.array(2.5, dtype=np.float32),
            "empty": np.zeros((0, 3), np.float32),
            "meta": {"lr": 0.1, "name": "net", "steps": [1, 2, 3], "none": None, "ok": True},
        }
        if bfloat16 is not None:
            state["bf"] = rng.standard_normal(5).astype(bfloat16)
        star[1].send(0, 11, state)
        assert_states_identical(star[0].recv(1, 11), state, what="worker -> coordinator")
        star[0].send(2, 12, state)
        assert_states_identical(star[2].recv(0, 12), state, what="coordinator -> worker")

    def test_a_real_models_state_crosses_exactly(self, star: list[Any]) -> None:
        """BatchNorm-shaped state, 0-d counts and an int64 buffer (``model_states``; its
        numpy scalar as the 0-d array an aggregator must return, since the wire carries
        arrays) cross bit for bit with their shapes and dtypes."""
        (state,) = model_states(1, seed=2)
        state = {k: np.asarray(v) for k, v in state.items()}
        star[1].send(0, 14, state)
        assert_states_identical(star[0].recv(1, 14), state, what="worker -> coordinator")
        star[0].send(2, 15, state)
        assert_states_identical(star[2].recv(0, 15), state, what="coordinator -> worker")

    def test_the_sender_may_reuse_its_arrays_after_send(self, star: list[Any]) -> None:
        x = np.arange(8, dtype=np.float32)
        star[1].send(0, 13, {"x": x})
        x[:] = -1
        got = star[0].recv(1, 13)
        assert np.array_equal(got["x"], np.arange(8, dtype=np.float32)), (
            "the payload changed after send() returned: send must copy it onto the wire")

    def test_frames_are_matched_by_tag_and_ordered_within_a_tag(self, star: list[Any]) -> None:
        worker, coordinator = star[1], star[0]
        for i in range(3):
            worker.send(0, 7, {"seq": i, "tag": 7})
            worker.send(0, 8, {"seq": i, "tag": 8})
        got8 = [coordinator.recv(1, 8) for _ in range(3)]
        got7 = [coordinator.recv(1, 7) for _ in range(3)]
        assert [(m["tag"], m["seq"]) for m in got8] == [(8, 0), (8, 1), (8, 2)], got8
        assert [(m["tag"], m["seq"]) for m in got7] == [(7, 0), (7, 1), (7, 2)], got7

    def test_the_coordinator_takes_the_next_frame_from_any_rank(self, star: list[Any]) -> None:
        for rank in range(1, self.world_size):
            star[rank].send(0, 21, {"from": rank})
        seen = {}
        for _ in range(1, self.world_size):
            src, state = star[0].recv(ANY, 21)
            seen[src] = state["from"]
        assert seen == {r: r for r in range(1, self.world_size)}, seen

    def test_workers_reach_each_other(self, star: list[Any]) -> None:
        if self.world_size < 3:
            pytest.skip("needs two workers")
        star[1].send(2, 31, {"hello": "from 1"})
        assert star[2].recv(1, 31) == {"hello": "from 1"}

    def test_a_large_frame_arrives_intact(self, star: list[Any]) -> None:
        n = self.large_frame_bytes // 4
        big = np.random.default_rng(1).standard_normal(n).astype(np.float32)
        pending = self.later(lambda: star[0].recv(1, 41, timeout=self.timeout * 4), "recv big")
        star[1].send(0, 41, {"big": big})
        got = pending.result(self.timeout * 6)
        assert got["big"].dtype == np.float32 and got["big"].shape == big.shape
        intact = got["big"].tobytes() == big.tobytes()  # no pytest diff of 4 MiB reprs
        assert intact, "a large frame arrived corrupted"

    def test_a_peer_that_vanishes_is_reported_not_waited_for(self, star: list[Any]) -> None:
        gone = self.world_size - 1
        star[gone].close()
        pending = self.later(lambda: star[0].recv(gone, 51), f"recv from rank {gone}")
        with pytest.raises(PeerLostError) as info:
            pending.result(self.timeout * 3)
        assert str(gone) in str(info.value), (
            f"the error should name the lost rank {gone}: {info.value}")

    def test_frames_sent_before_a_peer_vanished_are_still_delivered(self,
                                                                    star: list[Any]) -> None:
        star[1].send(0, 52, {"last": "words"})
        star[1].close()
        assert star[0].recv(1, 52) == {"last": "words"}
        with pytest.raises(PeerLostError):
            self.later(lambda: star[0].recv(1, 52), "recv after loss").result(self.timeout * 3)

    def test_a_worker_sees_a_lost_coordinator(self, star: list[Any]) -> None:
        star[0].close()
        pending = self.later(lambda: star[1].recv(0, 53), "recv from a closed coordinator")
        with pytest.raises(PeerLostError):
            pending.result(self.timeout * 3)

    def test_a_silent_peer_times_out(self, star: list[Any]) -> None:
        pending = self.later(lambda: star[1].recv(0, 54, timeout=0.2), "recv with timeout")
        with pytest.raises(PeerLostError):
            pending.result(self.timeout * 3)

    def test_the_coordinator_hears_every_survivor_when_a_rank_is_gone(self) -> None:
        world = max(self.world_size, 3) + 1
        groups = self.connect_star(world)
        try:
            gone = world - 1
            groups[gone].close()
            for rank in range(1, gone):
                groups[rank].send(0, 55, {"w": np.full(4, float(rank), np.float32)})
            heard = dict(self.later(lambda: groups[0].recv(ANY, 55), "recv(ANY) of a survivor")
                         .result(self.timeout * 3) for _ in range(1, gone))
            lost = self.later(lambda: groups[0].recv(gone, 55), f"recv from rank {gone}")
            with pytest.raises(PeerLostError):
                lost.result(self.timeout * 3)
            ledger = groups[0].dead
        finally:
            for g in groups:
                g.close()
        assert sorted(heard) == list(range(1, gone)), sorted(heard)
        for rank, state in heard.items():
            assert_states_identical(state, {"w": np.full(4, float(rank), np.float32)},
                                    what=f"rank {rank}'s state")
        assert gone in ledger, f"rank {gone} closed but is not in the dead ledger {ledger}"

    def test_connecting_without_a_secret_is_refused(self) -> None:
        transport = self.make()
        config = self.node_config(0, 2, self.coordinator_address(), secret=b"")
        with pytest.raises(MeshError) as info:
            group = transport.connect(config)
            group.close()
        assert "secret" in str(info.value).lower(), (
            f"the refusal should say a secret is missing: {info.value}")
