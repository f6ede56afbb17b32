"""The mesh all-reduce (Group.mesh_all_reduce): a weighted ring over direct links, no coordinator fold."""

from __future__ import annotations

import logging

import threading

import attrs
import numpy as np
import pytest

from meshkit import AggregationError, MeshError, PeerLostError
from meshkit.node.config import NodeConfig
from meshkit.transport import _collective
from meshkit.transport._collective import pack, unpack
from meshkit.transport.tags import TAG_RING
from meshkit_tcp.testing import inproc_configs, run_ranks

from meshkit.train import free_ports
SECRET = b"collective-test-secret"



def tcp_mesh(world: int, timeout: float = 5.0, **settings) -> list[NodeConfig]:
    peers = [f"127.0.0.1:{p}" for p in free_ports(world)]
    return [NodeConfig(rank=r, world=world, peers=peers, topology="mesh", secret=SECRET,
                       timeout=timeout, **settings) for r in range(world)]


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


# -- segments received straight into place (tcp mesh) ---------------------------------

def big_contribution(rank: int) -> dict:
    # Odd sizes: chunks and segments of unequal, unaligned lengths, all above _LAND_MIN.
    rng = np.random.default_rng(10 + rank)
    return {"w": rng.standard_normal(250_007).astype(np.float32),
            "b": rng.standard_normal(30_011)}  # float64: a buffer of its own


@pytest.fixture
def landings(monkeypatch):
    """Small segments (100003 bytes, so several per chunk) and a record of those that landed."""
    monkeypatch.setattr(_collective, "SEGMENT_BYTES", 100_003)
    hits: list[tuple[str, int]] = []
    real = _collective._Landing.place

    def place(self, head):
        got = real(self, head)
        if got is not None:
            hits.append((got[1]["phase"], got[0].size))
        return got

    monkeypatch.setattr(_collective._Landing, "place", place)
    return hits


@pytest.mark.parametrize("encrypt", [False, True], ids=["auth", "encrypted"])
def test_segments_of_odd_sizes_land_in_place_and_give_the_weighted_mean(landings, encrypt):
    world = 3
    weights = [1.0, 2.5, 1.0]  # both ways to add a share: the state itself, and scaled
    registered = threading.Barrier(world)

    def body(group):
        # A segment that arrives before its rank has named it is received as
        # usual (and copied): every rank names its segments before any sends.
        register = group._links.receive_into

        def receive_into(peer, tag, placer):
            remove = register(peer, tag, placer)
            registered.wait(5)
            return remove

        group._links.receive_into = receive_into
        return group.mesh_all_reduce(big_contribution(group.rank), weight=weights[group.rank])

    results = run_ranks(tcp_mesh(world, encrypt=encrypt), body).join()
    states = [big_contribution(r) for r in range(world)]
    for key in states[0]:
        want = sum(w * s[key].astype(np.float64) for s, w in zip(states, weights)) / sum(weights)
        for rank in range(world):
            np.testing.assert_allclose(results[rank][key], want, rtol=1e-5, atol=1e-6)
            assert results[rank][key].tobytes() == results[0][key].tobytes()
    # Every segment landed, in both phases, on every rank: each rank takes n - 1
    # chunks in the reduce-scatter and n - 1 in the all-gather.
    buffers = [np.empty(250_008, np.float32), np.empty(30_011)]  # the weight's slot in the first
    plan = _collective.segments(buffers, world, 100_003)
    assert all((hi - lo) * buffers[b].itemsize >= _collective._LAND_MIN
               for chunk in plan for b, lo, hi in chunk)
    assert len(landings) == 2 * (world - 1) * sum(len(chunk) for chunk in plan), landings
    assert {phase for phase, _ in landings} == {"reduce", "gather"}


def tamper_first_segment(group, dst: int, how) -> list[int]:
    """Make ``group``'s first ring segment to ``dst`` travel altered by ``how``; returns a log."""
    done: list[int] = []
    real = group.links.transmit

    def transmit(peer, message, timeout):
        x = message.payload.get("x") if message.tag == TAG_RING else None
        if peer == dst and x is not None and x.size > 1000 and not done:
            done.append(message.payload["k"])
            return how(real, peer, message, timeout)
        return real(peer, message, timeout)

    group.links.transmit = transmit
    return done


def errors_with_first_segment_altered(how) -> dict[int, BaseException]:
    """Every rank's error from a world-3 all-reduce whose rank 1 alters its first segment to 2."""
    configs = tcp_mesh(3, timeout=5.0, encrypt=False)

    def body(group):
        if group.rank == 1:
            tamper_first_segment(group, 2, how)
        return group.mesh_all_reduce(big_contribution(group.rank), timeout=5)

    ranks = run_ranks(configs, body)
    ranks.join(30, raise_errors=False)
    return ranks.errors


