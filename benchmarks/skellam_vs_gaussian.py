"""How far the 1-D Skellam shift is from being dominated by the Gaussian of the same variance (issue 41).

``python benchmarks/skellam_vs_gaussian.py [--mu 569231326.9] [--shifts 1,10,100,1000,10000,23851]``

An exploration for docs/privacy.md ("A PLD accountant for the Skellam
mechanism"), not an accountant and not a proof. For each integer shift t it
computes the hockey-stick divergence δ(ε) = Σ_k max(0, P(k − t) − e^ε P(k))
of the Skellam Sk(μ) (its pmf the exact cross-correlation of two
Poisson(μ/2) pmfs, by FFT, over μ/2 ± (12√(μ/2) + 40)) at 24 values of ε
from 0 to 6a + a²/2 (a = t/√μ, where the Gaussian's δ is not negligible),
and the Gaussian mean shift a′ whose δ_G(ε) = Φ(−ε/a′ + a′/2) −
e^ε Φ(−ε/a′ − a′/2) equals it. ``c needed`` is the largest a′/a: the factor
by which the Gaussian's shift must grow to dominate the Skellam's at the
values of ε looked at. c > 1 means the Skellam is *not* dominated by the
Gaussian of the same variance. The default μ is the benchmark's at RDP's ε
(benchmarks/ddp_noise_budget.py), the largest shift its Δ₂.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from statistics import NormalDist

import numpy as np

from meshkit.privacy._common_noise import _poisson_cdf

_PHI = NormalDist().cdf


def skellam_pmf(mu: float) -> tuple[np.ndarray, int]:
    """(pmf, offset): pmf[i] = P(Sk(μ) = i − offset)."""
    _, cdf = _poisson_cdf(mu / 2)
    p = np.diff(np.concatenate([[0.0], cdf]))
    n = p.size
    size = 1 << (2 * n - 1).bit_length()
    spectrum = np.fft.rfft(p, size)
    corr = np.fft.irfft(spectrum * np.conj(spectrum), size)  # P(X − Y = k) at k mod size
    pmf = np.maximum(np.concatenate([corr[size - (n - 1):], corr[:n]]), 0.0)
    return pmf / pmf.sum(), n - 1


def gaussian_delta(eps: float, a: float) -> float:
    return _PHI(-eps / a + a / 2) - math.exp(eps) * _PHI(-eps / a - a / 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mu", type=float, default=569231326.9)
    parser.add_argument("--shifts", default="1,10,100,1000,10000,23851")
    args = parser.parse_args()
    pmf, offset = skellam_pmf(args.mu)
    k = np.arange(pmf.size) - offset
    print(json.dumps({"mu": args.mu, "pmf_variance": float((pmf * k * k).sum())}), flush=True)
    for t in (int(x) for x in args.shifts.split(",")):
        a = t / math.sqrt(args.mu)
        shifted = np.zeros_like(pmf)
        shifted[t:] = pmf[:pmf.size - t]
        worst, ratio = 1.0, 0.0
        for eps in np.linspace(0.0, 6 * a + a * a / 2, 25)[1:]:
            d_sk = float(np.sum(np.maximum(shifted - math.exp(eps) * pmf, 0.0)))
            if d_sk < 1e-13:
                continue  # below the FFT's resolution
            low, high = 0.5 * a, 2.0 * a
            for _ in range(60):
                mid = (low + high) / 2
                low, high = (mid, high) if gaussian_delta(eps, mid) < d_sk else (low, mid)
            worst = max(worst, high / a)
            ratio = max(ratio, d_sk / gaussian_delta(eps, a))
        print(json.dumps({"shift": t, "a": a, "c_needed": worst,
                          "max_delta_ratio_skellam_over_gaussian": ratio}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
