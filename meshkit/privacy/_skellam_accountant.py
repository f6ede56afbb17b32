"""ε of the distributed Skellam mechanism, by Rényi DP: :class:`SkellamAccountant`.

One round releases the sum of the survivors' rounded updates (each of L2
norm ≤ Δ₂ and L1 norm ≤ Δ₁, in grid steps) plus Sk(μ) per coordinate, μ
the noise the survivors actually added (fewer survivors: smaller μ, larger
ε; each round is composed with its own μ and the ε it cost is reported).

* The mechanism's RDP at integer order α (Agarwal, Kairouz and Liu 2021,
  Theorem 3.5 / Corollary 3.6), :func:`skellam_rdp`::

      ε(α) ≤ α·Δ₂²/(2μ) + min(((2α − 1)·Δ₂² + 6·Δ₁)/(4μ²), 3·Δ₁/(2μ))

* Poisson subsampling with probability q (a client is in a round with
  probability q, the add/remove neighbourhood), :func:`subsampled_rdp`: the
  binomial expansion of the mixture's moment, exact for the "remove"
  direction and bounded through the mechanism's RDP at each order::

      ε_q(α) ≤ 1/(α−1) · log[(1−q)^(α−1)(1 + (α−1)q)
                               + Σ_{j=2..α} C(α,j) (1−q)^(α−j) q^j e^((j−1)ε(j))]

  (the expansion Mironov, Talwar and Zhang 2019, §3.3, compute for the
  sampled Gaussian's integer orders). Why it holds for the Skellam
  mechanism in *both* directions: ``E_P[((1−q) + q·Q/P)^α]`` expands by the
  binomial theorem into ``Σ_j C(α,j)(1−q)^(α−j) q^j E_P[(Q/P)^j]``, every term
  positive, with ``E_P[(Q/P)^j] = e^((j−1)D_j(Q‖P)) ≤ e^((j−1)ε(j))``; and the
  "add" direction ``D_α(P ‖ (1−q)P + qQ)`` never exceeds the "remove" one for
  a pair that a bijection of the outputs swaps (k ↦ Δ − k swaps Sk(μ) and
  Δ + Sk(μ), coordinate by coordinate, since the Skellam is symmetric): the
  proof is in docs/privacy.md ("Accounting"), and
  benchmarks/skellam_reference.py checks both directions of the exact
  mixture against it. Never more than ε(α) itself.
* rounds compose by adding RDP; ε at δ is the best order's
  ε(α) + log(1 − 1/α) − log(δα)/(α − 1) (Balle et al. 2020), as
  :func:`meshkit.privacy.epsilon_rdp` converts.

benchmarks/skellam_reference.py recomputes these figures independently
(exact Skellam divergences and the exact subsampled mixture, summed at 50
digits with mpmath) and
tests/privacy/data/skellam_reference.json keeps them: the test holds this
module within 1 % of them.
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar, Iterable, Sequence

import attrs
import numpy as np

from meshkit.privacy._history import RoundHistory, check_delta

__all__ = ["SkellamAccountant", "skellam_rdp", "subsampled_rdp", "epsilon_skellam",
           "SKELLAM_ORDERS"]

#: The integer orders α the accountant minimises over.
SKELLAM_ORDERS: tuple[int, ...] = tuple(range(2, 129)) + (160, 192, 256)


def skellam_rdp(alpha: int, mu: float, l2: float, l1: float) -> float:
    """The Skellam mechanism's RDP at integer order ``alpha`` (module docstring)."""
    return (alpha * l2 * l2 / (2 * mu)
            + min(((2 * alpha - 1) * l2 * l2 + 6 * l1) / (4 * mu * mu), 3 * l1 / (2 * mu)))


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def subsampled_rdp(alpha: int, q: float, mu: float, l2: float, l1: float) -> float:
    """RDP at ``alpha`` of the Skellam mechanism on a Poisson sample with probability ``q``.

    The binomial expansion of the module docstring: exact in the mechanism's
    divergences, which :func:`skellam_rdp` bounds at each order ``j``.
    """
    plain = skellam_rdp(alpha, mu, l2, l1)
    if q >= 1.0:
        return plain
    if q <= 0.0:
        return 0.0
    lq, l1q = math.log(q), math.log1p(-q)
    # j = 0 and j = 1 together: (1−q)^α + α q (1−q)^(α−1), as E_P[Q/P] = 1
    terms = [(alpha - 1) * l1q + math.log1p((alpha - 1) * q)]
    for order in range(2, alpha + 1):
        terms.append(_log_comb(alpha, order) + (alpha - order) * l1q + order * lq
                     + (order - 1) * skellam_rdp(order, mu, l2, l1))
    top = max(terms)
    bound = (top + math.log(sum(math.exp(t - top) for t in terms))) / (alpha - 1)
    return min(bound, plain)


@functools.lru_cache(maxsize=4096)
def _curve(q: float, mu: float, l2: float, l1: float) -> tuple[float, ...]:
    """One round's RDP at every order of :data:`SKELLAM_ORDERS`."""
    return tuple(subsampled_rdp(a, q, mu, l2, l1) for a in SKELLAM_ORDERS)


def epsilon_skellam(rounds: Iterable[Sequence[float]], delta: float) -> float:
    """ε at ``delta`` after ``rounds`` groups ``(q, mu, l2, l1, count)``."""
    total = np.zeros(len(SKELLAM_ORDERS))
    any_round = False
    for q, mu, l2, l1, count in rounds:
        if count > 0 and q > 0:
            total += int(count) * np.asarray(_curve(float(q), float(mu), float(l2), float(l1)))
            any_round = True
    if not any_round:
        return 0.0
    best = math.inf
    for alpha, r in zip(SKELLAM_ORDERS, total):
        if math.isfinite(r):
            best = min(best, r + math.log1p(-1 / alpha) - math.log(delta * alpha) / (alpha - 1))
    return max(0.0, best)


@attrs.define
class SkellamAccountant(RoundHistory):
    """The privacy a distributed-DP run has spent: ``[q, mu, l2, l1, rounds]`` groups."""

    delta: float = attrs.field(validator=check_delta)
    history: list[list[float]] = attrs.Factory(list)
    method: str = "skellam"
    ROW: ClassVar[int] = 5

    @property
    def rounds(self) -> int:
        return int(sum(g[4] for g in self.history))

    def compose(self, q: float, mu: float, l2: float, l1: float, rounds: int = 1) -> None:
        """Account ``rounds`` more rounds: probability q, sum noise variance μ, sensitivities."""
        if not (0.0 <= q <= 1.0 and mu > 0 and l2 > 0 and l1 > 0 and rounds >= 0):
            raise ValueError(f"need 0 <= q <= 1, mu, l2, l1 > 0, rounds >= 0; got {q}, {mu}, "
                             f"{l2}, {l1}, {rounds}")
        group = [float(q), float(mu), float(l2), float(l1)]
        if self.history and self.history[-1][:4] == group:
            self.history[-1][4] += rounds
        else:
            self.history.append([*group, rounds])

    def epsilon(self, extra: Sequence[Sequence[float]] = ()) -> float:
        """ε at :attr:`delta` so far (and after the ``extra`` groups, when given)."""
        return epsilon_skellam([*self.history, *extra], self.delta)

    def round_epsilon(self, q: float, mu: float, l2: float, l1: float) -> float:
        """ε at :attr:`delta` of that one round alone (what a round with its survivors cost)."""
        return epsilon_skellam([(q, mu, l2, l1, 1)], self.delta)
