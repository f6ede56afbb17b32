"""How much privacy a run has spent: ε at δ of the Poisson-subsampled Gaussian, composed over rounds.

Rule: ε is a pure function of the rounds composed so far (their sampling
probability q and noise multiplier z) and of δ, computed the same way every
time, so a resumed run reports the very same ε as one never interrupted: the
accountant's state is that history and nothing else.

The mechanism of one round is the sampled Gaussian (Mironov, Talwar and Zhang
2019): each user is in the round with probability q, the round releases the
sum of the users' contributions (sensitivity 1 after clipping, in units of
the clip norm) plus N(0, z²). Neighbouring datasets differ by adding or
removing one user; ε is the larger of the two directions, as in Google's
``dp-accounting`` (``NeighboringRelation.ADD_OR_REMOVE_ONE``).

Two methods:

* ``pld`` -- the privacy loss distribution (Koskela et al. 2020; Doroshenko
  et al. 2022, "Connect the dots"). One round's hockey-stick divergence
  δ(ε) is evaluated exactly on a grid ε = i·h; the discrete distribution
  whose δ(e^ε) is the piecewise-linear interpolation of those points
  ("connect the dots") dominates the true one, since δ is convex in e^ε, so
  the discretisation never understates ε. T rounds are composed by FFT
  convolution (binary powers); after each convolution the lowest mass (below
  :data:`TAIL`) is moved up to the lowest point kept and the highest moved to
  +∞, both of which only raise δ(ε). ε is read off the composed distribution
  exactly, between grid points.
* ``rdp`` -- Rényi DP of the sampled Gaussian at integer and fractional
  orders (Mironov et al. 2019, §3.3), summed over rounds and converted with
  Canonne, Kamath and Steinke (2020, Prop. 12): ε = min over α of
  rdp(α) + log(1 − 1/α) − log(δ·α)/(α − 1). Cheaper, and looser.

Checked against ``dp-accounting`` 0.6 (``tests/privacy/test_accountant.py``,
``benchmarks/privacy.py --accountant``): within 1 % on a grid of q from 0.001
to 0.1, z from 0.5 to 2 and T up to 2,000.
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar, Iterable, Sequence

import attrs
import numpy as np

from meshkit.privacy._history import RoundHistory, check_delta

__all__ = ["Accountant", "ACCOUNTANTS", "epsilon_pld", "epsilon_rdp", "RDP_ORDERS",
           "effective_noise_multiplier"]

#: The accountant names ``[privacy] accountant`` accepts.
ACCOUNTANTS = ("pld", "rdp")

#: Rényi orders the RDP accountant minimises over (those of dp-accounting).
RDP_ORDERS: tuple[float, ...] = (
    *(1 + x / 10.0 for x in range(1, 100)), *map(float, range(11, 64)),
    128.0, 256.0, 512.0, 1024.0)

#: Probability mass truncated at each tail after each convolution (moved so
#: that δ only grows): far below any δ a run would be configured with.
TAIL = 1e-15

#: Standard deviations of the Gaussian past which one round's loss is cut off.
_SIGMAS = 12.0



def effective_noise_multiplier(z: float, count_z: float) -> float:
    """The noise multiplier of a round that releases a noised sum *and* a noised count.

    Andrew et al. 2021 (Theorem 1): a Gaussian sum with multiplier ``z`` and a
    Gaussian count with multiplier ``count_z`` (its noise over its
    sensitivity) are together one Gaussian mechanism with multiplier
    ``(z^-2 + count_z^-2)^-1/2``.
    """
    return float((z ** -2 + count_z ** -2) ** -0.5)


# -- the Gaussian tail, without scipy ----------------------------------------

_erfc = np.frompyfunc(math.erfc, 1, 1)


def _sf(x: np.ndarray) -> np.ndarray:
    """P(N(0, 1) > x), accurate in the tail."""
    return np.asarray(_erfc(np.asarray(x, dtype=np.float64) / math.sqrt(2.0)),
                      dtype=np.float64) / 2.0


# -- one round's hockey-stick divergence -------------------------------------


def _delta_remove(eps: np.ndarray, q: float, z: float) -> np.ndarray:
    """δ(ε) of P = (1−q)N(0,z²) + qN(1,z²) against Q = N(0,z²) (a user removed)."""
    out = -np.expm1(eps)  # where ε <= log(1 − q) the loss always exceeds ε
    above = eps > math.log1p(-q)
    e = eps[above]
    x = z * z * np.log((np.expm1(e) + q) / q) + 0.5  # the loss exceeds ε beyond x
    tail0, tail1 = _sf(x / z), _sf((x - 1.0) / z)
    out[above] = (1 - q) * tail0 + q * tail1 - np.exp(e) * tail0
    return np.maximum(out, 0.0)


def _delta_add(eps: np.ndarray, q: float, z: float) -> np.ndarray:
    """δ(ε) of P = N(0,z²) against Q = (1−q)N(0,z²) + qN(1,z²) (a user added)."""
    out = np.zeros_like(eps)
    below = eps < -math.log1p(-q)  # the loss never exceeds −log(1 − q)
    e = eps[below]
    x = z * z * np.log((np.expm1(-e) + q) / q) + 0.5  # the loss exceeds ε below x
    cdf0, cdf1 = _sf(-x / z), _sf((1.0 - x) / z)
    out[below] = cdf0 - np.exp(e) * ((1 - q) * cdf0 + q * cdf1)
    return np.maximum(out, 0.0)


def _loss_range(q: float, z: float, direction: str) -> tuple[float, float]:
    """The losses one round takes outside a negligible tail, in each direction."""
    if q >= 1.0:
        top = (2 * (1 + _SIGMAS * z) - 1) / (2 * z * z)
        return -top, top
    far = (1.0 + 2 * _SIGMAS * z) / (2 * z * z)
    # log(1 − q + q·e^far), without overflow for a large far
    high = far + math.log(q) + math.log1p((1 - q) * math.exp(-far) / q)
    if direction == "remove":
        return math.log1p(-q), high
    return -high, -math.log1p(-q)


def _connect_dots(q: float, z: float, h: float, direction: str
                  ) -> tuple[int, np.ndarray, float]:
    """One round's loss distribution on the grid i·h: (lowest i, masses, mass at +∞).

    The masses are those whose δ(e^ε) interpolates the true δ linearly
    between the grid points (and from (0, 1), where every δ starts), so the
    discrete distribution dominates the true one at every ε.
    """
    low, high = _loss_range(q, z, direction)
    lo, hi = math.floor(low / h), math.ceil(high / h)
    grid = np.arange(lo, hi + 1, dtype=np.float64) * h
    if q >= 1.0:
        # without sampling both directions are the Gaussian's own
        delta = _sf(grid * z - 0.5 / z) - np.exp(grid) * _sf(grid * z + 0.5 / z)
        delta = np.maximum(delta, 0.0)
    else:
        delta = (_delta_remove if direction == "remove" else _delta_add)(grid, q, z)
    # The slopes of δ against u = e^ε: from (0, 1) to the first point, between
    # points, 0 past the last (what is left there is the mass at +∞). The mass
    # at point i is u_i times the change of slope there; on the grid
    # u_{i+1} = u_i·e^h that is, without the huge numbers u_i⁻¹ would bring,
    # ((δ_{i+1} − δ_i) − e^h (δ_i − δ_{i−1})) / (e^h − 1).
    step = math.expm1(h)
    rise = np.diff(delta)  # δ_{i+1} − δ_i, all <= 0
    right = np.append(rise, 0.0) / step  # u_i · slope right of i
    left = np.empty(len(grid))  # u_i · slope left of i
    left[0] = delta[0] - 1.0
    left[1:] = rise * (1.0 + step) / step
    masses = np.maximum(right - left, 0.0)  # convexity: never negative but by rounding
    # mass the rounding lost goes to +∞, where it can only raise δ
    infinity = float(delta[-1]) + max(0.0, 1.0 - float(masses.sum()) - float(delta[-1]))
    return lo, masses, infinity


# -- composing discrete loss distributions -----------------------------------


@attrs.frozen
class _Pmf:
    """Masses at i·h for i = lo, lo+1, ..., and the mass at +∞."""

    lo: int
    masses: np.ndarray
    infinity: float
    #: :meth:`_log_mgfs`, when worked out once already (a run's one-round distribution).
    mgfs: tuple[tuple[tuple[float, float], ...], ...] | None = attrs.field(default=None,
                                                                           eq=False)

    def convolve(self, other: _Pmf) -> _Pmf:
        n = len(self.masses) + len(other.masses) - 1
        size = 1 << (n - 1).bit_length()
        spectrum = np.fft.rfft(self.masses, size) * np.fft.rfft(other.masses, size)
        masses = np.maximum(np.fft.irfft(spectrum, size)[:n], 0.0)
        infinity = 1.0 - (1.0 - self.infinity) * (1.0 - other.infinity)
        return _Pmf(self.lo + other.lo, masses, infinity).truncated()

    def truncated(self) -> _Pmf:
        """The tails cut where δ can only grow: low mass moved up, high mass to +∞."""
        masses = self.masses
        below = np.cumsum(masses)
        first = int(np.searchsorted(below, TAIL, side="right"))
        above = np.cumsum(masses[::-1])
        last = len(masses) - 1 - int(np.searchsorted(above, TAIL, side="right"))
        if first >= last:
            return self
        kept = masses[first:last + 1].copy()
        kept[0] += below[first - 1] if first else 0.0
        infinity = self.infinity + (above[len(masses) - 2 - last] if last < len(masses) - 1
                                    else 0.0)
        return _Pmf(self.lo + first, kept, infinity)

    def power(self, times: int) -> _Pmf:
        """This distribution composed with itself ``times`` times, by one FFT.

        The sum's support is cut to a window outside which a Chernoff bound
        leaves at most :data:`TAIL` on each side; the mass that wraps around
        the circular convolution is at most that, and is added to the mass
        at +∞ so that δ can only grow.
        """
        if times == 1:
            return self
        offsets = np.arange(len(self.masses), dtype=np.float64)
        low, high = self._chernoff(offsets, times)
        size = high - low + 1
        fast = 1 << (size - 1).bit_length()
        spectrum = np.fft.rfft(self.masses, fast) ** times
        circular = np.maximum(np.fft.irfft(spectrum, fast), 0.0)
        # circular[k] holds the sums whose offset is k modulo ``fast``
        masses = np.roll(circular, -low)[:size]
        finite = 1.0 - self.infinity
        infinity = 1.0 - finite ** times + 2 * TAIL
        return _Pmf(self.lo * times + low, masses, infinity).truncated()

    def _chernoff(self, offsets: np.ndarray, times: int) -> tuple[int, int]:
        """Offsets (from ``times``·lo) between which the ``times``-fold sum has all but 2·TAIL."""
        total = times * (len(self.masses) - 1)
        bounds = []
        mgfs = self.mgfs if self.mgfs is not None else self._log_mgfs(offsets)
        for sign, curve in zip((1.0, -1.0), mgfs):
            best = float(total) if sign > 0 else 0.0
            for t, log_mgf in curve:
                # P(sum ≷ x) <= e^{T·log E[e^{±t·offset}] ∓ t·x}
                edge = (times * log_mgf - math.log(TAIL)) / t
                best = min(best, edge) if sign > 0 else max(best, -edge)
            bounds.append(best)
        high, low = bounds
        low, high = max(0, math.floor(low)), min(total, math.ceil(high))
        if high < low:  # no t gave a usable bound: the whole support, exactly
            return 0, total
        return low, high

    def _log_mgfs(self, offsets: np.ndarray) -> tuple[tuple[tuple[float, float], ...], ...]:
        """(t, log E[e^{±t·offset}]) of one round over :meth:`_chernoff`'s t, for + and −."""
        log_p = np.log(np.maximum(self.masses, 1e-300))
        curves = []
        for sign in (1.0, -1.0):
            curve = []
            for t in np.geomspace(1e-4, 1e2, 60) / max(1, len(self.masses)) * 50:
                x = sign * t * offsets + log_p
                peak = float(x.max())
                curve.append((float(t), peak + math.log(float(np.exp(x - peak).sum()))))
            curves.append(tuple(curve))
        return tuple(curves)

    def epsilon(self, delta: float, h: float) -> float:
        """The smallest ε >= 0 with δ(ε) <= ``delta``; ∞ when none."""
        if self.infinity > delta:
            return math.inf
        losses = (self.lo + np.arange(len(self.masses))) * h
        # Only losses above ε count in δ(ε), and ε >= 0: the rest is dropped.
        keep = losses > 0
        losses, masses = losses[keep], self.masses[keep]
        # δ(ε) = ∞-mass + Σ_{l > ε} m_l − e^ε Σ_{l > ε} m_l e^−l: on each
        # interval between grid points two sums, taken from the top down.
        a = np.append(np.cumsum(masses[::-1])[::-1], 0.0) + self.infinity
        b = np.append(np.cumsum((masses * np.exp(-losses))[::-1])[::-1], 0.0)
        # a[i], b[i]: the points above every ε in [losses[i-1], losses[i])
        # (losses[-1] read as 0); at ε = losses[i] the points above are i+1 ...
        if a[0] - b[0] <= delta:
            return 0.0
        with np.errstate(over="ignore", invalid="ignore"):
            at_points = np.where(b[1:] > 0, a[1:] - np.exp(losses) * b[1:], a[1:])
        ok = np.nonzero(at_points <= delta)[0]
        if not len(ok):
            return math.inf
        i = int(ok[0])
        low = losses[i - 1] if i else 0.0
        eps = math.log((a[i] - delta) / b[i]) if b[i] > 0 else losses[i]
        return float(min(max(eps, low), losses[i]))


