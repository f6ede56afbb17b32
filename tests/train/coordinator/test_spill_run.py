"""``[run] spill = true`` end to end: real worker processes, the same model bit for bit."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest

from meshkit.checkpoint import load_checkpoint
from meshkit.spill import GLOBAL_FILE, OUTER_FILE
from meshkit.train import Runner
from tests.support.cli import run_cli

pytestmark = pytest.mark.slow


def config(tmp_path: Path, name: str, *, spill: str, rounds: int) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(textwrap.dedent(f"""
        [run]
        task = "digits"
        seed = 5
        out = "{tmp_path / name}"
        {spill}

        [mesh]
        launch = "local"
        workers = 2
        timeout = 30

        [strategy]
        name = "federated"
        rounds = {rounds}

        [outer_optimizer]
        name = "nesterov"
    """))
    return path


def same_model(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert np.asarray(value).dtype == np.asarray(b[key]).dtype, key
        assert np.asarray(value).tobytes() == np.asarray(b[key]).tobytes(), key


def test_a_spilled_run_ends_with_the_same_model_and_momentum_and_resumes_bit_for_bit(
        tmp_path):
    plain = Runner(config(tmp_path, "plain", spill="", rounds=3)).run()
    spilled_config = config(tmp_path, "spilled", spill="spill = true", rounds=3)
    spilled = Runner(spilled_config).run()
    assert plain.ok and spilled.ok
    assert plain.state is not None and spilled.state is not None
    same_model(dict(plain.state), dict(spilled.state))
    assert any(isinstance(v, np.memmap) for v in spilled.state.values())
    spill = tmp_path / "spilled" / "spill"
    assert (spill / GLOBAL_FILE).stat().st_size > 0 and (spill / OUTER_FILE).exists()
    # The checkpoint holds the numbers, momentum included: the spill is scratch.
    a, b = load_checkpoint(tmp_path / "plain"), load_checkpoint(tmp_path / "spilled")
    same_model(dict(a.state), dict(b.state))
    same_model({k: v for k, v in a.outer_state.items() if "/" in k},
               {k: v for k, v in b.outer_state.items() if "/" in k})

    # Two rounds, then --resume to three, the spill on: the uninterrupted model.
    cut = config(tmp_path, "cut", spill="spill = true", rounds=2)
    assert Runner(cut).run().ok
    more = config(tmp_path, "cut", spill="spill = true", rounds=3)
    resumed = Runner(more, resume=True).run()
    assert resumed.ok and resumed.resumed_from == 2 and resumed.state is not None
    same_model(dict(plain.state), dict(resumed.state))


def test_an_unwritable_spill_dir_exits_2_naming_the_key(tmp_path):
    (tmp_path / "taken").write_text("a file where the spill directory would go")
    path = config(tmp_path, "bad", spill=f'spill = true\nspill_dir = "{tmp_path / "taken"}"',
                  rounds=1)
    for command in ("check", "run"):
        result = run_cli(command, str(path), cwd=str(tmp_path), timeout=60)
        assert result.returncode == 2, result.stderr
        assert "[run] spill_dir" in result.stderr and "Traceback" not in result.stderr
