"""The SecAgg+ communication graph: a k-regular Harary graph on a permutation drawn from a public seed.

Bell et al. 2020 (§3, "random Harary graph"): the members are placed on a
ring in an order drawn from the round's public seed, and each is joined to
the ``k / 2`` nearest members on either side, so every member has exactly
``k`` neighbours and a member's neighbourhood is a uniformly random
``k``-subset of the others. The order is SHA-256(seed || id) sorted (ties
broken by id), so it depends on nothing but the seed and the ids: every
party computes the same graph, and the coordinator cannot pick it.
``degree = 0``, or a degree of at least ``n - 1``, is the complete graph;
an odd degree is raised by one.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Sequence

__all__ = ["neighbours", "ring"]


def neighbours(round_seed: bytes, members: Sequence[int], degree: int) -> dict[int, tuple[int, ...]]:
    """Each member's neighbours (sorted ids) in the round's graph over ``members``.

    ``members`` are distinct integer ids (any order: the graph depends on
    the set only); ``degree`` as in :class:`SecAggParams` (0: complete).
    """
    ids = tuple(sorted(members))
    if len(set(ids)) != len(ids):
        raise ValueError("graph members must be distinct")
    if degree < 0:
        raise ValueError(f"degree must be >= 0, got {degree}")
    # Every client a worker plays asks for the same graph: it is drawn once per round.
    return dict(_graph(bytes(round_seed), ids, degree))


def ring(round_seed: bytes, members: Sequence[int]) -> tuple[int, ...]:
    """The members in the order the round's ring places them (the graph's own order).

    A member's neighbours are the ``k / 2`` before and after it here (wrapping
    around), among the members that are still in the round when it shares.
    """
    ids = tuple(sorted(members))
    if len(set(ids)) != len(ids):
        raise ValueError("graph members must be distinct")
    return _ring(bytes(round_seed), ids)


def _ring(round_seed: bytes, ids: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(ids, key=lambda member: (
        hashlib.sha256(b"meshkit/secagg graph " + round_seed
                       + member.to_bytes(8, "big", signed=True)).digest(), member)))


@functools.lru_cache(maxsize=8)
def _graph(round_seed: bytes, ids: tuple[int, ...], degree: int) -> dict[int, tuple[int, ...]]:
    n = len(ids)
    k = degree + (degree & 1)
    if degree == 0 or k >= n - 1:
        return {member: tuple(other for other in ids if other != member) for member in ids}
    ring = _ring(round_seed, ids)
    half = k // 2
    found: dict[int, tuple[int, ...]] = {}
    for position, member in enumerate(ring):
        near = {ring[(position + step) % n] for step in range(-half, half + 1) if step}
        found[member] = tuple(sorted(near))
    return found
