"""Every built-in compressor passes meshkit.testing.CompressionContract, rotated or not, and
top-k in every combination of its index layout, value width and error feedback."""

from __future__ import annotations

from meshkit.testing import CompressionContract


class TestQuantize8(CompressionContract):
    component = "quantize"
    options = {"bits": 8}


class TestQuantize4Rotated(CompressionContract):
    component = "quantize"
    options = {"bits": 4, "rotate": True, "chunk": 64}


class TestQuantize2(CompressionContract):
    component = "quantize"
    options = {"bits": 2}


class TestTopKErrorFeedback(CompressionContract):
    component = "top-k"
    options = {"fraction": 0.05}


class TestTopKContractive(CompressionContract):
    component = "top-k"
    options = {"fraction": 0.1, "error_feedback": False}


class TestTopKRotated(CompressionContract):
    component = "top-k"
    options = {"fraction": 0.1, "error_feedback": False, "rotate": True}


def _top_k_layout(index: str, value_bits: int, error_feedback: bool) -> type:
    """A contract class for one top-k layout (a low fraction too: gaps past 255 need fillers)."""
    options = {"fraction": 0.03 if index == "u32" else 0.002, "index": index,
               "value_bits": value_bits, "error_feedback": error_feedback}
    name = f"TestTopK_{index}_v{value_bits}_{'ef' if error_feedback else 'plain'}"
    return type(name, (CompressionContract,), {"component": "top-k", "options": options})


for _index in ("u32", "gap8"):
    for _bits in (32, 8, 4):
        for _ef in (True, False):
            _cls = _top_k_layout(_index, _bits, _ef)
            globals()[_cls.__name__] = _cls


class TestTopKGap8Rotated(CompressionContract):
    component = "top-k"
    options = {"fraction": 0.06, "index": "gap8", "value_bits": 4, "rotate": True}
