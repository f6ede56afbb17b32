"""``meshkit node --trust-network``, and torchdist's error when the store cannot be reached."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from meshkit.cli import main

pytest.importorskip("torch.distributed")

SECRET = "node-command-secret-0123"


def node(*flags: str):
    args = ["node", "--rank", "1", "--world", "2", "--transport", "torchdist", "--timeout", "1",
            "--peers", "192.0.2.7:29500",
            "--transport-option", "join_timeout=1", *flags]
    return CliRunner().invoke(main, args, env={"MESHKIT_SECRET": SECRET})


def test_trust_network_lets_torchdist_dial_off_loopback():
    refused = node()
    assert refused.exit_code == 2
    assert "[mesh] trust_network" in refused.output and "authenticates nothing" in refused.output
    # Trusted, it dials 192.0.2.7 (TEST-NET, unreachable): not the refusal but
    # a plain error naming the store it could not reach (no traceback, exit 2).
    dialed = node("--trust-network")
    assert dialed.exit_code == 2, dialed.output
    assert "trust_network" not in dialed.output
    assert "could not reach the rendezvous store at 192.0.2.7:29500 within 1 s" in dialed.output