#: The two coarse discretisations every ε starts from, and the finest it refines to.
_COARSE = (1e-2, 5e-3)
_FINEST = 1e-5

#: The relative error the refinement aims at (the tests allow 1 %).
_AIM = 0.004


@functools.lru_cache(maxsize=64)
def _one_round(q: float, z: float, h: float, direction: str) -> _Pmf:
    """One round's discretised loss distribution: a pure function of its arguments, worked
    out once per run (every round's ε composes the same one again; nothing mutates it)."""
    pmf = _Pmf(*_connect_dots(q, z, h, direction)).truncated()
    return attrs.evolve(pmf, mgfs=pmf._log_mgfs(np.arange(len(pmf.masses), dtype=np.float64)))


def _epsilon_at(groups: Sequence[tuple[float, float, int]], delta: float, h: float) -> float:
    epsilons = []
    for direction in ("remove", "add"):
        total: _Pmf | None = None
        for q, z, t in groups:
            pmf = _one_round(q, z, h, direction).power(t)
            total = pmf if total is None else total.convolve(pmf)
        assert total is not None
        epsilons.append(total.epsilon(delta, h))
    return max(epsilons)


def epsilon_pld(rounds: Iterable[tuple[float, float, int]], delta: float,
                interval: float | None = None) -> float:
    """ε at ``delta`` after ``rounds`` ((q, z, count) groups), by privacy loss distributions.

    ``interval`` is the grid spacing h of the losses. By default ε is taken at
    two coarse spacings first; the connect-the-dots error shrinks about
    linearly with h, so their difference says how fine a grid the aimed
    accuracy (:data:`_AIM`) needs, and ε is taken once more there. Every
    value is an upper bound, so the smallest is reported.
    """
    groups = [(float(q), float(z), int(t)) for q, z, t in rounds if t > 0 and q > 0]
    if not groups:
        return 0.0
    if interval is not None:
        return _epsilon_at(groups, delta, interval)
    (h1, h2) = _COARSE
    eps1, eps2 = _epsilon_at(groups, delta, h1), _epsilon_at(groups, delta, h2)
    if not 0.0 < eps2 < math.inf:
        return eps2
    slope = (eps1 - eps2) / (h1 - h2)
    h = _AIM * eps2 / slope if slope > 0 else h2
    if h >= h2:
        return eps2
    return min(eps2, _epsilon_at(groups, delta, max(h, _FINEST)))


