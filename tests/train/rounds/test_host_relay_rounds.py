"""Rounds through host relays, with real processes: the flat star's model, and a killed relay.

World 5 (coordinator + 4 workers) through two local relays (ranks 1-2 and
3-4, ``[mesh] relays = 2``) against the same run on the flat star.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshkit.train import GroupPool, Runner, read_metrics
from meshkit.train._coordinator import launch as _launch

from tests.support.configs import write_config
pytestmark = pytest.mark.slow


def relay_config(tmp_path, name: str, *, relays: int, strategy: str = "federated",
                 rounds: int = 2):
    out = tmp_path / name
    extra = "clients = 6\nmin_clients = 4\n" if strategy == "federated" else ""
    path = write_config(tmp_path / f"{name}.toml", out, workers=4, rounds=rounds,
                        task="synthetic", strategy=strategy, timeout=20.0,
                        extra=extra + "[task]\nparams = 4096\nrows = 1024",
                        mesh=f"relays = {relays}")
    return path, out


def count_relay_requests(monkeypatch) -> list[str]:
    sent: list[str] = []
    original = GroupPool.send_relay

    def recording(self, name, request, timeout):
        sent.append(f"{name}:{request['op']}")
        return original(self, name, request, timeout)

    monkeypatch.setattr(GroupPool, "send_relay", recording)
    return sent


def test_two_relays_give_the_flat_stars_model(tmp_path, monkeypatch):
    # Data-parallel through relays is checked in-process (test_host_relay.py):
    # one more pair of runs here would cost CI about ten seconds.
    flat_config, _ = relay_config(tmp_path, "flat", relays=0)
    flat = Runner(str(flat_config)).run()
    sent = count_relay_requests(monkeypatch)
    relayed_config, out = relay_config(tmp_path, "relayed", relays=2)
    relayed = Runner(str(relayed_config)).run()
    assert flat.ok and relayed.ok
    # The rounds really went through the relays: one fold per relay per step.
    assert sent.count("relay-1:fold") == sent.count("relay-2:fold") == 2
    for key, value in flat.state.items():
        np.testing.assert_allclose(relayed.state[key], value, rtol=1e-6, atol=1e-7)
    rows = read_metrics(out)
    assert [r["dropped"] for r in rows] == [[], []]
    assert all(set(r["served"].values()) == {1, 2, 3, 4} for r in rows)


def test_a_relay_killed_mid_round_drops_exactly_its_ranks_and_the_round_completes(
        tmp_path, monkeypatch):
    procs: dict[int, object] = {}
    rounds_done = [0]
    original = GroupPool.send_relay

    def kill_first_relay_in_round_2(self, name, request, timeout):
        # Round 2 has started: the state is on its way. relay-1 dies now, before
        # it can answer; its clients must be served by relay-2 in this round.
        if rounds_done[0] == 1 and name == "relay-1" and procs[-1].poll() is None:
            procs[-1].kill()
            procs[-1].wait(10)
        return original(self, name, request, timeout)

    def on_round(report, state):
        rounds_done[0] = report.round

    monkeypatch.setattr(GroupPool, "send_relay", kill_first_relay_in_round_2)
    config, out = relay_config(tmp_path, "killed", relays=2, rounds=3)
    report = Runner(str(config), on_workers=procs.update, on_round=on_round).run()
    assert report.ok, report
    rows = read_metrics(out)
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert [r["dropped"] for r in rows] == [[], [1, 2], []]
    for row in rows[1:]:
        # Every client of the round is served, by the ranks of the surviving relay.
        assert sorted(map(int, row["served"])) == row["clients"] == list(range(6))
        assert set(row["served"].values()) == {3, 4}
        assert row["not_served"] == {}
    # Each rank's reason names the relay's loss, or (for the rank whose send
    # found the relay's connection closed first) that closed connection.
    for r in (1, 2):
        reason = report.dropped[r]
        assert "host relay 'relay-1' was lost" in reason or "is closed" in reason, reason
    assert any("host relay 'relay-1' was lost" in report.dropped[r] for r in (1, 2))


def test_a_direct_worker_beside_a_relay_folds_as_a_relay_of_one(tmp_path, monkeypatch):
    # World 4: ranks 1-2 behind one relay, rank 3 dialing the coordinator. One
    # client per worker per round: folded, the relay sends one contribution
    # up per round; forwarding, it would send two.
    params = 16384
    def config(name, relays):
        out = tmp_path / name
        path = write_config(tmp_path / f"{name}.toml", out, workers=3, rounds=3,
                            task="synthetic", timeout=20.0,
                            extra=f"clients = 3\n[task]\nparams = {params}\nrows = 768",
                            mesh=f"relays = {relays}")
        return path, out

    flat = Runner(str(config("flat", 0)[0])).run()
    monkeypatch.setattr(_launch, "relay_blocks", lambda workers, relays: [[1, 2]])
    sent = count_relay_requests(monkeypatch)
    path, out = config("mixed", 1)
    runner = Runner(str(path))
    up: list[int] = []

    def on_round(report, state):
        up.append(runner._group.relay_bytes_in["relay-1"])  # the coordinator's counter

    runner.on_round = on_round
    mixed = runner.run()
    assert flat.ok and mixed.ok
    assert sent.count("relay-1:fold") == 3
    rows = read_metrics(out)
    assert all(r["served"] == {"0": 1, "1": 2, "2": 3} for r in rows)
    model = params * 4
    per_round = [b - a for a, b in zip(up, up[1:])]
    # One folded contribution (and small replies) per round, not two.
    print("bytes up from the relay per round:", per_round, "model:", model)
    assert all(0.9 * model < b < 1.3 * model for b in per_round), (per_round, model)
    for key, value in flat.state.items():
        np.testing.assert_allclose(mixed.state[key], value, rtol=1e-6, atol=1e-7)


def test_a_grid_round_through_relays_adds_codes_there_and_gives_the_stars_bits(
        tmp_path, monkeypatch):
    # [compression] clip_range: each relay adds its ranks' integer sums of codes and sends
    # one sum up (grid_sum); integer sums do not depend on grouping, so the model is the
    # flat star's bit for bit.
    params, clients = 4096, 16
    grid = '\n[compression]\nname = "quantize"\nclip_range = 0.5\n'

    def config(name, relays):
        out = tmp_path / name
        path = write_config(tmp_path / f"{name}.toml", out, workers=4, rounds=2,
                            task="synthetic", timeout=20.0,
                            extra=f"clients = {clients}\n{grid}\n[task]\nparams = {params}"
                                  f"\nrows = 1024", mesh=f"relays = {relays}")
        return path, out

    flat = Runner(str(config("flat", 0)[0])).run()
    sent = count_relay_requests(monkeypatch)
    path, out = config("relayed", 2)
    runner = Runner(str(path))
    up: list[int] = []
    runner.on_round = lambda report, state: up.append(
        runner._group.relay_bytes_in["relay-1"])
    relayed = runner.run()
    assert flat.ok and relayed.ok
    assert sent.count("relay-1:grid_sum") == sent.count("relay-2:grid_sum") == 2
    assert not any(s.endswith(":fold") for s in sent)
    for key, value in flat.state.items():
        assert relayed.state[key].tobytes() == value.tobytes(), key
    rows = read_metrics(out)
    assert all(len(r["served"]) == clients and r["dropped"] == [] for r in rows)
    # Up from relay 1 in round 2: one sum of its 8 clients' codes (about 18 bits a
    # coordinate) and their small results, not 8 int8 payloads of `params` bytes each.
    per_round = up[1] - up[0]
    print("bytes up from relay-1 in round 2:", per_round, "one int8 model:", params)
    assert per_round < 0.5 * 8 * params, per_round
