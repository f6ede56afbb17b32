"""A secure-aggregation round's parameters, and how the degree and threshold are chosen.

:class:`SecAggParams` is everything both sides of a round must agree on
before it starts: the cohort size the arithmetic has headroom for, the
graph's degree, the Shamir threshold, the clipping range and the modulus.
It is checked once, here; the state machines (``_client.py``,
``_server.py``) trust it.

:func:`choose_degree` picks a degree and threshold from the cohort size
and the fractions of clients the round must tolerate dropping out and
colluding with the coordinator. The conditions are those of SecAgg+ (Bell
et al., "Secure Single-Server Aggregation with (Poly)Logarithmic
Overhead", CCS 2020, §3-4): every client keeps at least ``t`` surviving
neighbours (so its secrets can be reconstructed) and has fewer than ``t``
corrupted ones (so the colluders cannot reconstruct them on their own).
Bell et al. bound these with Chernoff bounds and O(log n) degree; we
compute the exact hypergeometric tails instead (a client's neighbours are a
uniformly random subset of the others: the graph is a Harary graph on a
random permutation), union-bounded over the cohort, each failure at most
``2**-sigma``.
"""

from __future__ import annotations

import math

import attrs

from meshkit.errors import RefusedError

__all__ = ["SecAggParams", "choose_degree", "MAX_CLIENTS", "MIN_LEVEL_BITS", "MAX_LENGTH",
           "CHECK_ELEMENTS", "masked_length"]

#: The largest cohort one round may have (client ids are below this too).
MAX_CLIENTS = 1 << 16
#: The longest vector one round may sum (elements).
MAX_LENGTH = 1 << 31
#: The fewest quantisation bits each client's coordinate may be given
#: (2**16 levels over ``[-clip_range, clip_range]``); a modulus that leaves
#: fewer for the cohort is refused.
MIN_LEVEL_BITS = 16
#: Elements a masked vector carries past the update: each client puts 1 in
#: each, masked like the rest, so the unmasked sum must show the number of
#: contributors there. A sum counted under the wrong clients (a relay or
#: worker that misreports whose inputs it added) leaves masks in them and is
#: refused, except with probability 2**-(CHECK_ELEMENTS * modulus_bits).
CHECK_ELEMENTS = 2


def masked_length(length: int) -> int:
    """Elements of a masked input (or a relay's sum) for an update of ``length``: plus the check."""
    return length + CHECK_ELEMENTS

#: The most quantisation levels a coordinate is given: float64's exact integers.
MAX_LEVELS = 1 << 53


