"""Built-in compressors: ``quantize`` (8, 4 or 2 bits) and ``top-k`` (with error feedback),
each optionally after a randomised Hadamard rotation (``rotate = true``).

Written as a third-party plugin would be, against meshkit's public contract
(:mod:`meshkit.compression`): options here, the numpy code in
``quantize.py``, ``topk.py`` and ``hadamard.py``, imported when a factory
builds one, so listing plugins stays fast. docs/compression.md is the guide.
"""

from __future__ import annotations

from typing import Any, Iterable

import meshkit

from meshkit_compression.options import QuantizeOptions, TopKOptions

__all__ = ["make_quantize", "make_top_k", "meshkit_compression"]


def make_quantize(options: QuantizeOptions) -> Any:
    """Unbiased stochastic uniform quantisation with per-chunk scales (QSGD-style)."""
    from meshkit_compression.quantize import Quantize

    return _rotated(Quantize(bits=options.bits, chunk=options.chunk), options.rotate)


def make_top_k(options: TopKOptions) -> Any:
    """Top-k sparsification; with error feedback the client keeps what it left out."""
    from meshkit_compression.topk import TopK

    return _rotated(TopK(fraction=options.fraction, error_feedback=options.error_feedback,
                         value_bits=options.value_bits, index=options.index), options.rotate)


def _rotated(inner: Any, rotate: bool) -> Any:
    if not rotate:
        return inner
    from meshkit_compression.hadamard import Rotated

    return Rotated(inner)


@meshkit.hookimpl
def meshkit_compression() -> Iterable[meshkit.Component]:
    return [
        meshkit.Component("quantize", make_quantize, QuantizeOptions,
                          summary="unbiased stochastic uniform quantisation to 8, 4 or 2 bits, "
                                  "per-chunk scales (Alistarh et al. 2017, QSGD)"),
        meshkit.Component("top-k", make_top_k, TopKOptions,
                          summary="the largest coordinates of each key, with error feedback "
                                  "(Stich et al. 2018; Lin et al. 2018, DGC)"),
    ]
