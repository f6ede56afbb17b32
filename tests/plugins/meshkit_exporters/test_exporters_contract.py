"""The built-in exporters pass meshkit's exporter contract suite."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from meshkit.safetensors import read_safetensors
from meshkit.testing import ExporterContract


class TestSafetensors(ExporterContract):
    component = "safetensors"
    read = staticmethod(lambda file: read_safetensors(file)[0])


def _torch_read(file: Path) -> dict[str, np.ndarray]:
    import torch

    from meshkit.state import BFLOAT16

    out = {}
    for key, tensor in torch.load(file, weights_only=True).items():
        out[key] = (tensor.view(torch.int16).numpy().view(BFLOAT16)
                    if tensor.dtype == torch.bfloat16 else tensor.numpy())
    return out


@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="--format torch needs PyTorch (the torch extra)")
class TestTorch(ExporterContract):
    component = "torch"
    read = staticmethod(_torch_read)


# -- the suite fails broken exporters ------------------------------------------


class _WritesInPlace:
    """Writes straight into the target: a failure leaves a torn file."""

    def export(self, source, file):
        from meshkit.safetensors import export

        with open(file, "wb") as fh:
            fh.write(b"partial")
        return export(source, file)


class _ProbesAtConstruction:
    """Checks its output directory by writing a probe file from the factory."""

    def __init__(self):
        Path("probe.tmp").write_text("ok")

    def export(self, source, file):
        from meshkit.safetensors import export

        return export(source, file)


def _broken(cls):
    return type("Broken", (ExporterContract,), {"make": lambda self, **_: cls(),
                                                "read": staticmethod(TestSafetensors.read)})()


def test_the_suite_fails_an_export_that_is_not_atomic(tmp_path):
    with pytest.raises(AssertionError, match="replaced the file that was there"):
        _broken(_WritesInPlace).test_a_state_the_format_cannot_hold_is_refused_naming_the_key(
            tmp_path)


def test_the_suite_fails_a_factory_that_writes_a_file(tmp_path, monkeypatch):
    with pytest.raises(AssertionError, match="building the exporter created"):
        _broken(_ProbesAtConstruction).test_building_the_exporter_touches_no_file(
            tmp_path, monkeypatch)