def test_a_tampered_segment_body_is_refused_on_every_rank(landings, caplog):
    def corrupt(real, peer, message, timeout):
        # Flip a bit of the body after its tag is computed: what a network attacker can do.
        channel = real.__self__._channels[peer]
        send_all = channel._send_all

        def flipped(view, deadline=None):
            if view.nbytes > 10_000 and not hasattr(flipped, "once"):
                flipped.once = True
                view = memoryview(bytearray(view))
                view[view.nbytes // 2] ^= 0x10
            return send_all(view, deadline)

        channel._send_all = flipped
        try:
            return real(peer, message, timeout)
        finally:
            del channel._send_all

    caplog.set_level(logging.WARNING)
    errors = errors_with_first_segment_altered(corrupt)
    # Nobody returns a mean: the segment landed, failed its tag, and the collective failed.
    assert sorted(errors) == [0, 1, 2], errors
    for error in errors.values():
        assert isinstance(error, MeshError), error
    # Rank 2 refused the segment for its tag. Its own error may instead be the
    # abort another rank sent once it heard of the drop (which arrives first is
    # scheduling), so the refusal is read where rank 2 records it, and in its
    # error when that came first.
    refused = [r.getMessage() for r in caplog.records
               if "failed authentication" in r.getMessage() and "rank 2" in r.getMessage()]
    assert refused or "failed authentication" in str(errors[2]), (errors[2], caplog.text)


def test_a_segment_of_the_wrong_length_is_refused_naming_the_peer(landings):
    def shorten(real, peer, message, timeout):
        payload = dict(message.payload)
        payload["x"] = payload["x"][:-1]
        return real(peer, attrs.evolve(message, payload=payload), timeout)

    errors = errors_with_first_segment_altered(shorten)
    assert sorted(errors) == [0, 1, 2], errors
    assert isinstance(errors[2], AggregationError), errors
    assert "rank 1 sent float32" in str(errors[2]), errors[2]
    # The others fail too: with rank 2's abort, or -- whichever reaches them
    # first -- with rank 2 leaving the mesh after it refused the segment.
    for error in errors.values():
        assert isinstance(error, (AggregationError, PeerLostError)), error


def test_the_layout_digest_is_the_documented_bytes_and_hash():
    """docs/protocol.md §5.1's worked example, computed here from the bytes it lists."""
    import hashlib
    import re
    from pathlib import Path

    import ml_dtypes

    from meshkit.transport._collective import layout_bytes, layout_digest, pack

    text = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
    example = text[text.index("Worked example"):]
    documented = bytes.fromhex("".join(example.split("```")[1].split()))
    check = int(re.search(r"to the check `(\d+)`", example).group(1))
    entries = [("w", (2, 3), np.dtype(np.float32)), ("b", (3,), np.dtype(ml_dtypes.bfloat16))]
    assert layout_bytes(entries, [1, 2]) == documented
    # Any language can compute it: BLAKE2b-64 of those bytes, little-endian, >> 1.
    assert int.from_bytes(hashlib.blake2b(documented, digest_size=8).digest(),
                          "little") >> 1 == check == layout_digest(entries, [1, 2])
    # And it is what the ring sends: pack's check for that state.
    state = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, ml_dtypes.bfloat16)}
    assert pack(state, 1.0, [1, 2])[0].check == check
    assert pack(state, 1.0, [1, 3])[0].check != check


def test_a_ring_frame_without_an_array_is_a_protocol_error_not_a_crash():
    from meshkit import ProtocolError
    from meshkit.transport._collective import ring_sum

    layout, buffers = pack({"w": np.ones(8, np.float32)}, 1.0, [1, 2])
    sent = []
    frame = {"r": 1, "check": layout.check, "c": 1, "phase": "reduce", "k": 0, "x": "junk"}
    with pytest.raises(ProtocolError, match="without an array"):
        ring_sum(buffers, [1, 2], 1, layout.check, 1, lambda dst, p: sent.append(dst),
                 lambda: (2, frame))
    assert sent == [2], "its own chunk went out first"


