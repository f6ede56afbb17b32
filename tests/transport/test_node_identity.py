"""Node identity over real processes: unknown, revoked and mis-bound keys are refused.

The coordinator (``meshkit coordinator``) admits only the keys listed in its
``[mesh] authorized_nodes``; each refused ``meshkit node`` exits with a
specific error, the coordinator logs one line per refusal and the
authorized nodes finish the run.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from meshkit import wire

from tests.support.configs import external_config
from tests.support.nodes import finish, spawn_node
SECRET = b"node-identity-test-secret-0123456"

pytestmark = pytest.mark.slow


def test_unknown_revoked_and_misbound_keys_are_refused_and_the_authorized_finish(tmp_path):
    keys = {name: wire.generate_node_key(tmp_path / name)
            for name in ("one", "two", "gone", "bound", "stranger")}
    (tmp_path / "authorized").write_text("\n".join([
        "# who may join",
        wire.public_key_text(keys["one"]) + " rank=1 first",
        wire.public_key_text(keys["two"]) + " rank=2 second",
        wire.public_key_text(keys["gone"]) + " rank=1",
        "revoked " + wire.public_key_text(keys["gone"]) + " lost laptop",
        wire.public_key_text(keys["bound"]) + " rank=2",
    ]) + "\n")
    config = external_config(tmp_path, workers=2, rounds=2, secret=SECRET,
                             mesh=f'authorized_nodes = "{tmp_path / "authorized"}"')
    env = {k: v for k, v in os.environ.items() if k != "MESHKIT_SECRET"}
    coordinator = subprocess.Popen([sys.executable, "-m", "meshkit", "coordinator", str(config)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=env)
    secret = tmp_path / "secret"
    good = []
    try:
        first = coordinator.stdout.readline()
        assert first.startswith("coordinator listening on "), first
        address = first.split()[3]
        refusals = {
            "stranger": "is unknown: it is not listed in",
            "gone": "is revoked in",
            "bound": "is bound to rank 2 in",
            None: "no node key: this coordinator admits only nodes listed",
        }
        for name, reason in refusals.items():
            # A refusal comes back at once; the longer dial timeout is for a
            # loaded machine, where 20 s to connect was seen to run out.
            flags = ["--key", str(tmp_path / name)] if name else []
            proc = spawn_node(1, 3, address, secret, *flags, "--timeout", "60")
            out, err = finish(proc, 120)
            assert proc.returncode == 2, err
            assert "refused rank 1" in err and reason in err, err
            assert "Traceback" not in err
            if name == "bound":
                assert "claims rank 1" in err
        good = [spawn_node(1, 3, address, secret, "--key", str(tmp_path / "one")),
                spawn_node(2, 3, address, secret, "--key", str(tmp_path / "two"))]
        out, err = finish(coordinator, 180)
        assert coordinator.returncode == 0, err
        assert "done: federated, 2 round(s)" in out
        for proc in good:
            _, node_err = finish(proc, 60)
            assert proc.returncode == 0, node_err
    finally:
        for proc in (coordinator, *good):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    lines = [line for line in err.splitlines() if "rank 0 refused" in line]
    assert len(lines) == 4, err
    for reason in ("is unknown", "is revoked", "bound to rank 2", "no node key"):
        assert sum(reason in line for line in lines) == 1, lines


def test_a_tag_bound_to_another_key_is_refused_at_caps_and_the_run_goes_on(tmp_path):
    # Both nodes advertise this host's name as a placement tag; the file
    # binds it to key "one", so the node holding key "two" may not carry it.
    host = socket.gethostname()
    keys = {name: wire.generate_node_key(tmp_path / name) for name in ("one", "two")}
    (tmp_path / "authorized").write_text(
        wire.public_key_text(keys["one"]) + f" tag={host}\n"
        + wire.public_key_text(keys["two"]) + "\n")
    config = external_config(tmp_path, workers=2, rounds=1, secret=SECRET,
                             mesh=f'authorized_nodes = "{tmp_path / "authorized"}"')
    env = {k: v for k, v in os.environ.items() if k != "MESHKIT_SECRET"}
    coordinator = subprocess.Popen([sys.executable, "-m", "meshkit", "coordinator", str(config)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=env)
    procs = []
    try:
        first = coordinator.stdout.readline()
        assert first.startswith("coordinator listening on "), first
        address = first.split()[3]
        secret = tmp_path / "secret"
        procs = [spawn_node(1, 3, address, secret, "--key", str(tmp_path / "one")),
                 spawn_node(2, 3, address, secret, "--key", str(tmp_path / "two"))]
        _, err = finish(procs[1], 60)
        assert procs[1].returncode == 2, err
        assert f"refused by the coordinator: rank 2 (node key {wire.fingerprint(keys['two'])})" \
            f" claims tag(s) '{host}'" in err, err
        assert "Traceback" not in err
        out, coordinator_err = finish(coordinator, 180)
        assert coordinator.returncode == 0, coordinator_err
        assert "done: federated, 1 round(s)" in out
        _, err = finish(procs[0], 60)
        assert procs[0].returncode == 0, err
    finally:
        for proc in (coordinator, *procs):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_a_local_launch_with_authorized_nodes_is_refused_before_it_spawns(tmp_path):
    from meshkit.errors import ConfigError
    from meshkit.train import Runner

    wire.generate_node_key(tmp_path / "k")
    (tmp_path / "authorized").write_text((tmp_path / "k.pub").read_text())
    config = external_config(tmp_path, workers=1, rounds=1, secret=SECRET,
                             mesh=f'authorized_nodes = "{tmp_path / "authorized"}"')
    config.write_text(config.read_text().replace('launch = "external"', 'launch = "local"'))
    procs: dict = {}
    with pytest.raises(ConfigError, match="authorized_nodes: admits nodes started elsewhere"):
        Runner(str(config), on_workers=procs.update).run()
    assert procs == {}
