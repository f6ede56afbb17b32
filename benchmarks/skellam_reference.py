"""An independent reference for meshkit's Skellam accountant, computed with mpmath at 50 digits.

Writes tests/privacy/data/skellam_reference.json; tests/privacy/test_skellam.py
holds :class:`meshkit.privacy.SkellamAccountant` within 1 % of it.

What is independent: the accountant uses the closed-form RDP *bound* of
the Skellam mechanism (Agarwal et al. 2021, Theorem 3.5) in float64. This
script uses no closed form for the mechanism: for a one-dimensional
integer sensitivity Δ (Δ₁ = Δ₂ = Δ) it sums the *exact* Rényi divergence

    D_l(Sk_Δ ‖ Sk) = 1/(l−1) · log Σ_k P(k−Δ)^l P(k)^(1−l),  P(k) = e^(−μ) I_|k|(μ)

(Sk(μ) = Poisson(μ/2) − Poisson(μ/2), I the modified Bessel function) over
every integer where a term matters, at 50 significant digits. The same
published theorems then turn it into ε, written again here in mpmath:
Poisson subsampling by the binomial expansion of the mixture's moment
(docs/privacy.md, "Accounting"; capped by the unsampled divergence),
composition by adding RDP, and the conversion to (ε, δ) of Balle et al.
2020, minimised over orders 2..MAX_ORDER.

Also written, and asserted by tests/privacy/test_skellam.py: the exact
divergence of the Poisson-subsampled mixture itself, in *each* direction
("remove" D_α(qSk_Δ + (1−q)Sk ‖ Sk) and "add" D_α(Sk ‖ qSk_Δ + (1−q)Sk)),
summed directly over the integers with no expansion, for a few (z, q, α):
the expansion must equal the remove direction and the add direction must
not exceed it (the lemma the accountant relies on). The older general
bound of Zhu and Wang 2019 (Theorem 6) is written beside them, to show what
the expansion gains.

Run: ``python benchmarks/skellam_reference.py`` (about 5 minutes of CPU).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mpmath as mp

mp.mp.dps = 50

OUT = Path(__file__).resolve().parents[1] / "tests" / "privacy" / "data" / "skellam_reference.json"
MAX_ORDER = 48
DELTA = mp.mpf("1e-5")
SENSITIVITY = 128
#: (noise multiplier z: μ = (z·Δ)², sampling probability q, rounds T)
CASES = [(1.0, 1.0, 1), (2.0, 1.0, 10), (1.0, 0.05, 1), (1.0, 0.05, 200),
         (0.8, 0.05, 200), (2.0, 0.01, 1000), (0.8, 0.2, 50)]


def bessel_table(mu: mp.mpf, top: int) -> list[mp.mpf]:
    """I_k(μ) for k = 0..top by Miller's backward recurrence I_(k−1) = I_(k+1) + (2k/μ) I_k,
    started far enough above ``top`` that its start's error is below 10^-60 there,
    normalised by mpmath's I_0(μ) and checked against its I_k at a few orders."""
    # I_N / I_top <= exp(-(N² − top²)/(2μ)) <= e^-150 for N² >= top² + 300μ
    start = int(mp.ceil(mp.sqrt(top * top + 300 * mu))) + 50
    values = [mp.mpf(0)] * (start + 2)
    values[start] = mp.mpf(1)
    for k in range(start, 0, -1):
        values[k - 1] = values[k + 1] + (2 * k / mu) * values[k]
    norm = mp.besseli(0, mu, maxterms=10**7) / values[0]
    table = [v * norm for v in values[:top + 1]]
    for k in (1, top // 2, top):
        exact = mp.besseli(k, mu, maxterms=10**7)
        assert abs(table[k] / exact - 1) < mp.mpf("1e-40"), (k, table[k], exact)
    return table


def pmf_table(mu: mp.mpf, low: int, high: int) -> dict[int, mp.mpf]:
    """P(k) = e^(−μ) I_|k|(μ) for k in [low, high]."""
    scale = mp.exp(-mu)
    bessel = bessel_table(mu, max(abs(low), abs(high)))
    return {k: scale * bessel[abs(k)] for k in range(low, high + 1)}


def exact_divergences(mu: mp.mpf, delta: int, orders: range) -> dict[int, mp.mpf]:
    """D_l(Sk_Δ ‖ Sk) for each order l, summed exactly over the integers that matter."""
    width = int(mp.ceil(12 * mp.sqrt(mu))) + 20
    low, high = -width, orders[-1] * delta + width
    table = pmf_table(mu, low - delta, high)
    out = {}
    for order in orders:
        total = mp.fsum(table[k - delta] ** order * table[k] ** (1 - order)
                        for k in range(low, high + 1))
        out[order] = mp.log(total) / (order - 1)
    return out


def subsampled(order: int, q: mp.mpf, eps: dict[int, mp.mpf]) -> mp.mpf:
    """The binomial expansion of E_P[((1−q) + q·Q/P)^α], capped by the unsampled divergence."""
    if q == 1:
        return eps[order]
    total = (1 - q) ** (order - 1) * (1 + (order - 1) * q)
    for j in range(2, order + 1):
        total += mp.binomial(order, j) * (1 - q) ** (order - j) * q ** j \
            * mp.exp((j - 1) * eps[j])
    return min(mp.log(total) / (order - 1), eps[order])


def zhu_wang(order: int, q: mp.mpf, eps: dict[int, mp.mpf]) -> mp.mpf:
    """Zhu and Wang 2019, Theorem 6 (general mechanisms), capped by the unsampled divergence."""
    total = (1 - q) ** (order - 1) * (order * q - q + 1)
    total += mp.binomial(order, 2) * q ** 2 * (1 - q) ** (order - 2) * mp.exp(eps[2])
    for j in range(3, order + 1):
        total += 3 * mp.binomial(order, j) * (1 - q) ** (order - j) * q ** j \
            * mp.exp((j - 1) * eps[j])
    return min(mp.log(total) / (order - 1), eps[order])


def to_epsilon(rdp: dict[int, mp.mpf], delta: mp.mpf) -> tuple[mp.mpf, int]:
    best, where = mp.inf, 0
    for order, r in rdp.items():
        e = r + mp.log(1 - mp.mpf(1) / order) - mp.log(delta * order) / (order - 1)
        if e < best:
            best, where = e, order
    return max(best, mp.mpf(0)), where


def mixture_divergences(mu: mp.mpf, delta: int, q: mp.mpf, order: int
                        ) -> tuple[mp.mpf, mp.mpf]:
    """(remove, add): D_l(qSk_Δ + (1−q)Sk ‖ Sk) and D_l(Sk ‖ qSk_Δ + (1−q)Sk), summed
    directly over the integers that matter (no expansion)."""
    width = int(mp.ceil(12 * mp.sqrt(mu))) + 20
    low, high = -width - order * delta, order * delta + width
    table = pmf_table(mu, low - delta, high)
    remove = mp.fsum(((1 - q) * table[k] + q * table[k - delta]) ** order
                     * table[k] ** (1 - order) for k in range(low, high + 1))
    add = mp.fsum(table[k] ** order * ((1 - q) * table[k] + q * table[k - delta])
                  ** (1 - order) for k in range(low, high + 1))
    return mp.log(remove) / (order - 1), mp.log(add) / (order - 1)


#: (z, q, order) at which both directions of the exact mixture are written.
MIXTURES = [(1.0, 0.05, 2), (1.0, 0.05, 8), (1.0, 0.05, 32), (0.8, 0.2, 8), (2.0, 0.01, 16)]


def main() -> int:
    started = time.time()
    orders = range(2, MAX_ORDER + 1)
    cases = []
    cache: dict[float, dict[int, mp.mpf]] = {}
    for z, q_float, rounds in CASES:
        mu = (mp.mpf(z) * SENSITIVITY) ** 2
        if z not in cache:
            cache[z] = exact_divergences(mu, SENSITIVITY, orders)
        eps = cache[z]
        q = mp.mpf(q_float)
        rdp = {a: rounds * subsampled(a, q, eps) for a in orders}
        epsilon, order = to_epsilon(rdp, DELTA)
        cases.append({"noise_multiplier": z, "q": q_float, "rounds": rounds,
                      "mu": float(mu), "l2": SENSITIVITY, "l1": SENSITIVITY,
                      "delta": float(DELTA), "epsilon": mp.nstr(epsilon, 20),
                      "best_order": order,
                      "epsilon_zhu_wang": mp.nstr(to_epsilon(
                          {a: rounds * zhu_wang(a, q, eps) for a in orders}, DELTA)[0], 20),
                      "exact_rdp": {str(a): mp.nstr(eps[a], 20) for a in (2, 8, 32)}})
        print(f"z={z} q={q_float} T={rounds}: epsilon {mp.nstr(epsilon, 8)} at order {order}",
              file=sys.stderr)
    mixtures = []
    for z, q_float, order in MIXTURES:
        remove, add = mixture_divergences((mp.mpf(z) * SENSITIVITY) ** 2, SENSITIVITY,
                                          mp.mpf(q_float), order)
        mixtures.append({"noise_multiplier": z, "q": q_float, "order": order,
                         "mu": float((mp.mpf(z) * SENSITIVITY) ** 2), "l2": SENSITIVITY,
                         "l1": SENSITIVITY,
                         "exact_remove": mp.nstr(remove, 25), "exact_add": mp.nstr(add, 25),
                         "expansion": mp.nstr(subsampled(order, mp.mpf(q_float), cache[z]),
                                              25),
                         "zhu_wang_bound": mp.nstr(zhu_wang(order, mp.mpf(q_float),
                                                            cache[z]), 25)})
        print(f"z={z} q={q_float} order {order}: remove {mp.nstr(remove, 10)} add "
              f"{mp.nstr(add, 10)}", file=sys.stderr)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "about": "benchmarks/skellam_reference.py: exact 1-D Skellam Renyi divergences summed "
                 "with mpmath at 50 digits, Poisson subsampling by the binomial expansion, "
                 f"Balle et al. 2020 conversion; orders 2..{MAX_ORDER}; exact mixtures in "
                 "both directions",
        "mpmath": mp.__version__, "dps": mp.mp.dps, "cases": cases, "mixtures": mixtures},
        indent=1) + "\n")
    print(f"wrote {OUT} in {time.time() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