def scripted_ring(frames_for_rank_1):
    """Rank 1 of a 2-rank ring whose peer's frames are ``frames_for_rank_1`` in turn."""
    from meshkit.transport._collective import ring_sum

    layout, buffers = pack({"w": np.full(8, 1.0, np.float32)}, 1.0, [1, 2])
    frames = iter(frames_for_rank_1)
    ring_sum(buffers, [1, 2], 1, layout.check, 5, lambda dst, p: None,
             lambda: (2, next(frames)))
    return layout, buffers


def test_a_late_segment_of_an_earlier_round_is_dropped_not_summed():
    # Rank 1 of [1, 2] adds chunk 1 (elements 4..8, the weight's slot last) in the
    # reduce and takes chunk 0 in the gather. A segment of round 4 with the very fields
    # round 5 expects arrives first: summed, chunk 1 would hold 1 + 100 instead of 1 + 2.
    check = pack({"w": np.ones(8, np.float32)}, 1.0, [1, 2])[0].check
    late = {"r": 4, "check": check, "c": 1, "phase": "reduce", "k": 0,
            "x": np.full(5, 100.0, np.float32)}
    mine = {"r": 5, "check": check, "c": 1, "phase": "reduce", "k": 0,
            "x": np.full(5, 2.0, np.float32)}
    gather = {"r": 5, "check": check, "c": 0, "phase": "gather", "k": 0,
              "x": np.full(4, 3.0, np.float32)}
    _, buffers = scripted_ring([late, mine, gather])
    assert buffers[0].tolist() == [3.0] * 9  # 1 + 2 everywhere: the late 100 is nowhere


def test_a_segment_of_a_later_round_from_the_previous_rank_is_refused_naming_both():
    check = pack({"w": np.ones(8, np.float32)}, 1.0, [1, 2])[0].check
    ahead = {"r": 6, "check": check, "c": 1, "phase": "reduce", "k": 0,
             "x": np.full(5, 2.0, np.float32)}
    with pytest.raises(MeshError, match="got a segment of round 6 from rank 2"):
        scripted_ring([ahead])


@pytest.mark.parametrize("world", [2, 4])
def test_the_exact_sum_adds_integer_codes_in_their_own_dtype_and_max_takes_the_largest(world):
    size = 40_000

    def codes(rank):
        return {"a": np.random.default_rng(rank).integers(-127, 128, (size,), dtype=np.int16),
                "b": np.full((3, 2), rank - 1, np.int16)}

    def body(g):
        before = g.bytes_out
        summed = g.mesh_sum(codes(g.rank), ranks=range(world), step=7)
        sent = g.bytes_out - before
        top = g.mesh_sum({"s": np.array([g.rank, -g.rank], np.float32)},
                         ranks=range(world), step=8, op="max")
        return summed, sent, top

    results = run_ranks(tcp_mesh(world), body).join()
    want = {k: sum(codes(r)[k].astype(np.int64) for r in range(world)) for k in ("a", "b")}
    for summed, sent, top in results.values():
        for key, value in want.items():
            assert summed[key].dtype == np.int16
            assert summed[key].tolist() == value.tolist()
        assert top["s"].tolist() == [world - 1, 0]
        # Measured on the transport: 2 (n - 1) / n of the int16 buffer, plus frame heads.
        payload = 2 * (world - 1) / world * (size + 6) * 2
        assert payload <= sent <= payload * 1.05 + 2_000


def test_an_exact_sum_over_layouts_that_differ_is_refused_on_every_rank():
    def body(g):
        dtype = np.int16 if g.rank == 0 else np.int32
        return g.mesh_sum({"a": np.ones(10, dtype)}, ranks=[0, 1], step=1)

    ranks = run_ranks(tcp_mesh(2), body)
    ranks.join(30, raise_errors=False)
    assert sorted(ranks.errors) == [0, 1], ranks.errors
    assert any(isinstance(e, AggregationError) and "layout" in str(e)
               for e in ranks.errors.values()), ranks.errors


def test_a_segment_landed_in_place_is_its_bodys_own_last_buffer() -> None:
    """The ring lands a segment by the bytes before its data (``_Landing``): that needs
    the segment to travel as its own buffer, which the codec gives only to arrays of
    ``OWN_BUFFER_BYTES`` or more. A codec threshold raised past ``_LAND_MIN`` would
    silently turn landing off for the segments in between."""
    from meshkit.transport import _collective
    from meshkit.wire import _codec

    assert _collective._LAND_MIN >= _codec.OWN_BUFFER_BYTES
    segment = np.zeros(_collective._LAND_MIN // 4, dtype=np.float32)
    encoded = _codec.encode_state(_collective._segment(1, 2, 0, "reduce", 0, segment))
    assert memoryview(encoded.buffers[-1]).nbytes == segment.nbytes
