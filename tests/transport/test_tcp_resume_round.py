"""A real round whose contribution is cut at half resumes after the worker redials (issue 39).

The coordinator runs in this process; one ``meshkit node`` process serves it
through ``tests/support/cutting_proxy.py``, a protocol-blind proxy that cuts
the first connection once about half of the contribution has crossed, and
counts every byte of each connection: "the bytes sent after the reconnect"
are the proxy's count, not either end's word.
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshkit import wire
from tests.support.configs import write_secret_file
from tests.support.cutting_proxy import CuttingProxy
from tests.support.nodes import run_with_nodes, spawn_node

pytestmark = pytest.mark.slow

SECRET = b"resume-round-secret-0123456789ab"
SEGMENT = 4 * wire.SEGMENT_UNIT  # 256 KiB
PARAMS = 4 << 20  # 16 MiB of float32: 64 segments a message
MODEL = PARAMS * 4


def _config(tmp_path: Path, name: str) -> Path:
    secret_file = write_secret_file(tmp_path / "secret", SECRET)
    path = tmp_path / f"{name}.toml"
    path.write_text(textwrap.dedent(f"""
        [run]
        task = "synthetic"
        seed = 3
        out = "{tmp_path / name}"

        [mesh]
        launch = "external"
        workers = 1
        bind = "127.0.0.1:0"
        secret_file = "{secret_file}"
        timeout = 30
        join_timeout = 60
        segment_bytes = {SEGMENT}
        resume_seconds = 30

        [strategy]
        name = "federated"
        rounds = 1

        [task]
        params = {PARAMS}
        rows = 256
        """))
    return path


def _run(tmp_path: Path, name: str, cuts: list[int | None]) -> tuple[Any, dict, CuttingProxy]:
    states: list[dict[str, np.ndarray]] = []
    proxies: list[CuttingProxy] = []

    def on_round(report: Any, state: Any) -> None:
        states.append({k: np.array(v) for k, v in state.items() if isinstance(v, np.ndarray)})

    def start_nodes(address: str) -> list[subprocess.Popen]:
        host, port = address.rsplit(":", 1)
        proxies.append(CuttingProxy((host, int(port)), cuts=cuts))
        where = f"127.0.0.1:{proxies[0].address[1]}"
        return [spawn_node(1, 2, where, tmp_path / "secret", "--segment-bytes", str(SEGMENT),
                           "--resume-seconds", "30")]

    try:
        report = run_with_nodes(_config(tmp_path, name), start_nodes, on_round=on_round)
    finally:
        for proxy in proxies:
            proxy.close()
    return report, states[-1], proxies[0]


def _message_wire(nbytes: int) -> int:
    """The wire cost of a resumable message of ``nbytes``: lead and segments as frames."""
    frame = wire.HEADER_SIZE + wire.BODY_TAG_SIZE
    return frame + wire.RESUME_LEAD.size + -(-nbytes // SEGMENT) * frame + nbytes


def test_a_round_whose_contribution_is_cut_at_half_completes_with_the_right_model(tmp_path):
    # The worker sends a few kB before its contribution (handshake, capabilities, the
    # answers to the job), so cutting its first link after half the model and half a
    # segment cuts the contribution at about half, inside a segment.
    report, state, proxy = _run(tmp_path, "cut", cuts=[MODEL // 2 + SEGMENT // 2])
    assert report.ok and report.rounds_completed == 1
    first, second = proxy.link(0), proxy.link(1)
    assert first.cut.is_set() and len(proxy.links) == 2  # cut once, redialed once
    # What of the contribution the first link did not carry (counting everything it
    # carried as the contribution's, which only makes this smaller), plus one
    # segment, bounds everything the worker sent after the reconnect: the new
    # handshake, its offer, the rest of the contribution and the round's last words.
    remainder = _message_wire(MODEL) - first.up
    assert second.up < remainder + SEGMENT, (second.up, remainder)
    assert second.up < MODEL * 3 // 4  # a restart would have sent all 16 MiB again
    # The right model: the same run without a cut gives the same state, bit for bit
    # (a synthetic fit is a pure function of the state, the shard and the seed).
    straight, expected, clean = _run(tmp_path, "straight", cuts=[])
    assert straight.ok and len(clean.links) == 1 and not clean.link(0).cut.is_set()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_array_equal(state[key], value, err_msg=key)
    # Against the uncut run: what the cut made the worker send twice (the segment
    # it interrupted, the new handshake and offer) is less than one segment.
    again = first.up + second.up - clean.link(0).up
    assert 0 < again < SEGMENT, again
    print(f"\ncut after {first.up} bytes up; after the reconnect {second.up} bytes up "
          f"(remainder {remainder} + segment {SEGMENT}); uncut run {clean.link(0).up} bytes "
          f"up; sent twice {again}")
