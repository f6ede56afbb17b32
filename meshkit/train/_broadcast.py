"""``[compression] broadcast = true``: the coordinator sends each worker a compressed *delta*
against the model that worker already holds, instead of the whole model.

Rule: every decision about what goes down to a worker under ``broadcast`` -- a delta or
the whole model, against which base, and the bits both ends hold after it -- is made
here, on both ends (:func:`encode_delta` and :func:`apply_delta` are the one encoder and
the one decoder).

How the two ends keep the same bits (docs/compression.md, "Compressed broadcast"):

* the coordinator keeps :attr:`Broadcast.model`: the model the workers hold, which is
  the *decoded* broadcast, not the global model. Each round's delta is the new global
  model minus that model, so what one round's quantisation left out is part of the next
  round's delta: the error does not drift, it is sent later (the downlink's error
  feedback, with no residual to keep);
* the coordinator decodes its own delta with :func:`apply_delta`, exactly as the worker
  does, and the round is played from that decoded model (the fits start from it, the
  uploads are measured against it, the outer step steps from it); the global model the
  outer step makes is checkpointed and evaluated as before;
* the held model is the run's state too: :meth:`Broadcast.state_dict` goes into the
  checkpoint (the strategy's state), so a resumed run encodes the very delta the
  uninterrupted one would have, and sends it whole to its fresh workers -- the same
  bits as the uninterrupted run from then on;
* every ``set_state`` under ``broadcast`` names the digest (:func:`state_digest`, SHA-256
  of keys, dtypes, shapes and bytes) of the model it leaves; a delta also names its
  ``base``. A worker whose model is not ``base`` (a fresh or restarted process, a
  ``set_state`` in between) or whose decoded model is not ``digest`` changes nothing
  and answers ``stale``; the coordinator then sends it the whole model in the same
  round. A delta is never applied to another model, and never silently.

Keys sent whole in a delta: everything the upload sends whole (non-float entries,
the task's buffers, ``[strategy] local_keys``).
"""

from __future__ import annotations

from typing import Any, Collection, Iterable, Mapping

import numpy as np

from meshkit.compression import (
    CompressionPlan,
    CompressionTraits,
    compression_traits,
    decode_contribution,
    encode_update,
)
from meshkit.train._worker.local_sgd import state_digest

__all__ = ["Broadcast", "encode_delta", "apply_delta", "broadcast_seed"]


