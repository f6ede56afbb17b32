"""Bucketing (Karimireddy, He, Jaggi, ICLR 2022): average shuffled buckets, then aggregate.

Per round: the contributions are put in a canonical order (by a digest of
their contents, so the arrival order cannot matter), shuffled with a
generator seeded by ``seed`` and that digest (the same round gives the
same buckets, also after ``--resume``), cut into buckets of
``bucket_size`` (the last may be smaller), and each bucket is averaged
with meshkit's strict mean weighted by realized work. The inner
aggregator then combines the bucket means, each weighted by its bucket's
total work. With a mean as ``inner`` the result is the plain weighted mean.

Strictness is meshkit's: :func:`meshkit.aggregation.check_contributions`
refuses what the built-ins refuse, before any arithmetic.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping, Sequence

import numpy as np

from meshkit.aggregation import MeanFold, aggregate_by_folding, check_contributions
from meshkit.state import is_array

__all__ = ["Bucketing"]


def _digest(state: Mapping[str, Any]) -> bytes:
    h = hashlib.sha256()
    for key in sorted(state):
        value = state[key]
        h.update(key.encode())
        h.update(np.ascontiguousarray(value).tobytes() if is_array(value) else repr(value).encode())
    return h.digest()


class Bucketing:
    """Buckets of ``bucket_size`` averaged, then ``inner`` over the bucket means."""

    name = "bucketing"

    def __init__(self, bucket_size: int, inner: Any, seed: int = 0) -> None:
        self.bucket_size, self.inner, self.seed = bucket_size, inner, seed

    def aggregate(self, states: Sequence[Mapping[str, Any]],
                  weights: Sequence[float] | None = None) -> dict[str, Any]:
        states = list(states)
        w = check_contributions(states, weights, name=self.name)
        digests = [_digest(s) for s in states]
        canonical = sorted(range(len(states)), key=lambda i: digests[i])
        round_digest = hashlib.sha256(b"".join(sorted(digests))).digest()
        rng = np.random.default_rng([self.seed, int.from_bytes(round_digest[:8], "little")])
        order = [canonical[i] for i in rng.permutation(len(states))]
        means, masses = [], []
        for start in range(0, len(order), self.bucket_size):
            bucket = [i for i in order[start:start + self.bucket_size] if w[i] > 0]
            if not bucket:
                continue  # a bucket of contributors that did no work carries nothing
            means.append(aggregate_by_folding(MeanFold(name=self.name),
                                              [states[i] for i in bucket],
                                              [w[i] for i in bucket], name=self.name))
            masses.append(float(sum(w[i] for i in bucket)))
        return dict(self.inner.aggregate(means, masses))

    def __repr__(self) -> str:
        return f"Bucketing(bucket_size={self.bucket_size}, inner={self.inner!r}, seed={self.seed})"
