"""``meshkit export``: a checkpoint it cannot convert, or an -o it cannot write, is exit 2."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("torch", reason="meshkit export needs PyTorch (the torch extra)")

from meshkit.checkpoint import Checkpoint, save_checkpoint  # noqa: E402
from meshkit.cli import main  # noqa: E402
from meshkit.torch import INT_BUFFERS  # noqa: E402


def export(run: object, output: object, fmt: str = "torch") -> tuple[int, str]:
    """``meshkit export RUN --format FMT -o OUTPUT`` through the real command group."""
    result = CliRunner().invoke(main, ["export", str(run), "--format", fmt, "-o", str(output)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, result.output


def run_dir(tmp_path, state) -> object:
    save_checkpoint(tmp_path / "run", Checkpoint(round=1, state=state))
    return tmp_path / "run"


@pytest.mark.parametrize("value", [np.array(["a", "b"]), np.array(["2026-01-01"], "M8[D]"),
                                   np.zeros(2, np.longdouble)], ids=["str", "datetime64",
                                                                     "longdouble"])
def test_an_array_no_tensor_can_hold_is_refused_naming_its_key(tmp_path, value):
    run = run_dir(tmp_path, {"w": np.ones(2, np.float32), "names": value})
    code, output = export(run, tmp_path / "model.pt")
    assert code == 2, output
    assert output.startswith("meshkit: error:") and "'names'" in output
    assert "no torch tensor can hold" in output
    assert "Traceback" not in output and not (tmp_path / "model.pt").exists()


@pytest.mark.parametrize("entry", [["count"], {"count": ["int64"]}, {"count": "int99"},
                                   {"gone": "int64"}],
                         ids=["a-list", "a-list-dtype", "unknown-dtype", "unknown-key"])
def test_a_malformed_int_buffers_entry_is_refused(tmp_path, entry):
    run = run_dir(tmp_path, {"count": np.array(3.0), INT_BUFFERS: entry})
    code, output = export(run, tmp_path / "model.pt")
    assert code == 2, output
    assert INT_BUFFERS in output and "Traceback" not in output


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_an_output_under_a_regular_file_or_an_uncreatable_directory_is_exit_2(tmp_path, fmt):
    run = run_dir(tmp_path, {"w": np.ones(2, np.float32)})
    (tmp_path / "plain").write_text("a file")
    code, output = export(run, tmp_path / "plain" / "model.pt", fmt)
    assert code == 2 and "cannot write" in output, output
    # /proc refuses a new directory even to root (FileNotFoundError).
    code, output = export(run, "/proc/self/no-such-dir/model.pt", fmt)
    assert code == 2 and "cannot write" in output, output
