"""``[mesh] topology = "mesh"`` from a config: node processes form a tcp mesh and
data-parallel all-reduces among the replicas, reaching the star's model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meshkit import ConfigError
from meshkit.config import parse_config
from meshkit.train import GroupPool, Runner
from meshkit.train._coordinator.launch import loopback_peers, mesh_bind
from meshkit.train._coordinator.preflight import check_mesh_peers, check_topology

from tests.support.configs import write_config
def dp_config(tmp_path: Path, topology: str) -> Path:
    return write_config(tmp_path / f"{topology}.toml", tmp_path / topology, workers=3,
                        rounds=2, strategy="data-parallel", timeout=20.0, extra="steps = 3",
                        mesh=f'topology = "{topology}"')


def test_data_parallel_on_a_local_mesh_reduces_among_the_replicas_to_the_stars_model(
        tmp_path, monkeypatch):
    star = Runner(str(dp_config(tmp_path, "star"))).run()
    ops: list[str] = []
    send = GroupPool.send

    def recording(self, rank, request, timeout):
        ops.append(request["op"])
        return send(self, rank, request, timeout)

    monkeypatch.setattr(GroupPool, "send", recording)
    mesh = Runner(str(dp_config(tmp_path, "mesh"))).run()
    assert star.ok and mesh.ok, (star.error, mesh.error)
    # Every step was a "step" request per replica (gradients all-reduced over
    # the ring), never the star's gradients-to-rank-0 and apply.
    assert ops.count("step") == 2 * 3 * 3, ops
    assert "grads" not in ops and "apply" not in ops, ops
    for key, value in star.state.items():
        np.testing.assert_allclose(mesh.state[key], value, rtol=1e-6, atol=1e-7)
    # The workers stopped when the run ends left; none was dropped.
    assert star.dropped == {} and mesh.dropped == {}


def _mesh(**keys) -> object:
    return parse_config({"mesh": {"topology": "mesh", "workers": 2, **keys}}, path="m.toml")


@pytest.mark.parametrize("keys, fragment", [
    ({"min_workers": 1}, "[mesh] min_workers = 1: a mesh forms with every rank at once"),
    ({"discovery": True}, "[mesh] discovery = true"),
    ({"authorized_nodes": "nodes.txt"}, "[mesh] authorized_nodes = \"nodes.txt\""),
    ({"launch": "external"}, "[mesh] peers: a mesh whose nodes start elsewhere needs one"),
])
def test_what_only_a_star_can_do_is_refused_on_a_mesh(keys, fragment):
    with pytest.raises(ConfigError) as info:
        check_topology(_mesh(**keys))
    assert fragment in str(info.value) and str(info.value).startswith("m.toml: ")


def test_peers_are_one_real_address_per_rank_and_only_on_a_mesh():
    with pytest.raises(ConfigError, match=r"\[mesh\] peers: 2 address\(es\) for a world of 3"):
        check_mesh_peers(_mesh(peers=["127.0.0.1:5000", "127.0.0.1:5001"]), 3)
    check_mesh_peers(_mesh(peers=["h0:1", "h1:2", "h2:3"]), 3)
    with pytest.raises(ConfigError, match=r"peers\[1\] 'h1:0': a mesh peer needs a real port"):
        _mesh(peers=["h0:1", "h1:0"])
    star = parse_config({"mesh": {"peers": ["h0:1", "h1:2"]}}, path="s.toml")
    with pytest.raises(ConfigError, match=r"only topology = \"mesh\" takes one address per"):
        check_topology(star)


def test_a_local_mesh_gets_distinct_loopback_ports_and_the_coordinator_listens_at_its_own():
    peers = loopback_peers(5)
    assert len(set(peers)) == 5 and all(p.startswith("127.0.0.1:") for p in peers)
    assert all(int(p.rsplit(":", 1)[1]) > 0 for p in peers)
    assert mesh_bind("127.0.0.1:0", peers) == peers[0]
    assert mesh_bind("0.0.0.0:29500", ("host0:29500", "host1:29500")) == "0.0.0.0:29500"


def test_check_shows_a_meshs_peers():
    from meshkit import plugins
    from meshkit.train._coordinator.plan import resolve

    given = resolve(_mesh(peers=["h0:1", "h1:2", "h2:3"]), plugins.default()).describe()
    assert "topology=mesh" in given[2] and given[2].endswith("peers=h0:1,h1:2,h2:3")
    picked = resolve(_mesh(), plugins.default()).describe()
    assert picked[2].endswith("peers=free loopback ports at start")
