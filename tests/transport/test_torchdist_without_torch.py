"""Without torch, torchdist is still listed, and selecting it is a PluginError saying what to install."""

from __future__ import annotations

import sys

import pytest

from meshkit import PluginError, plugins


def test_selecting_torchdist_without_torch_says_what_to_install(monkeypatch) -> None:
    assert "torchdist" in plugins.available("transport")  # listing never imports torch
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now fails
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    with pytest.raises(PluginError, match=r"torch is not importable.*meshkit\[torch\]"):
        plugins.create("transport", "torchdist")
