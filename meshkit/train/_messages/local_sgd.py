"""The local-SGD replica's requests and replies (``diloco``; docs/protocol.md §7.3).

What the worker does with them is :mod:`meshkit.train._worker.local_sgd`.
"""

from __future__ import annotations

from typing import Any

import attrs

from meshkit.aggregation import OUTER_BITS
from meshkit.train._messages.fields import (MAX_COUNT, MAX_SEED, MAX_SEQ, Integers, Metrics,
                                            State, _between, _examples, _field, _in_order,
                                            _length, _seq, _shard, _shards)

__all__ = ["LOCAL_SGD_REQUESTS", "LOCAL_SGD_REPLIES", "MAX_FRAGMENTS"]

#: Fragments a replica may be cut into.
MAX_FRAGMENTS = 4096
#: A SHA-256 digest in hex.
DIGEST_CHARS = 64


def _digest(doc: str) -> Any:
    return _field("str, 64 hex chars", doc, check=_length(DIGEST_CHARS, DIGEST_CHARS))


def _bits() -> Any:
    return _field("int 32, 8 or 4", "the outer gradients' width (32: float32 values; 8, 4: "
                  "blockwise codes, `meshkit.aggregation.encode_blocks`)",
                  check=attrs.validators.in_(OUTER_BITS))


def _fragments() -> Any:
    return _field("int 1..4096", "how many fragments the model's float arrays are cut into "
                  "(`meshkit.train.split_fragments`)", check=_between(1, MAX_FRAGMENTS))


def _fragment_list(_: Any, attribute: Any, value: list[int]) -> None:
    if len(value) > MAX_FRAGMENTS or len(set(value)) != len(value) or not all(
            0 <= v < MAX_FRAGMENTS for v in value):
        raise ValueError(f"{attribute.name} must list distinct fragments 0..{MAX_FRAGMENTS - 1}")


# -- requests ------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ReplicaInitRequest:
    """Start a replica from the global model: anchor and local model both ``state``, a fresh
    inner optimizer."""

    seq: int = _seq(0)
    state: State = _field("state", "the global model")
    fragments: int = _fragments()
    bits: int = _bits()
    outer: State | None = _field("{name, options}", "over the ring (`exchange = \"ring\"`): "
                                 "the outer optimizer each replica steps itself (absent: "
                                 "the star steps it)", optional=True)
    outer_state: State | None = _field("state", "with `outer`: each fragment p's optimizer "
                                       "state under `outer{p}/`", optional=True)


