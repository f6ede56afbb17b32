"""``meshkit export --format NAME``: the format is an exporter plugin, chosen by name.

The built-ins ``safetensors`` and ``torch`` come through the ``meshkit``
entry-point group like any third-party exporter; the command imports no
format's library itself (issue 35 item 8: ``--format safetensors`` imported
torch, 2.7 s of a 3-7 s export).
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import meshkit
from meshkit.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from meshkit.cli import main
from meshkit.safetensors import read_safetensors


def _run(tmp_path: Path) -> Path:
    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "mu": 1.5}
    save_checkpoint(tmp_path / "run", Checkpoint(round=3, state=state))
    return tmp_path / "run"


def test_export_to_safetensors_does_not_import_torch(tmp_path):
    pytest.importorskip("torch")  # the claim is about an environment where torch is there
    run, out = _run(tmp_path), tmp_path / "model.safetensors"
    code = (
        "import sys\n"
        "from meshkit.cli import main\n"
        f"main(['export', {str(run)!r}, '--format', 'safetensors', '-o', {str(out)!r}],"
        " standalone_mode=False)\n"
        "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not heavy, heavy[:5]\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    tensors, metadata = read_safetensors(out)
    assert tensors["w"].tobytes() == load_checkpoint(run).state["w"].tobytes()
    assert metadata["meshkit.round"] == "3"


def test_the_built_in_formats_are_exporters_from_an_entry_point():
    exporters = meshkit.plugins.available("exporter")
    assert {"safetensors", "torch"} <= set(exporters)
    for name in ("safetensors", "torch"):
        assert exporters[name].provenance.plugin == "exporters"


def test_an_unknown_format_is_exit_2_listing_the_exporters(tmp_path):
    result = CliRunner().invoke(main, ["export", str(_run(tmp_path)), "--format", "onnx",
                                       "-o", str(tmp_path / "m.onnx")])
    assert result.exit_code == 2, result.output
    assert "onnx" in result.output and "safetensors" in result.output
    assert "torch" in result.output and "Traceback" not in result.output


class _CsvExporter:
    """A third-party format: one line per array, its key and values."""

    def export(self, source, file):
        state = load_checkpoint(source).state
        lines = [f"{k}," + ",".join(repr(float(x)) for x in np.ravel(v))
                 for k, v in sorted(state.items()) if isinstance(v, np.ndarray)]
        Path(file).write_text("\n".join(lines) + "\n")
        return Path(file)


def test_a_plugins_exporter_is_selected_by_its_name(tmp_path, meshkit_register):
    plugin = types.SimpleNamespace(__name__="csv-plugin", meshkit_exporters=meshkit.hookimpl(
        lambda: [meshkit.Component("csv", _CsvExporter, summary="one line per array")]))
    meshkit_register(plugin)
    out = tmp_path / "model.csv"
    result = CliRunner().invoke(main, ["export", str(_run(tmp_path)), "--format", "csv",
                                       "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text() == "w,0.0,1.0,2.0,3.0,4.0,5.0\n"
    assert "(csv; one line per array)" in result.output
