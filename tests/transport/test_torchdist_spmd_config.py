"""What ``[transport] mode = "spmd"`` asks of a config, checked before any rank connects."""

from __future__ import annotations

from pathlib import Path

import pytest

import meshkit.plugins
from meshkit import RefusedError
from meshkit_torchdist.launch import spmd_mode, torchrun_config

CONFIG = """\
[run]
task = "digits"
out = "{out}"

[mesh]
transport = "torchdist"
workers = 2

[transport]
mode = "{mode}"

[strategy]
name = "federated"
clients = 8
"""


def _config(tmp_path: Path, mode: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(CONFIG.format(out=tmp_path / "out", mode=mode))
    return str(path)


def test_an_spmd_config_runs_on_any_number_of_ranks(tmp_path: Path) -> None:
    for world in (1, 2, 4):  # [mesh] workers is meshkit run's, not torchrun's
        assert spmd_mode(torchrun_config(_config(tmp_path, "spmd"), world))


def test_the_coordinator_mode_still_checks_workers_against_world_size(tmp_path: Path) -> None:
    with pytest.raises(meshkit.ConfigError, match="set workers = 3"):
        torchrun_config(_config(tmp_path, "coordinator"), 4)


def test_meshkit_run_refuses_the_spmd_mode_saying_to_use_torchrun() -> None:
    with pytest.raises(RefusedError, match="Run it under torchrun, or drop mode"):
        meshkit.plugins.create("transport", "torchdist", {"mode": "spmd"})