# -- Rényi DP ----------------------------------------------------------------


def _log_add(a: float, b: float) -> float:
    hi, lo = max(a, b), min(a, b)
    if lo == -math.inf:
        return hi
    return hi + math.log1p(math.exp(lo - hi))


def _log_comb(n: float, k: float) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def _log_erfc(x: float) -> float:
    """log(erfc(x)), accurate for large x too."""
    r = math.erfc(x)
    if r > 1e-300:
        return math.log(r)
    # the asymptotic series of erfc at +∞
    return (-math.log(math.pi) / 2 - math.log(x) - x * x - 0.5 * x ** -2
            + 0.625 * x ** -4 - 37.0 / 24.0 * x ** -6 + 353.0 / 64.0 * x ** -8)


def _log_a_int(q: float, z: float, alpha: int) -> float:
    log_a = -math.inf
    log1mq = math.log1p(-q)
    for i in range(alpha + 1):
        term = _log_comb(alpha, i) + i * math.log(q) + (alpha - i) * log1mq
        log_a = _log_add(log_a, term + (i * i - i) / (2 * z * z))
    return log_a


def _log_a_frac(q: float, z: float, alpha: float) -> float:
    """log A_α for fractional α: the two series of Mironov et al. 2019, §3.3."""
    log_a0 = log_a1 = last0 = last1 = -math.inf
    z0 = z * z * math.log(1 / q - 1) + 0.5
    log1mq = math.log1p(-q)
    for i in range(1000):
        coef = _log_comb(alpha, i)
        j = alpha - i
        t0 = coef + i * math.log(q) + j * log1mq
        t1 = coef + j * math.log(q) + i * log1mq
        e0 = math.log(0.5) + _log_erfc((i - z0) / (math.sqrt(2) * z))
        e1 = math.log(0.5) + _log_erfc((z0 - j) / (math.sqrt(2) * z))
        s0 = t0 + (i * i - i) / (2 * z * z) + e0
        s1 = t1 + (j * j - j) / (2 * z * z) + e1
        log_a0, log_a1 = _log_add(log_a0, s0), _log_add(log_a1, s1)
        total = _log_add(log_a0, log_a1)
        if s0 < last0 and s1 < last1 and max(s0, s1) < total - 30:
            return total
        last0, last1 = s0, s1
    return math.inf  # the series did not settle: this order gives no bound


