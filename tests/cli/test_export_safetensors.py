"""``meshkit export --format safetensors``: a real run's model, loaded by the safetensors package."""

from __future__ import annotations

import numpy as np
import pytest

from meshkit.checkpoint import load_checkpoint
from conftest import run_cli, write_config


@pytest.mark.slow
def test_a_numpy_runs_model_exports_as_safetensors_bit_for_bit(tmp_path):
    st_numpy = pytest.importorskip("safetensors.numpy")
    out = tmp_path / "run"
    config = write_config(tmp_path / "job.toml", out, workers=1, rounds=2)
    ran = run_cli("run", str(config), "-q", timeout=120)
    assert ran.returncode == 0, ran.stderr
    target = tmp_path / "model.safetensors"
    exported = run_cli("export", str(out), "--format", "safetensors", "-o", str(target))
    assert exported.returncode == 0, exported.stderr
    assert "safetensors" in exported.stdout

    final = load_checkpoint(out)
    assert final.round == 2
    loaded = st_numpy.load_file(str(target))
    assert sorted(loaded) == sorted(final.state)
    for key, value in final.state.items():
        assert loaded[key].dtype == value.dtype and loaded[key].tobytes() == value.tobytes(), key
    assert all(np.isfinite(v).all() for v in loaded.values())


def test_export_without_a_checkpoint_names_what_is_missing(tmp_path):
    exported = run_cli("export", str(tmp_path), "--format", "safetensors",
                       "-o", str(tmp_path / "x.safetensors"))
    assert exported.returncode == 2
    assert "no checkpoint" in exported.stderr and "Traceback" not in exported.stderr
