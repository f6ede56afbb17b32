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
