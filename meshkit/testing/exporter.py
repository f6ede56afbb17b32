"""The exporter contract suite: ``meshkit export --format NAME`` for a plugin's format.

Subclass :class:`ExporterContract` and point it at your exporter; give it the
format's own reader, so the suite checks that the file holds the model::

    class TestOnnx(ExporterContract):
        component = "onnx"
        read = staticmethod(lambda file: my_reader(file))   # file -> {key: ndarray}

What it checks (:mod:`meshkit.exporter` states the contract): building the
exporter touches no file and imports no heavy library (torch; checked in a
fresh interpreter when the exporter comes from an installed entry point);
``export(source, file)`` takes a run directory or a checkpoint file, writes
``file`` and returns its path; with ``read`` declared, every array comes back
bit for bit in its dtype and shape; a missing checkpoint is a
:class:`meshkit.ConfigError`; a state the format cannot hold (an array of
strings) is a :class:`meshkit.MeshError` naming the key; and a failed export
leaves whatever was at ``file`` untouched (writes are atomic).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

import numpy as np
import pytest

from meshkit.checkpoint import Checkpoint, save_checkpoint
from meshkit.errors import ConfigError, MeshError
from meshkit.testing.support import ContractBase, bfloat16

__all__ = ["ExporterContract"]

#: Libraries an exporter's factory must not import (each costs seconds).
HEAVY = ("torch", "tensorflow", "jax", "onnx")


def _model() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    state: dict[str, Any] = {
        "conv.weight": rng.standard_normal((2, 3)).astype(np.float32),
        "fc.bias": rng.standard_normal(3),
        "half": rng.standard_normal(4).astype(np.float16),
        "steps": np.arange(3, dtype=np.int64),
    }
    if bfloat16 is not None:
        state["bf"] = rng.standard_normal(5).astype(bfloat16)
    return state


class ExporterContract(ContractBase):
    """Conformance tests every meshkit exporter must pass."""

    kind: ClassVar[str] = "exporter"
    #: The format's own reader: ``read(file) -> {key: ndarray}``. When set, the
    #: exported model must read back bit for bit.
    read: ClassVar[Callable[[Path], Mapping[str, np.ndarray]] | None] = None
    def model(self) -> Mapping[str, Any]:
        """The model the suite exports: array keys to arrays (override for a format
        that holds fewer dtypes)."""
        return _model()

    def run_dir(self, root: Path, state: Mapping[str, Any] | None = None) -> Path:
        run = root / "run"
        save_checkpoint(run, Checkpoint(round=2, state=dict(self.model() if state is None
                                                            else state)))
        return run

    def test_building_the_exporter_touches_no_file(self, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.chdir(tmp_path)
        self.make()
        assert list(tmp_path.iterdir()) == [], (
            f"building the exporter created {sorted(p.name for p in tmp_path.iterdir())}; "
            f"a factory runs to list and select formats, and must touch nothing")

    def test_building_the_exporter_imports_no_heavy_library(self) -> None:
        if self.plugins is not None or self.component is None:
            pytest.skip("checked for an exporter installed through its entry point")
        code = ("import sys, meshkit.plugins\n"
                f"meshkit.plugins.create('exporter', {self.component!r}, "
                f"{dict(self.options)!r})\n"
                f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "[]", (
            f"building the exporter imported {result.stdout.strip()}: import the format's "
            f"library in export(), so listing or choosing another format does not pay for it")

    @pytest.mark.parametrize("given", ["run directory", "checkpoint file"])
    def test_the_model_is_written_and_its_path_returned(self, tmp_path: Path,
                                                        given: str) -> None:
        run = self.run_dir(tmp_path)
        source = run if given == "run directory" else run / "checkpoint.npz"
        out = tmp_path / "out" / "model.bin"
        out.parent.mkdir()
        path = self.make().export(source, out)
        assert Path(path) == out and out.is_file() and out.stat().st_size > 0, (
            f"export({given}, {out}) returned {path!r}; it must write the file and return it")
        assert sorted(p.name for p in out.parent.iterdir()) == ["model.bin"], (
            "the export left other files beside its output (temporaries?)")

    def test_every_array_reads_back_bit_for_bit(self, tmp_path: Path) -> None:
        read = type(self).read
        if read is None:
            pytest.skip("no `read` declared (the format's own reader)")
        model = dict(self.model())
        out = tmp_path / "model.bin"
        self.make().export(self.run_dir(tmp_path, model), out)
        loaded = read(out)
        assert sorted(loaded) == sorted(model), (
            f"the file holds keys {sorted(loaded)}, the model {sorted(model)}")
        for key, value in model.items():
            got = np.asarray(loaded[key])
            assert got.dtype == value.dtype and got.shape == value.shape, (
                f"key {key!r}: exported {value.dtype}{list(value.shape)}, read back "
                f"{got.dtype}{list(got.shape)}")
            assert got.tobytes() == value.tobytes(), f"key {key!r}: values changed on export"

    def test_a_run_without_a_checkpoint_is_a_config_error(self, tmp_path: Path) -> None:
        out = tmp_path / "model.bin"
        with pytest.raises(ConfigError):
            self.make().export(tmp_path, out)
        assert not out.exists(), "a failed export left a file behind"

    def test_a_state_the_format_cannot_hold_is_refused_naming_the_key(
            self, tmp_path: Path) -> None:
        run = self.run_dir(tmp_path, {**self.model(), "names": np.array(["a", "b"])})
        out = tmp_path / "model.bin"
        out.write_bytes(b"the previous export")
        try:
            self.make().export(run, out)
        except MeshError as exc:
            assert "names" in str(exc), f"the error should name the key 'names': {exc}"
        except Exception as exc:
            pytest.fail(f"an array of strings should be a meshkit.MeshError naming its key, "
                        f"got {type(exc).__name__}: {exc}", pytrace=False)
        else:
            pytest.fail("the exporter accepted an array of strings; refuse what the format "
                        "cannot hold, naming the key", pytrace=False)
        assert out.read_bytes() == b"the previous export", (
            "a failed export replaced the file that was there: write to a temporary and "
            "rename it over the target only when complete")
        assert sorted(os.listdir(tmp_path)) == ["model.bin", "run"], (
            "a failed export left a temporary behind")
