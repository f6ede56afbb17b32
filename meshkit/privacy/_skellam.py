"""Distributed DP under secure aggregation: each client's share of the Skellam mechanism.

With ``[privacy] placement = "distributed"`` the noise is added by the
clients, in the secure aggregation's integer field, before masking: the
coordinator unmasks a sum that already carries it and never sees a
noiseless one. The mechanism is Agarwal, Kairouz and Liu's (NeurIPS 2021,
"The Skellam Mechanism for Differentially Private Federated Learning"):

1. the client's update u, clipped to the L2 norm S (``clip = "client"``),
   is scaled to the integer grid, x = s·u (``scale`` s: grid steps per unit);
2. *conditional randomised rounding*: each coordinate is rounded up or down
   at random (unbiased), and the whole vector is drawn again until its L2
   norm is within :func:`rounded_l2_bound` (``bound``, Δ₂): the sensitivity
   the accountant uses holds for every vector that leaves the client;
3. Skellam noise Sk(v) = Poisson(v/2) − Poisson(v/2) (variance v) is added
   to each coordinate, v = μ/n for a cohort of n: the sum of the n
   survivors' noise is Sk(μ) (Skellam is closed under summation), μ =
   (z·S·s)², the central noise z·S in grid steps. Fewer survivors leave
   less noise: the accountant composes the noise actually summed;
4. each noised coordinate is offset into the client's share of the field,
   ``[0, 2·half]`` with ``half = levels // 2`` (the scheme's per-client
   levels), so the masked sum of the cohort never wraps: the unmasked sum
   minus ``contributors·half`` is exactly Σ rounded + Sk(μ).

Why Skellam and not the distributed discrete Gaussian: a sum of Skellams
is a Skellam, so the noise in the sum has a known law whatever the number
of survivors (a sum of discrete Gaussians is not a discrete Gaussian, and
its accounting bound degrades with the number of shares), and its Rényi DP
has a closed form (:func:`skellam_rdp`).

The field check (:func:`plan_skellam`): a coordinate leaves its share
(and would be clipped there, the one deviation from the mechanism) only if
a client's noise exceeds ``half − (S·s + 1)``; s is chosen (at most so
fine that each Poisson's mean stays within :data:`MAX_LAMBDA`) so that this
happens with probability at most ``2**-WRAP_BITS`` per round, over every
client and coordinate (Bernstein's bound for a centred Poisson difference),
which adds at most that to δ. A field too narrow for a grid that keeps
the rounding's inflation of Δ₂ small (:data:`MAX_INFLATION`) is refused,
saying which ``modulus_bits`` would do.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np

from meshkit.errors import MeshError, RefusedError

__all__ = ["SkellamPlan", "plan_skellam", "rounded_l2_bound", "l1_bound", "BETA", "WRAP_BITS",
           "MAX_INFLATION", "skellam_noise", "field_levels"]

#: Conditional rounding's β (Agarwal et al.): a draw is accepted with probability ≥ 1 − β.
BETA = math.exp(-0.5)
#: A round's probability of any client's noised coordinate leaving its share of the field.
WRAP_BITS = 40
#: The most the rounding may inflate the L2 sensitivity (Δ₂ / (S·s)); above, the grid is
#: too coarse for the field and the plan is refused.
MAX_INFLATION = 1.01
#: The largest Poisson mean a client's noise is drawn with: numpy's sampler loses its law
#: past about 2^44 (a variance 8 % low at 1.5e14, measured), so the grid is capped to keep
#: each of the two Poissons at or below this (a grid that fine has no rounding to speak of).
MAX_LAMBDA = float(1 << 40)
#: Conditional rounding redraws at most this often (each draw passes with prob. ≥ 1 − β).
MAX_DRAWS = 200


def rounded_l2_bound(c: float, d: int, beta: float = BETA) -> float:
    """Δ₂: the L2 norm conditional rounding enforces for a vector of norm ≤ ``c`` in ``d``
    coordinates (Agarwal et al. 2021, Theorem 4.1's bound, capped at c + √d)."""
    squared = c * c + d / 4 + math.sqrt(2 * math.log(1 / beta)) * (c + math.sqrt(d) / 2)
    return min(math.sqrt(squared), c + math.sqrt(d))


def l1_bound(l2: float, d: int) -> float:
    """Δ₁ of an integer vector of L2 norm ≤ ``l2`` in ``d`` coordinates: |x|₁ ≤ |x|₂² and
    |x|₁ ≤ √d·|x|₂."""
    return min(l2 * l2, math.sqrt(d) * l2)


def skellam_noise(rng: np.random.Generator, variance: float, size: int) -> np.ndarray:
    """``size`` draws of Sk(variance) = Poisson(variance/2) − Poisson(variance/2), int64."""
    half = variance / 2
    return rng.poisson(half, size).astype(np.int64) - rng.poisson(half, size).astype(np.int64)


def _tail(variance: float, log_fail: float) -> float:
    """t with P[Sk(variance) ≥ t] ≤ exp(−log_fail) (Bernstein: exp(−t²/(2(v + t/3))))."""
    third = log_fail / 3
    return third + math.sqrt(third * third + 2 * variance * log_fail)


@attrs.frozen
class SkellamPlan:
    """One distributed round's grid and noise (module docstring); the same for every client.

    ``scale`` s (grid steps per unit of the update), ``variance`` v (the
    Skellam variance each client adds to a coordinate), ``bound`` Δ₂ (grid
    steps), ``half`` (a client's coordinate is offset by it into ``[0,
    2·half]``), ``length`` (coordinates), ``cohort`` (clients the noise is
    split over).
    """

    scale: float
    variance: float
    bound: float
    half: int
    length: int
    cohort: int

    @property
    def l1(self) -> float:
        return l1_bound(self.bound, self.length)

    def sum_variance(self, contributors: int) -> float:
        """μ: the noise variance a coordinate of the sum of ``contributors`` carries
        (grid steps²)."""
        return self.variance * contributors

    def round(self, update: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Step 2: ``update`` scaled and conditionally rounded (int64), L2 norm ≤ ``bound``."""
        x = np.asarray(update, np.float64).ravel() * self.scale
        if x.size != self.length:
            raise MeshError(f"a distributed-DP update of {x.size} coordinates; the round has "
                            f"{self.length}")
        if not np.isfinite(x).all():
            raise MeshError("a distributed-DP update holds NaN or infinity")
        low = np.floor(x)
        frac = x - low
        limit = self.bound * self.bound
        for _ in range(MAX_DRAWS):
            rounded = low + (rng.random(x.size) < frac)
            if float(np.dot(rounded, rounded)) <= limit:
                return rounded.astype(np.int64)
        raise MeshError(f"conditional rounding found no vector within the L2 bound "
                        f"{self.bound:.6g} in {MAX_DRAWS} draws: the update is not clipped to "
                        f"the round's clip norm")

    def encode(self, update: np.ndarray, rng: np.random.Generator,
               dtype: Any, noise: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        """Steps 2-4 for one client: its field input (in ``[0, 2·half]``) and how many
        coordinates had to be clipped into the share (0 but with probability ≤ 2^-40).

        ``noise``: the client's Skellam share drawn by the caller (a paired benchmark's
        common numbers, :func:`~meshkit.privacy.common_skellam`); None draws it from
        ``rng`` after the rounding, as every run that is not such a benchmark does."""
        rounded = self.round(update, rng)
        noised = rounded + (skellam_noise(rng, self.variance, self.length) if noise is None
                            else np.asarray(noise, np.int64))
        clipped = int(np.count_nonzero(np.abs(noised) > self.half))
        np.clip(noised, -self.half, self.half, out=noised)
        noised += self.half
        return noised.astype(dtype), clipped

    def decode(self, total: np.ndarray, contributors: int) -> np.ndarray:
        """The noised sum (float64, units of the update) from the field's exact integer sum."""
        out = np.asarray(total).astype(np.float64)
        out -= float(contributors) * self.half
        out /= self.scale
        return out


def plan_skellam(*, clip_norm: float, noise_multiplier: float, cohort: int, length: int,
                 levels: int, bits: int, population: int | None = None) -> SkellamPlan:
    """The round's :class:`SkellamPlan` for ``cohort`` clients in a field whose per-client
    share is ``levels`` (the scheme's, ``(2**bits − 1) // cohort``): the largest scale whose
    coordinates stay in their share but with probability 2^-WRAP_BITS (module docstring).

    ``population`` (at least ``cohort``): plan the grid for a cohort of that many instead,
    so that it does not depend on who was sampled (the run's client count: every round of
    a run then has the same grid and Δ₂, whatever its cohort; docs/privacy.md, "The adding
    client's own noise share"). The noise is still split over the ``cohort`` that
    contributes, v = μ/cohort, and each coordinate checked against this cohort's share.

    Raises :class:`~meshkit.RefusedError` when the field is too narrow for the grid.
    """
    if cohort < 1 or length < 1 or not clip_norm > 0 or not noise_multiplier > 0:
        raise ValueError(f"need cohort, length >= 1 and clip_norm, noise_multiplier > 0; got "
                         f"{cohort}, {length}, {clip_norm}, {noise_multiplier}")
    if population is not None and population < cohort:
        raise ValueError(f"population {population} is smaller than the cohort {cohort}")
    half = levels // 2
    log_fail = _log_fail(cohort, length)
    grid, bound = _grid(noise_multiplier, cohort, length, half)
    if population is not None and grid > 0:
        widest = _grid(noise_multiplier, population, length,
                       field_levels(bits, population) // 2, smallest=1)
        if widest[0] > grid:  # not seen: a smaller cohort has the wider share of the field
            raise MeshError(f"the grid planned for {population} clients ({widest[0]:.6g} steps "
                            f"per clip norm) does not fit the field's share of a cohort of "
                            f"{cohort} ({grid:.6g})")
        grid, bound = widest
    if grid <= 0 or bound > MAX_INFLATION * grid:
        need = bits
        while need < 64 and not _fits(noise_multiplier, cohort, length, need):
            need += 1
        raise RefusedError(
            f"[privacy] placement = \"distributed\": modulus_bits = {bits} leaves each of "
            f"{cohort} clients {max(grid, 0):.4g} grid steps per clip norm over {length} "
            f"coordinates, and the rounding would inflate the sensitivity by more than "
            f"{MAX_INFLATION - 1:.0%}. Use [secure_aggregation] modulus_bits = {need}"
            + (" or more" if need >= 64 else "")
            + ", fewer clients per round, or placement = \"central\"")
    scale = grid / clip_norm
    variance = (noise_multiplier * grid) ** 2 / cohort
    assert 1 + grid + _tail(variance, log_fail) <= half + 1e-6 * half
    return SkellamPlan(scale=scale, variance=variance, bound=bound, half=half, length=length,
                       cohort=cohort)


def field_levels(bits: int, clients: int) -> int:
    """The largest value one of ``clients`` inputs may take so their sum mod ``2**bits`` is exact
    (capped at 2^53, float64's last exact integer)."""
    return min(((1 << bits) - 1) // clients, 1 << 53)


def _log_fail(cohort: int, length: int) -> float:
    """ln(1/p) for p = 2^-WRAP_BITS shared over every client, coordinate and sign."""
    return WRAP_BITS * math.log(2) + math.log(2.0 * cohort * length)


def _grid(z: float, cohort: int, length: int, half: int,
          smallest: int | None = None) -> tuple[float, float]:
    """(S·s, Δ₂): the widest grid whose noised coordinates stay within ``half``.

    S·s + 1 + tail(v) <= half with v = (z·S·s)²/n and tail(v) <= 2L/3 + sqrt(2vL).
    ``smallest``: the Poisson-mean cap holds for a cohort that small too (a population's
    grid, used by smaller cohorts, whose clients each add more of the noise).
    """
    log_fail = _log_fail(cohort, length)
    room = half - 1 - 2 * log_fail / 3
    grid = min(room / (1 + z * math.sqrt(2 * log_fail / cohort)),
               math.sqrt(2 * (smallest or cohort) * MAX_LAMBDA) / z)
    return grid, (rounded_l2_bound(grid, length) if grid > 0 else math.inf)


def _fits(z: float, cohort: int, length: int, bits: int) -> bool:
    grid, bound = _grid(z, cohort, length, field_levels(bits, cohort) // 2)
    return grid > 0 and bound <= MAX_INFLATION * grid