@functools.lru_cache(maxsize=4096)
def _rdp(q: float, z: float, alpha: float) -> float:
    """One round's Rényi DP at order ``alpha``: pure, so worked out once per (q, z, order)."""
    if q >= 1.0:
        return alpha / (2 * z * z)
    log_a = (_log_a_int(q, z, int(alpha)) if float(alpha).is_integer()
             else _log_a_frac(q, z, alpha))
    return log_a / (alpha - 1)


def epsilon_rdp(rounds: Iterable[tuple[float, float, int]], delta: float,
                orders: Sequence[float] = RDP_ORDERS) -> float:
    """ε at ``delta`` after ``rounds`` ((q, z, count) groups), by Rényi DP."""
    groups = [(float(q), float(z), int(t)) for q, z, t in rounds if t > 0 and q > 0]
    if not groups:
        return 0.0
    best = math.inf
    for alpha in orders:
        r = sum(t * _rdp(q, z, alpha) for q, z, t in groups)
        if math.isinf(r) or math.isnan(r):
            continue
        if delta ** 2 + math.expm1(-r) > 0:
            return 0.0  # the KL bound already gives ε = 0
        if alpha > 1.01:
            best = min(best, r + math.log1p(-1 / alpha) - math.log(delta * alpha) / (alpha - 1))
    return max(0.0, best)