@attrs.frozen(kw_only=True)
class InnerRequest:
    """Apply the outer ``updates``, run ``steps`` inner steps, send fragment ``send``'s
    pseudo-gradient."""

    seq: int = _seq(0)
    steps: int = _field("int 0..2^31", "inner optimizer steps to run", check=_between(0, MAX_COUNT))
    shard: int = _shard()
    shards: int = _shards()
    batch_size: int = _field("int 0..2^31", "rows per inner step; 0: the whole shard",
                             check=_between(0, MAX_COUNT))
    seed: int = _field("int 0..2^64-1", "the run seed: step s draws its batch with "
                       "`client_seed(seed, s, shard)`", check=_between(0, MAX_SEED))
    step: int = _field("int 0..2^63-1", "the run's index of the first of these steps",
                       check=_between(0, MAX_SEQ))
    updated: Integers = _field("list of int", "the fragments whose outer update this request "
                               "carries, applied first, in this order (distinct)",
                               default=attrs.Factory(list), check=_fragment_list)
    update_codes: State = _field("state", "per key of those fragments, its encoded update "
                                 "(int8, packed 4-bit uint8, or float32)",
                                 default=attrs.Factory(dict))
    update_scales: State | None = _field("state", "per key, its float32 block scales (absent "
                                         "at 32 bits)", optional=True)
    send: int | None = _field("int 0..4095", "the fragment whose pseudo-gradient to reply "
                              "with (absent: none)", optional=True,
                              check=_between(0, MAX_FRAGMENTS))
    ring: Integers | None = _field("list of int", "with `send`: exchange it over the mesh "
                                   "ring among these ranks (absent: reply with the codes)",
                                   optional=True)
    exchange: int | None = _field("int 0..2^62", "with `ring`: the exchange's number, the "
                                  "same on every replica (numbers the ring's collectives)",
                                  optional=True, check=_between(0, MAX_SEQ // 4))
    report: bool = _field("bool", "with `ring`: reply with the exchange's integer sums",
                          default=False)

    def __attrs_post_init__(self) -> None:
        _in_order(self)
        if self.ring is not None and (self.send is None or self.exchange is None):
            raise ValueError("ring needs send and exchange")


@attrs.frozen(kw_only=True)
class ReplicaGetRequest:
    """Hand over the whole replica (a live one, to heal a newcomer)."""

    seq: int = _seq(0)


def _replica_field(doc: str) -> Any:
    return _field("state", doc)


@attrs.frozen(kw_only=True)
class ReplicaPutRequest:
    """Become the replica a live peer handed over (``replica_get``'s reply)."""

    seq: int = _seq(0)
    anchor: State = _replica_field("the global model the replicas hold")
    local: State = _replica_field("the donor's own model")
    optimizer: State = _replica_field("the donor's inner optimizer state (the task's "
                                      "`optimizer_state()`; {} for a stateless one)")
    snapshot: State = _replica_field("the pending fragments' snapshots")
    pending: Integers = _field("list of int", "the fragments whose update is pending",
                               check=_fragment_list)
    inner_steps: int = _field("int 0..2^63-1", "inner steps the donor has run",
                              check=_between(0, MAX_SEQ))
    fragments: int = _fragments()
    bits: int = _bits()
    outer: State | None = _field("{name, options}", "over the ring (`exchange = \"ring\"`): "
                                 "the outer optimizer each replica steps itself (absent: "
                                 "the star steps it)", optional=True)
    outer_state: State | None = _field("state", "with `outer`: each fragment p's optimizer "
                                       "state under `outer{p}/`", optional=True)


# -- replies --------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ReplicaInitReply:
    """The replica's model digest."""

    seq: int = _seq()
    digest: str = _digest("SHA-256 of the anchor (`meshkit.train.state_digest`)")


@attrs.frozen(kw_only=True)
class InnerReply:
    """The inner steps' work, the anchor's digest after the updates, and the pseudo-gradient."""

    seq: int = _seq()
    examples: int = _examples("rows the inner steps trained on")
    metrics: Metrics = _field("metrics", "`train_loss`: the inner steps' mean")
    digest: str = _digest("SHA-256 of the anchor once the updates are applied")
    codes: State | None = _field("state", "fragment `send`'s pseudo-gradient, encoded at "
                                          "`bits` (only with `send`)", optional=True)
    scales: State | None = _field("state", "its block scales (only with `send`)",
                                  optional=True)
    ring_bytes: int | None = _field("int 0..2^63-1", "with `ring`: bytes this replica's "
                                    "transport sent for the exchange", optional=True,
                                    check=_between(0, MAX_SEQ))
    applied: str | None = _field("str, 64 hex chars", "with `ring`: SHA-256 of the anchor "
                                 "once the exchange's update is applied", optional=True,
                                 check=_length(DIGEST_CHARS, DIGEST_CHARS))
    totals: State | None = _field("state", "with `report`: per key, the integer sum of the "
                                  "replicas' codes on the shared scales", optional=True)
    shared: State | None = _field("state", "with `report`: per key, the shared block scales",
                                  optional=True)


@attrs.frozen(kw_only=True)
class ReplicaGetReply:
    """The whole replica, and the digests a newcomer must reproduce."""

    seq: int = _seq()
    anchor: State = _replica_field("the global model the replicas hold")
    local: State = _replica_field("this replica's own model")
    optimizer: State = _replica_field("its inner optimizer state")
    snapshot: State = _replica_field("the pending fragments' snapshots")
    pending: Integers = _field("list of int", "the fragments whose update is pending",
                               check=_fragment_list)
    inner_steps: int = _field("int 0..2^63-1", "inner steps run", check=_between(0, MAX_SEQ))
    digest: str = _digest("SHA-256 of the anchor")
    replica_digest: str = _digest("SHA-256 over anchor, local model, optimizer state and "
                                  "snapshots")


@attrs.frozen(kw_only=True)
class ReplicaPutReply:
    """The digests of what the newcomer now holds (equal to the donor's, or the heal failed)."""

    seq: int = _seq()
    digest: str = _digest("SHA-256 of the anchor")
    replica_digest: str = _digest("SHA-256 over everything taken over")


LOCAL_SGD_REQUESTS: dict[str, type] = {
    "replica_init": ReplicaInitRequest,
    "inner": InnerRequest,
    "replica_get": ReplicaGetRequest,
    "replica_put": ReplicaPutRequest,
}
LOCAL_SGD_REPLIES: dict[str, type] = {
    "replica_init": ReplicaInitReply,
    "inner": InnerReply,
    "replica_get": ReplicaGetReply,
    "replica_put": ReplicaPutReply,
}
