"""A real run whose model is bigger than a frame: every frame on the wire is one segment (issue 39).

The coordinator runs in this process, two ``meshkit node`` processes serve
it, and every byte between them passes through a loopback proxy that reads
the frame headers going by (``tests/support/frames.py``). ``[transport]
max_frame_bytes`` is set below the model's size on every end, so the run
completes only if the state and the contributions travel in segments.
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshkit import wire
from meshkit.errors import ConfigError

from tests.support.configs import write_secret_file
from tests.support.frames import FrameCountingProxy
from tests.support.nodes import run_with_nodes, spawn_node

SECRET = b"segments-test-secret-0123456789ab"
SEGMENT = 64 << 10
MAX_FRAME = 256 << 10
PARAMS = 200_000  # 800 kB of float32: 3x max_frame, 13 segments


def _config(tmp_path: Path, segment: object = SEGMENT) -> Path:
    secret_file = write_secret_file(tmp_path / "secret", SECRET)
    path = tmp_path / "run.toml"
    path.write_text(textwrap.dedent(f"""
        [run]
        task = "synthetic"
        seed = 3
        out = "{tmp_path / 'out'}"

        [mesh]
        launch = "external"
        workers = 2
        bind = "127.0.0.1:0"
        secret_file = "{secret_file}"
        timeout = 30
        join_timeout = 60
        segment_bytes = {segment}

        [transport]
        max_frame_bytes = {MAX_FRAME}

        [strategy]
        name = "federated"
        rounds = 2

        [task]
        params = {PARAMS}
        rows = 256
        """))
    return path


@pytest.mark.slow
def test_a_model_above_max_frame_travels_and_no_frame_on_the_wire_exceeds_a_segment(tmp_path):
    proxies: list[FrameCountingProxy] = []
    states: list[dict[str, np.ndarray]] = []

    def on_round(report: Any, state: Any) -> None:
        states.append({k: np.array(v) for k, v in state.items() if isinstance(v, np.ndarray)})

    def start_nodes(address: str) -> list[subprocess.Popen]:
        proxies.append(FrameCountingProxy(address))
        # The nodes keep the default 4 MiB: the coordinator's 64 KiB governs both ways.
        return [spawn_node(rank, 3, proxies[0].address, tmp_path / "secret",
                           "--transport-option", f"max_frame_bytes={MAX_FRAME}")
                for rank in (1, 2)]

    try:
        report = run_with_nodes(_config(tmp_path), start_nodes, on_round=on_round)
    finally:
        if proxies:
            proxies[0].close()
    assert report.rounds_completed == 2
    model = sum(a.nbytes for a in states[0].values())
    assert model > MAX_FRAME  # one frame could not have carried it
    frames = proxies[0].frames()
    leads = [n for flags, n in frames if flags & wire.FLAG_SEGMENTED]
    segments = [n for flags, n in frames if flags & wire.FLAG_SEGMENT]
    # Each round: the state to each worker, a contribution back from each (at least).
    assert len(leads) >= 2 * 2 * 2
    assert len(segments) >= len(leads) * (model // SEGMENT)
    assert max(n for _, n in frames) == SEGMENT
    assert proxies[0].bytes > 2 * 2 * 2 * model  # the model really crossed the proxy


def test_a_segment_size_the_wire_cannot_announce_is_a_config_error_naming_the_key(tmp_path):
    from meshkit.config import load_config

    with pytest.raises(ConfigError, match=r"\[mesh\].*segment_bytes.*multiple of 65536"):
        load_config(_config(tmp_path, segment=1_000_000))


@pytest.mark.slow
def test_a_model_above_max_frame_travels_through_a_host_relay_in_segments(tmp_path):
    # Both legs of the relay (coordinator <-> relay <-> workers) carry the state,
    # the workers' contributions and the relay's partial; each frame is capped at
    # max_frame_bytes on every end, so only segments get the model through.
    from meshkit.train import Runner, read_metrics

    from tests.support.configs import write_config

    out = tmp_path / "out"
    config = write_config(
        tmp_path / "run.toml", out, workers=2, rounds=2, task="synthetic", timeout=60.0,
        mesh=f"relays = 1\nsegment_bytes = {SEGMENT}",
        extra=f"[task]\nparams = {PARAMS}\nrows = 256\n[transport]\nmax_frame_bytes = {MAX_FRAME}")
    report = Runner(str(config)).run()
    assert report.ok
    assert [len(r["served"]) for r in read_metrics(out)] == [2, 2]


@pytest.mark.parametrize("command", [
    ["node", "--rank", "1", "--world", "2", "--peers", "127.0.0.1:9"],
    ["relay", "--coordinator", "127.0.0.1:9", "--world", "3", "--ranks", "1"],
], ids=["node", "relay"])
def test_a_bad_segment_bytes_flag_exits_2_naming_it_with_no_traceback(command):
    from click.testing import CliRunner

    from meshkit.cli import main

    result = CliRunner().invoke(main, [*command, "--segment-bytes", "1000"],
                                env={"MESHKIT_SECRET": SECRET.decode()})
    assert result.exit_code == 2, result.output
    assert "segment" in result.output and "multiple of 65536" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("world", [2, 3])
def test_a_mesh_all_reduce_whose_ring_frames_are_segmented_gives_the_exact_mean(world):
    # Ring frames of ~400-800 kB over links whose every end refuses a frame above
    # 256 KiB: only as a lead and segments do they get through; each is received
    # whole (not placed) and folded as before.
    from meshkit.node.config import NodeConfig
    from meshkit.train import free_ports
    from meshkit_tcp.testing import run_ranks

    peers = [f"127.0.0.1:{p}" for p in free_ports(world)]
    configs = [NodeConfig(rank=r, world=world, peers=peers, topology="mesh", secret=SECRET,
                          timeout=20.0, segment_bytes=SEGMENT,
                          transport_options={"max_frame_bytes": MAX_FRAME})
               for r in range(world)]

    def state(rank: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(10 + rank)
        return {"w": rng.standard_normal(PARAMS).astype(np.float32),
                "b": rng.standard_normal(1000)}

    results = run_ranks(configs, lambda g: g.mesh_all_reduce(state(g.rank),
                                                             weight=1.0 + g.rank)).join()
    total = sum(1.0 + r for r in range(world))
    for key in ("w", "b"):
        want = sum((1.0 + r) * state(r)[key].astype(np.float64) for r in range(world)) / total
        for rank in range(world):
            got = results[rank][key]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
            assert got.tobytes() == results[0][key].tobytes()