class _Downlink:
    """A compressor as the broadcast uses it: without error feedback of its own (the
    coordinator's decoded model is the feedback), so a delta carries no residual."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        t = compression_traits(inner)
        self.traits = CompressionTraits(unbiased=t.unbiased, sparse=t.sparse,
                                        integer_field=t.integer_field, stateful=False,
                                        contractive=t.contractive)

    def encode(self, x: np.ndarray, *, seed: int) -> dict[str, np.ndarray]:
        return self.inner.encode(x, seed=seed)

    def decode(self, fields: Mapping[str, np.ndarray], size: int) -> np.ndarray:
        return self.inner.decode(fields, size)

    def bounds(self, size: int) -> dict[str, tuple[np.dtype, int]]:
        return self.inner.bounds(size)


def downlink(compressor: Any) -> Any:
    """``compressor`` as a delta is encoded and decoded with (no residual)."""
    return compressor if isinstance(compressor, _Downlink) else _Downlink(compressor)


def broadcast_seed(seed: int, rnd: int) -> int:
    """The delta encoder's seed for round ``rnd`` of a run seeded ``seed`` (one delta a
    round, the same for every worker)."""
    return int(np.random.SeedSequence([int(seed), int(rnd), 0xB40AD]).generate_state(
        1, np.uint64)[0])


def encode_delta(compressor: Any, base: Mapping[str, Any], target: Mapping[str, Any], *,
                 seed: int, raw: Collection[str] = ()) -> dict[str, Any]:
    """The payload that takes ``base`` towards ``target`` (``raw`` keys and non-float
    entries whole, each float key's update compressed)."""
    payload, _ = encode_update(downlink(compressor), base, target, seed=seed, raw=raw)
    return payload


def apply_delta(compressor: Any, base: Mapping[str, Any], payload: Mapping[str, Any], *,
                raw: Collection[str] = ()) -> dict[str, Any]:
    """``base`` moved by the delta ``payload``: the same bits on the coordinator and on
    every worker. A payload that does not fit ``base`` is a
    :class:`~meshkit.ProtocolError` (checked before any decoder allocates)."""
    state, _ = decode_contribution(downlink(compressor), payload, base, raw=raw,
                                   what="a broadcast delta")
    return state


def _same_layout(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for key, value in a.items():
        other = b[key]
        if isinstance(value, np.ndarray) != isinstance(other, np.ndarray):
            return False
        if isinstance(value, np.ndarray) and (value.shape != other.shape
                                              or value.dtype != other.dtype):
            return False
    return True


class Broadcast:
    """The coordinator's side: the model the workers hold, the round's delta, and which
    worker holds which model (module docstring)."""

    def __init__(self, plan: CompressionPlan, seed: int) -> None:
        self.plan, self.seed = plan, int(seed)
        self.compressor = downlink(plan.compressor)
        #: The model the workers hold (the decoded broadcast); None before the first round.
        self.model: dict[str, Any] | None = None
        #: ``state_digest(model)``.
        self.digest: str | None = None
        #: This round's delta and the digest of the model it applies to (None: whole).
        self.delta: dict[str, Any] | None = None
        self.base: str | None = None
        #: Keys a delta sends whole.
        self.raw: tuple[str, ...] = ()
        #: Each rank's model, by digest, as far as the coordinator knows.
        self.held: dict[int, str] = {}
        #: ``set_state`` requests sent this run: deltas and whole models.
        self.sent = {"delta": 0, "whole": 0}

    def prepare(self, state: Mapping[str, Any], rnd: int,
                raw: Collection[str] = ()) -> dict[str, Any]:
        """The model the workers will hold this round, given the global ``state``: the
        last round's model moved by this round's delta (``state`` itself the first time,
        or when the model's keys, shapes or dtypes changed). The round is played from it."""
        self.raw = tuple(sorted(raw))
        if self.model is None or not _same_layout(self.model, state):
            self.model, self.delta, self.base = dict(state), None, None
        else:
            self.delta = encode_delta(self.compressor, self.model, state,
                                      seed=broadcast_seed(self.seed, rnd), raw=self.raw)
            self.base = self.digest
            self.model = apply_delta(self.compressor, self.model, self.delta, raw=self.raw)
        self.digest = state_digest(self.model)
        return self.model

    def set_state(self, rank: int) -> dict[str, Any]:
        """The ``set_state`` request for ``rank``: the delta when it holds its base, else
        the whole model; either way ``rank`` holds :attr:`model` after it."""
        assert self.model is not None and self.digest is not None  # prepare() came first
        whole = self.delta is None or self.held.get(rank) != self.base
        self.held[rank] = self.digest
        if whole:
            self.sent["whole"] += 1
            return {"op": "set_state", "state": self.model, "digest": self.digest}
        self.sent["delta"] += 1
        return {"op": "set_state", "state": self.delta, "base": self.base,
                "digest": self.digest, "compress": self.plan.request(self.raw)}

    def state_dict(self) -> dict[str, Any]:
        """What the checkpoint keeps: the model the workers hold ({} before the first round)."""
        return {} if self.model is None else {"model": dict(self.model)}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Continue from a checkpoint's :meth:`state_dict`. No worker holds the model yet
        (a resumed run's workers are fresh), so each is sent it whole first."""
        model = saved.get("model")
        self.model = None if not model else dict(model)
        self.digest = None if self.model is None else state_digest(self.model)
        self.delta = self.base = None
        self.held = {}

    def stale(self, rank: int) -> None:
        """``rank`` does not hold what the coordinator thought (it answered ``stale``):
        its next ``set_state`` is the whole model."""
        self.held.pop(rank, None)

    def forget(self, ranks: Iterable[int]) -> None:
        """``ranks`` failed, or were sent another model (an evaluation's): whole next time."""
        for rank in ranks:
            self.held.pop(rank, None)

    def keep_only(self, live: Iterable[int]) -> None:
        """Forget every rank that is not live (it may come back as a fresh process)."""
        alive = set(live)
        self.held = {r: d for r, d in self.held.items() if r in alive}
