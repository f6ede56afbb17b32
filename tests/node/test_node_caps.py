"""NodeCaps: what a node advertises, how it reads from the wire, and the handshake."""

from __future__ import annotations

import threading

import pytest

import meshkit
from meshkit import FixedFunction, NodeCaps, NodeConfig, PlacementError
from meshkit.errors import ConfigError, PeerLostError, WireError
from meshkit.node import TAG_CAPS, caps_for, collect_caps, local_caps, send_caps
from meshkit.pipeline import Stage

FF = FixedFunction("enc0", 16, 8)


def test_a_stage_without_a_stage_id_is_refused_with_a_hint_to_set_one():
    caps = local_caps(3, fixed_function=FF)
    with pytest.raises(PlacementError) as err:
        caps.check(Stage(op="identity"))
    assert "rank 3: fixed-function rank implements stage [enc0]" in str(err.value)
    assert "carries no stage_id: set stage_id on the stage" in str(err.value)
    assert not caps.accepts(Stage(op="identity"))


def test_a_worker_accepts_any_stage_and_can_train():
    caps = local_caps(1)
    assert caps.role == "worker" and caps.devices == ("cpu",)
    assert caps.accepts(Stage(op="relu")) and caps.accepts(Stage.board("anything"))
    assert caps.can_train() and caps.why_not_train() is None
    caps.check_train()


def test_a_fixed_function_rank_cannot_train_and_says_why():
    caps = local_caps(2, fixed_function=FF)
    assert caps.role == "fixed_function" and caps.devices == ("fpga",)
    assert not caps.can_train()
    with pytest.raises(PlacementError) as err:
        caps.check_train()
    message = str(err.value)
    assert message == caps.why_not_train()
    assert "rank 2 is a fixed-function rank implementing the pre-synthesized stage [enc0]" \
        in message
    assert "cannot train: its datapath has no backward pass" in message
    assert "a rank that never joins the reduce stalls every rank that does" in message


def test_local_caps_advertise_what_placement_needs():
    caps = caps_for(NodeConfig(rank=1, world=2, device="cpu", heap_bytes=64 << 20))
    assert caps.rank == 1 and caps.device == "cpu" and caps.heap_bytes == 64 << 20
    assert caps.cpu_count >= 1
    assert caps.memory_total is None or caps.memory_total > 0
    assert caps.python.count(".") == 2 and caps.numpy and caps.meshkit == meshkit.__version__
    assert caps.platform == "linux"


def test_a_node_config_knows_its_caps():
    config = NodeConfig(rank=2, world=3, fixed_function=FF, device="cpu")
    caps = config.caps()
    assert caps.rank == 2 and caps.fixed_function == FF and caps.role == config.role


def test_caps_round_trip_through_json_exactly():
    caps = local_caps(5, fixed_function=FF, heap_bytes=1 << 20)
    again = NodeCaps.from_json(caps.to_json())
    assert again == caps
    assert again.fixed_function == FF


def test_caps_from_the_wire_ignore_unknown_keys_and_refuse_wrong_types():
    data = local_caps(1).to_json()
    assert NodeCaps.from_json({**data, "gpu_tflops": 9.5}) == NodeCaps.from_json(data)
    with pytest.raises(WireError, match="devices must be a list of strings"):
        NodeCaps.from_json({**data, "devices": "cpu"})
    with pytest.raises(WireError, match="rank must be an integer"):
        NodeCaps.from_json({**data, "rank": "1"})
    with pytest.raises(WireError, match="the record has no rank"):
        NodeCaps.from_json({"role": "worker"})
    with pytest.raises(WireError, match="must carry its FixedFunction descriptor"):
        NodeCaps.from_json({**data, "role": "fixed_function"})


# -- the handshake over a real (in-process) group --------------------------------


class _Recorder:
    def __init__(self) -> None:
        self.joined: list[NodeCaps] = []

    @meshkit.hookimpl
    def meshkit_node_joined(self, caps):
        self.joined.append(caps)


def _connect_all(world: int, hub: str):
    groups = {}

    def connect(rank: int) -> None:
        groups[rank] = NodeConfig(rank=rank, world=world, peers=[hub], topology="star",
                                  transport="inproc", secret=b"k", timeout=5).connect()

    threads = [threading.Thread(target=connect, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return groups


def test_collect_caps_returns_what_each_node_advertised_and_fires_the_hook():
    from meshkit.plugins import build_manager

    recorder = _Recorder()
    pset = build_manager([recorder], entry_points=False)
    groups = _connect_all(4, "inproc://caps-ok")
    try:
        advertised = {1: local_caps(1), 2: local_caps(2, fixed_function=FF), 3: local_caps(3)}
        for rank in (3, 1, 2):  # arrival order differs from rank order
            send_caps(groups[rank], advertised[rank])
        collected = collect_caps(groups[0], plugins=pset, timeout=5)
        assert collected == [advertised[1], advertised[2], advertised[3]]
        assert [c.rank for c in recorder.joined] == [3, 1, 2]
        assert recorder.joined[2].fixed_function == FF
    finally:
        for g in groups.values():
            g.close()


def test_a_node_claiming_another_rank_is_refused_and_a_silent_one_times_out():
    groups = _connect_all(3, "inproc://caps-bad")
    try:
        with pytest.raises(ConfigError, match="caps advertise rank 2 but this node is rank 1"):
            send_caps(groups[1], local_caps(2))
        groups[1].send(0, TAG_CAPS, {"caps": local_caps(2).to_json()})
        with pytest.raises(WireError, match="rank 1 advertised the caps of rank 2"):
            collect_caps(groups[0], hook=False, timeout=5)
        send_caps(groups[2], local_caps(2))
        with pytest.raises(PeerLostError, match=r"rank\(s\) \[1\] did not announce themselves"):
            collect_caps(groups[0], hook=False, timeout=0.3)
    finally:
        for g in groups.values():
            g.close()