# -- the run's accountant ----------------------------------------------------


@attrs.define
class Accountant(RoundHistory):
    """The privacy a run has spent, round by round; checkpointed as its history.

    ``history`` holds ``[q, z, rounds]`` groups in the order they were
    composed (consecutive rounds with the same q and z share one group).
    """

    method: str = attrs.field(validator=attrs.validators.in_(ACCOUNTANTS))
    delta: float = attrs.field(validator=check_delta)
    history: list[list[float]] = attrs.Factory(list)
    ROW: ClassVar[int] = 3

    @property
    def rounds(self) -> int:
        """How many rounds have been composed."""
        return int(sum(t for _, _, t in self.history))

    def compose(self, q: float, z: float, rounds: int = 1) -> None:
        """Account ``rounds`` more rounds of the sampled Gaussian (probability q, multiplier z)."""
        if not 0.0 <= q <= 1.0 or not z > 0 or rounds < 0:
            raise ValueError(f"need 0 <= q <= 1, z > 0, rounds >= 0; got {q}, {z}, {rounds}")
        if self.history and self.history[-1][:2] == [q, z]:
            self.history[-1][2] += rounds
        else:
            self.history.append([float(q), float(z), rounds])

    def epsilon(self, extra: Sequence[tuple[float, float, int]] = ()) -> float:
        """ε at :attr:`delta` so far (and after ``extra`` rounds, when given)."""
        groups = [(q, z, int(t)) for q, z, t in self.history]
        for q, z, t in extra:
            if groups and groups[-1][:2] == (q, z):
                groups[-1] = (q, z, groups[-1][2] + t)
            else:
                groups.append((q, z, t))
        if self.method == "rdp":
            return epsilon_rdp(groups, self.delta)
        return epsilon_pld(groups, self.delta)
