"""Every built-in compressor passes meshkit.testing.CompressionContract, rotated or not."""

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