def _positive_int(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{attribute.name} must be an integer >= 0, got {value!r}")


@attrs.frozen
class SecAggParams:
    """What every party of one secure-aggregation round agrees on.

    * ``clients``: the cohort size the round is set up for (2 to
      :data:`MAX_CLIENTS`): the quantisation leaves headroom for the sum
      of this many inputs, and the complete graph joins this many;
    * ``degree``: neighbours per client in the SecAgg+ graph; ``0`` (or
      anything ``>= clients - 1``) is the complete graph of SecAgg
      (Bonawitz et al. 2017); an odd degree is raised by one (a Harary
      graph on a ring has even degree), see :func:`neighbours`;
    * ``threshold``: ``t``, the shares that reconstruct a client's secret
      (1 to the effective degree); fewer than ``t`` colluders learn nothing
      about it, fewer than ``t`` survivors among its neighbours and the
      round refuses to unmask;
    * ``clip_range``: every coordinate is clipped to ``[-clip_range,
      clip_range]`` before it is quantised (finite, > 0);
    * ``modulus_bits``: the sum is computed mod ``2**modulus_bits`` (1 to
      64; 32 keeps a masked upload the size of a float32 one);
    * ``input_bits``: 0 (the default) when the scheme quantises the update
      itself (:func:`~meshkit_secagg._quantize.quantize`); else the inputs
      are integers below ``2**input_bits`` the kernel quantised (a
      compressor's codes), and ``modulus_bits`` must be at least
      ``input_bits + ceil(log2 clients)`` so their sum is exact.

    Raises :class:`~meshkit.RefusedError` when the modulus leaves fewer than
    :data:`MIN_LEVEL_BITS` bits per client for ``clients`` inputs (saying
    which ``modulus_bits`` would do) or, with ``input_bits``, too few for
    their sum; ``ValueError`` for a value out of its range.
    """

    clients: int = attrs.field(validator=_positive_int)
    degree: int = attrs.field(validator=_positive_int)
    threshold: int = attrs.field(validator=_positive_int)
    clip_range: float = attrs.field(converter=float)
    modulus_bits: int = attrs.field(default=32, validator=_positive_int)
    input_bits: int = attrs.field(default=0, validator=_positive_int)

    def __attrs_post_init__(self) -> None:
        if not 2 <= self.clients <= MAX_CLIENTS:
            raise ValueError(f"clients must be 2 to {MAX_CLIENTS}, got {self.clients}")
        if not (math.isfinite(self.clip_range) and self.clip_range > 0):
            raise ValueError(f"clip_range must be a finite number > 0, got {self.clip_range!r}")
        if not 1 <= self.modulus_bits <= 64:
            raise ValueError(f"modulus_bits must be 1 to 64, got {self.modulus_bits}")
        if not 1 <= self.threshold <= self.effective_degree:
            raise ValueError(
                f"threshold must be 1 to the graph's degree ({self.effective_degree} for "
                f"degree = {self.degree} and {self.clients} clients), got {self.threshold}")
        headroom = (self.clients - 1).bit_length()  # ceil(log2(clients))
        if self.input_bits:
            if self.input_bits + headroom > self.modulus_bits:
                raise RefusedError(
                    f"modulus_bits = {self.modulus_bits} cannot hold the exact sum of "
                    f"{self.clients} inputs of {self.input_bits} bits; it needs "
                    f"{self.input_bits + headroom} (input_bits + ceil(log2 clients))")
        elif self.modulus_bits - headroom < MIN_LEVEL_BITS:
            raise RefusedError(
                f"modulus_bits = {self.modulus_bits} leaves {self.modulus_bits - headroom} bits per "
                f"client for a sum of {self.clients} clients (the sum needs {headroom} bits of "
                f"headroom); at least {MIN_LEVEL_BITS} are needed: use modulus_bits >= "
                f"{MIN_LEVEL_BITS + headroom} (at most 64), or fewer clients per round")

    @property
    def effective_degree(self) -> int:
        """The graph's degree: ``clients - 1`` for the complete graph, else ``degree`` made even."""
        if self.degree == 0 or self.degree + (self.degree & 1) >= self.clients - 1:
            return self.clients - 1
        return self.degree + (self.degree & 1)

    @property
    def levels(self) -> int:
        """The largest quantised value of one coordinate: ``min((2**modulus_bits - 1) // clients, 2**53)``.

        ``clients`` values of at most this sum to less than ``2**modulus_bits``,
        so the modular sum is the exact integer sum. Capped at ``2**53``, the
        last integer float64 holds exactly: quantisation computes in float64,
        and a level it cannot hold could round past the headroom.
        """
        return min(((1 << self.modulus_bits) - 1) // self.clients, MAX_LEVELS)


def _hypergeom_tail(population: int, marked: int, draws: int, at_least: int) -> float:
    """P[X >= at_least] for X the marked items among ``draws`` drawn without replacement."""
    total = math.comb(population, draws)
    hits = sum(math.comb(marked, k) * math.comb(population - marked, draws - k)
               for k in range(max(at_least, 0), min(marked, draws) + 1))
    return hits / total


def choose_degree(clients: int, dropout: float = 0.1, corruption: float = 0.0,
                  sigma: int = 40) -> tuple[int, int]:
    """``(degree, threshold)`` for a cohort of ``clients`` (SecAgg+, Bell et al. 2020 §3-4).

    ``dropout`` is the fraction of the cohort that may drop out during the
    round, ``corruption`` the fraction that may collude with the coordinator
    (both in [0, 1)). A client's ``k`` neighbours are a uniformly random
    ``k``-subset of the other ``n - 1``; with ``D = floor(dropout (n-1))``
    dropped and ``C = ceil(corruption (n-1))`` corrupted among them
    (hypergeometric draws), the smallest even ``k`` and a ``t`` are chosen so
    that, union-bounded over the ``n`` clients, each of

    * correctness: fewer than ``t`` of its neighbours survive,
      ``n P[k - X_D > k - t] = n P[X_D >= k - t + 1]``;
    * privacy: ``t`` or more of its neighbours are corrupted,
      ``n P[X_C >= t]``;

    is at most ``2**-sigma``. ``t`` is the smallest value the privacy
    condition allows (at least ``(k + 1) // 2 + 1``, a strict majority of
    the ``k + 1`` holders of a client's shares, the client included, as
    Bell et al. require against a coordinator that lies about who dropped:
    two disjoint groups of honest holders, one told the client survived and
    one that it dropped, cannot then both reach ``t``; ``k // 2 + 1``, the
    rule before, was only half of them when ``k`` is odd, the complete
    graph of an even cohort). When no degree below ``n - 1`` satisfies both,
    the complete graph is returned as ``(0, t)``; when not even the complete
    graph does, :class:`~meshkit.RefusedError` says so.
    """
    if not 2 <= clients <= MAX_CLIENTS:
        raise ValueError(f"clients must be 2 to {MAX_CLIENTS}, got {clients}")
    if not (0.0 <= dropout < 1.0 and 0.0 <= corruption < 1.0):
        raise ValueError(f"dropout and corruption must be in [0, 1), got {dropout}, {corruption}")
    others = clients - 1
    dropped = math.floor(dropout * others)
    corrupted = math.ceil(corruption * others)
    bound = 2.0 ** -sigma / clients
    for k in range(2, others + 2, 2):
        k = min(k, others)
        for t in range((k + 1) // 2 + 1, k + 1):
            if corrupted and _hypergeom_tail(others, corrupted, k, t) > bound:
                continue
            if dropped and _hypergeom_tail(others, dropped, k, k - t + 1) > bound:
                break  # a larger t only makes correctness worse
            return (0 if k == others else k), t
        if k == others:
            break
    raise RefusedError(
        f"no degree and threshold tolerate {dropout:.0%} dropout and {corruption:.0%} "
        f"corruption among {clients} clients at failure probability 2^-{sigma}, not even the "
        "complete graph; expect fewer dropouts or colluders, or sample a larger cohort")
