"""The degree a round needs when the kernel interleaves its workers along the graph's ring.

SecAgg+'s graph joins each member to the ``k / 2`` nearest members on either
side of a ring drawn from the round's seed (:mod:`meshkit_secagg._graph`).
With the trait ``interleave`` the kernel places the cohort on its ``W``
workers round-robin in that ring's order: ring position ``p`` is played by
worker ``p mod W``. A member's ``k`` neighbours then fall on the workers
evenly, about ``k / W`` on each, instead of at random; so losing one worker
costs each member about ``k / W`` of its ``k + 1`` share holders, where a
placement the scheme knows nothing of must assume it may cost all of one
worker's clients. That is what lets the degree fall from 50 to 8 at 100
clients over 4 workers.

What drops is a worker (its clients leave a round together). A round that
must survive losing ``L`` workers at any step must also survive losing some
of them *before* the graph is drawn (the ring is then over the members
left, still round-robin over the workers left, in the same cyclic order)
and the rest after: :func:`survives` checks every such split exactly, on
the ring's real length (its wrap-around included), not on an average.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter
from typing import Sequence

__all__ = ["interleaved_degree", "survives", "holders_held"]

#: Above this many ways to choose the workers lost before the graph is drawn, the exact
#: check is not attempted and the placement-blind rule applies.
MAX_SPLITS = 64


def _neighbour_workers(ring: Sequence[int], p: int, k: int) -> Counter[int]:
    """How many of position ``p``'s ``k`` ring neighbours each worker plays (``ring`` is the
    worker of each position; every other position when ``k`` reaches round the ring)."""
    m, half = len(ring), k // 2
    if k >= m - 1:
        return Counter(ring[q] for q in range(m) if q != p)
    return Counter(ring[(p + step) % m] for step in range(-half, half + 1) if step)


def _lost_holders(ring: Sequence[int], k: int, lost: int) -> int:
    """The most of one member's ``k + 1`` holders that ``lost`` workers take with them.

    ``ring`` is the worker of each ring position. A member's holders are its
    neighbours and itself (a lost member's own share goes with it).
    """
    worst = 0
    for p in range(len(ring)):
        counts = _neighbour_workers(ring, p, k)
        counts[ring[p]] += 1
        worst = max(worst, sum(sorted(counts.values(), reverse=True)[:lost]))
    return worst


def holders_held(members: int, workers: int, k: int, colluders: int) -> int:
    """The most of a member's ``k`` neighbours that ``colluders`` *other* workers play."""
    ring = [p % workers for p in range(members)]
    worst = 0
    for p in range(members):
        counts = _neighbour_workers(ring, p, k)
        counts.pop(ring[p], None)
        worst = max(worst, sum(sorted(counts.values(), reverse=True)[:colluders]))
    return worst


def survives(members: int, workers: int, k: int, threshold: int, lost: int) -> bool | None:
    """Whether every member keeps ``threshold`` holders when any ``lost`` workers go.

    ``members`` placed round-robin on ``workers`` along the ring; the workers
    may go at any steps, some before the graph is drawn. ``None`` when there
    are too many splits to check (:data:`MAX_SPLITS`).
    """
    budget = k + 1 - threshold
    ring = [p % workers for p in range(members)]
    splits = sum(math.comb(workers, before) for before in range(lost))
    if splits > MAX_SPLITS:
        return None
    for before in range(lost):
        for gone in itertools.combinations(range(workers), before):
            left = [w for w in ring if w not in gone]
            if len(left) < 2 or _lost_holders(left, k, lost - before) > budget:
                return False
    return True


@functools.lru_cache(maxsize=256)
def interleaved_degree(members: int, workers: int, dropout: float) -> tuple[int, int] | None:
    """``(degree, threshold)``: the smallest even ``k`` for an interleaved cohort, or ``None``.

    ``threshold`` is a strict majority of the ``k + 1`` holders. ``k`` must
    let the round lose ``max(1, floor(dropout * workers))`` workers at any
    steps (:func:`survives`), and leave fewer than ``threshold`` of any
    member's holders with any minority of the *other* workers colluding with
    the coordinator (``workers // 2`` of them, half; the worker that plays
    a member sees its update anyway). ``None`` with fewer than 3 workers (one
    lost worker is then half of every member's holders: no majority
    survives) or when the exact check is out of reach; the caller keeps its
    placement-blind rule.
    """
    if workers < 3 or members <= workers:
        return None
    lost = max(1, math.floor(dropout * workers))
    colluders = workers // 2
    for k in range(2, members - 1, 2):
        threshold = (k + 1) // 2 + 1
        ok = survives(members, workers, k, threshold, lost)
        if ok is None:
            return None
        if ok and holders_held(members, workers, k, colluders) < threshold:
            return k, threshold
    return None
