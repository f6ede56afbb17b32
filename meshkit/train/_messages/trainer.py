"""The trainer messages: what rank 0 asks a worker (tag TAG_REQUEST), and each reply.

docs/protocol.md §7 lists these classes as tables (:func:`.check.field_table`).
"""

from __future__ import annotations

from typing import Any

import attrs


from meshkit.train._messages.fields import (MAX_BATCH, MAX_BUDGET, MAX_COUNT, MAX_ERROR, MAX_NAME,
                                            MAX_SEED, MAX_SEQ, MIN_SEQ, Activation, Compress, Metrics,
                                            Poison,
                                            State, _between, _examples, _field, _in_order, _length,
                                            _name, _seq, _shard, _shards)


#: A SHA-256 digest in hex.
DIGEST = 64
#: The most pieces one result is cut into, and the largest piece (1 TiB).
MAX_PIECES = 2**31 - 1
MAX_PIECE_BYTES = 2**40


# -- requests (rank 0 -> worker, tag TAG_REQUEST) ----------------------------------------------


@attrs.frozen(kw_only=True)
class SetStateRequest:
    """The round's global model, sent once per worker per round."""

    seq: int = _seq(0)
    state: State = _field("state", "the model; discards every result an earlier round kept")
    trainable: list[str] | None = _field(
        "list of str", "`[strategy] trainable`: the keys that train; `state` then replaces "
        "only its own keys of the model the worker holds (after the first round it holds "
        "only these), and fits answer with only these keys", optional=True,
        check=lambda _, attribute, value: _key_names(value))
    digest: str | None = _field(
        "str, 64 hex chars", "`[compression] broadcast`: SHA-256 (`meshkit.train.state_digest`) "
        "of the model the worker holds after this request; a delta is applied only when the "
        "model it makes has this digest", optional=True, check=_length(DIGEST, DIGEST))
    base: str | None = _field(
        "str, 64 hex chars", "`[compression] broadcast`: `state` is a compressed delta (the "
        "`fit` reply's payload layout) against the model with this digest; a worker that "
        "does not hold it changes nothing and answers `stale`", optional=True,
        check=_length(DIGEST, DIGEST))
    compress: Compress | None = _field("compressor", "with `base`: the compressor that "
                                       "decodes the delta, and the keys it carries whole",
                                       optional=True)

    def __attrs_post_init__(self) -> None:
        if self.base is not None and (self.digest is None or self.compress is None
                                      or self.trainable is not None):
            raise ValueError("a delta (base) needs digest and compress, and no trainable")
        if self.digest is not None and self.trainable is not None:
            raise ValueError("a broadcast set_state (digest) carries no trainable")


@attrs.frozen(kw_only=True)
class FitRequest:
    """Train on one client's shard from the worker's model (or from ``state``)."""

    seq: int = _seq(0)
    shard: int = _shard()
    shards: int = _shards()
    seed: int = _field("int 0..2^64-1", "the fit's seed: a function of (run seed, round, client)",
                       check=_between(0, MAX_SEED))
    state: State | None = _field("state", "the model to start from (default: the worker's)",
                                 optional=True)
    set_state: bool = _field("bool", "true: the worker first holds `state` as a `set_state` "
                             "with the same `state` and `trainable` would (discarding every "
                             "result an earlier round kept), then fits from it: the round's "
                             "model goes with each worker's first fit of the round",
                             default=False)
    trainable: list[str] | None = _field(
        "list of str", "with `set_state`: as `set_state`'s", optional=True,
        check=lambda _, attribute, value: _key_names(value))
    keep: int | None = _field("int 0..2^63-1", "keep the result on the worker under this key "
                                     "(the reply then carries `kept`)",
                              optional=True, check=_between(0, MAX_SEQ))
    time_budget: float | None = _field("float (0, 1e7]", "seconds the fit may take; it "
                                                         "reports the examples it got through",
                                       optional=True, check=_between(1e-9, MAX_BUDGET))
    local: State | None = _field("state", "the client's own values of the `local_keys` "
                                          "(FedBN), in place of the model's", optional=True)
    poison: Poison | None = _field("attack", "a simulated attacker's data poisoning "
                                             "(`[attack]`, docs/robustness.md): the worker "
                                             "trains on poisoned data",
                                   optional=True)
    clip_norm: float | None = _field("float (0, 1e300]", "`[privacy] clip = \"client\"`: "
                                     "clip the update (fitted minus starting model) to this "
                                     "L2 norm before replying or keeping it; the reply's "
                                     "`metrics.unclipped` says whether it was within",
                                     optional=True, check=_between(1e-300, 1e300))
    compress: Compress | None = _field("compressor", "`[compression]`: reply with (or keep) "
                                       "the update compressed by this compressor, every key "
                                       "but `raw` (docs/compression.md, the payload); `local` "
                                       "then also carries the client's residuals -- or, "
                                       "`compress.residual`, the worker keeps them",
                                       optional=True)

    def __attrs_post_init__(self) -> None:
        _in_order(self)
        if self.set_state and self.state is None:
            raise ValueError("set_state = true needs the model in `state`")
        if self.trainable is not None and not self.set_state:
            raise ValueError("trainable goes with set_state = true (it says how the worker "
                             "holds `state`)")


@attrs.frozen(kw_only=True)
class GradsRequest:
    """Gradients of the worker's replica on a shard's (seeded) batch."""

    seq: int = _seq(0)
    shard: int = _shard()
    shards: int = _shards()
    seed: int = _field("int 0..2^64-1", "seeds the batch drawn from the shard",
                       check=_between(0, MAX_SEED))
    batch_size: int = _field("int 0..2^31", "rows per batch; 0: the whole shard", default=0,
                             check=_between(0, MAX_COUNT))
    keep: int | None = _field("int 0..2^63-1", "keep the gradients on the worker under this key",
                              optional=True, check=_between(0, MAX_SEQ))

    def __attrs_post_init__(self) -> None:
        _in_order(self)


@attrs.frozen(kw_only=True)
class StepRequest:
    """Gradients, all-reduced among ``ranks`` over the mesh, applied to the replica."""

    seq: int = _seq(0)
    shard: int = _shard()
    shards: int = _shards()
    seed: int = _field("int 0..2^64-1", "seeds the batch drawn from the shard",
                       check=_between(0, MAX_SEED))
    ranks: list[int] = _field("list of int >= 1", "the replicas that all-reduce together "
                                                  "(distinct)")
    batch_size: int = _field("int 0..2^31", "rows per batch; 0: the whole shard", default=0,
                             check=_between(0, MAX_COUNT))

    def __attrs_post_init__(self) -> None:
        _in_order(self)
        if not self.ranks or len(set(self.ranks)) != len(self.ranks) or not all(
                1 <= r < MAX_COUNT for r in self.ranks):
            raise ValueError(f"ranks must be distinct worker ranks (>= 1), got {self.ranks}")


@attrs.frozen(kw_only=True)
class TakeRequest:
    """Hand over (and forget) the result kept under ``key``."""

    seq: int = _seq(0)
    key: int = _field("int 0..2^63-1", "the `keep` key of an earlier fit or grads",
                      check=_between(0, MAX_SEQ))
    piece: int | None = _field(
        "int 0..2^31-1", "hand over only this piece of the result (its float arrays cut in "
        "`piece_bytes`, docs/protocol.md); the result is forgotten when its last piece is taken",
        optional=True, check=_between(0, MAX_PIECES))
    piece_bytes: int | None = _field(
        "int 1..2^40", "the size of a piece, in bytes (with `piece`)", optional=True,
        check=_between(1, MAX_PIECE_BYTES))

    def __attrs_post_init__(self) -> None:
        if (self.piece is None) != (self.piece_bytes is None):
            raise ValueError("`piece` and `piece_bytes` go together")


@attrs.frozen(kw_only=True)
class ApplyRequest:
    """One optimizer step of the replica with the round's mean gradients."""

    seq: int = _seq(0)
    gradients: State = _field("state", "the mean gradients to apply")


@attrs.frozen(kw_only=True)
class GetStateRequest:
    """The worker's model (a data-parallel replica, read back after a step)."""

    seq: int = _seq(0)


@attrs.frozen(kw_only=True)
class HeldOutRequest:
    """How many held-out examples the worker's task has (checked before clients evaluate)."""

    seq: int = _seq(0)


@attrs.frozen(kw_only=True)
class EvaluateRequest:
    """Evaluate the worker's model (or ``state``) on a client's share of the held-out set."""

    seq: int = _seq(0)
    shard: int = _shard()
    shards: int = _shards()
    state: State | None = _field("state", "the model to evaluate (default: the worker's)",
                                 optional=True)
    local: State | None = _field("state", "the client's own values of the `local_keys` "
                                          "(FedBN), in place of the model's", optional=True)

    def __attrs_post_init__(self) -> None:
        _in_order(self)


def _key_names(value: list[str] | None) -> None:
    if value is None:
        return
    if not isinstance(value, list) or not value or len(value) > MAX_COUNT \
            or len(set(value)) != len(value):
        raise ValueError("trainable must name at least one state key, each once")
    for key in value:
        _name(key, "a state key")


def _nodes(_: Any, attribute: Any, value: list[str]) -> None:
    if not value or len(value) > MAX_COUNT:
        raise ValueError(f"{attribute.name} must name at least one stage node")
    for node in value:
        _name(node, "a stage node")


@attrs.frozen(kw_only=True)
class StageRequest:
    """Run pipeline stage nodes in order on an activation (model-parallel)."""

    seq: int = _seq(0)
    nodes: list[str] = _field("list of str", "the stage's nodes, in order (each 1..1024 "
                                             "chars)", check=_nodes)
    x: Activation = _field("array", "the activation into the first node")
    state: State = _field("state", "the stage's keys of the model", default=attrs.Factory(dict))


@attrs.frozen(kw_only=True)
class StopRequest:
    """The run is over: the worker returns (no reply)."""

    seq: int = _field("int -2^63..2^63-1", "0 (stop is never answered)", default=0,
                      check=_between(MIN_SEQ, MAX_SEQ))


@attrs.frozen(kw_only=True)
class BatchFit:
    """One client's fit inside a ``fit_batch``: a ``fit`` request's fields, and its key."""

    key: int = _field("int 0..2^63-1", "the client's key (the fold's)",
                      check=_between(0, MAX_SEQ))
    shard: int = _shard()
    shards: int = _shards()
    seed: int = _field("int 0..2^64-1", "the fit's seed", check=_between(0, MAX_SEED))
    time_budget: float | None = _field("float (0, 1e7]", "as a fit's", optional=True,
                                       check=_between(1e-9, MAX_BUDGET))
    poison: Poison | None = _field("attack", "as a fit's", optional=True)
    clip_norm: float | None = _field("float (0, 1e300]", "as a fit's", optional=True,
                                     check=_between(1e-300, 1e300))

    def __attrs_post_init__(self) -> None:
        _in_order(self)


def _fits(_: Any, attribute: Any, value: list[BatchFit]) -> None:
    if not 1 <= len(value) <= MAX_BATCH:
        raise ValueError(f"{attribute.name} holds {len(value)} fits; 1 to {MAX_BATCH} are "
                         f"allowed")
    keys = [fit.key for fit in value]
    if len(set(keys)) != len(keys):
        raise ValueError(f"{attribute.name} names a key twice: {sorted(keys)[:8]}")


@attrs.frozen(kw_only=True)
class FitBatchRequest:
    """Fit these clients one after another from the worker's model and fold each into the
    worker's exact partial sum for the round (``take_partial`` hands it over); with
    ``compress``, answer with each fit's compressed payload instead."""

    seq: int = _seq(0)
    fits: list[BatchFit] = _field("list of fit", "1..4096 fits, each `{key, shard, shards, "
                                  "seed}` with a fit's optional `time_budget`, `poison`, "
                                  "`clip_norm`; keys distinct", check=_fits)
    weight: str | None = _field("str", "each fit's weight in the sum: `examples` (its "
                                "realized work) or `once` (1); required unless `compress` "
                                "(and with `compress.clip_range`)",
                                optional=True, check=attrs.validators.in_(("examples", "once")))
    fraction_bits: int | None = _field("int 0..62", "the sum's fixed-point resolution, 2^-bits "
                                       "(`meshkit.aggregation.FixedPointSum`); required unless "
                                       "`compress`", optional=True, check=_between(0, 62))
    label: str = _field("str, 1..1024 chars", "what a contribution is called in errors "
                                              "(`client`)", check=_length(1, MAX_NAME))
    dp_clip: float | None = _field("float (0, 1e300]", "a private round (`[privacy]`): fold "
                                   "each fit's *update*, clipped to this L2 norm, into an exact "
                                   "sum of updates (`meshkit.privacy.ClippedSum`; weight "
                                   "`once`, `fraction_bits` its `clip_bits`) instead of its "
                                   "model; each result's `metrics.unclipped` says whether it "
                                   "was within", optional=True, check=_between(1e-300, 1e300))
    compress: Compress | None = _field("compressor", "`[compression]`: fold nothing; the "
                                       "reply's `payloads` carry each fit's compressed "
                                       "payload, as a compressed `fit` reply's `state`; with "
                                       "`clip_range`, no payloads: each fit's codes on "
                                       "`[-clip_range, clip_range]` go into the worker's one "
                                       "exact sum, weighed by `weight` "
                                       "(`meshkit.compression.CodeSum`, `take_partial`)",
                                       optional=True)
    locals: State | None = _field("state", "with `compress`: each fit's `local` (a fit's: the "
                                  "client's residuals), entry `NAME` of fit `KEY` as `KEY/NAME`",
                                  optional=True)

    def __attrs_post_init__(self) -> None:
        if self.compress is not None and "residual" in self.compress:
            raise ValueError("a batch's compress names no residual: a client whose residual "
                             "its worker keeps is served by a fit of its own")
        grid = self.compress is not None and "clip_range" in self.compress
        if grid:
            if self.weight is None or self.fraction_bits is not None or self.locals:
                raise ValueError("a batch summed on the shared grid (compress.clip_range) "
                                 "weighs its fits (weight), with no fraction_bits or locals")
        elif (self.compress is None) != (self.weight is not None
                                         and self.fraction_bits is not None):
            raise ValueError("a batch folds its fits with weight and fraction_bits, and only "
                             "then: a compressed batch (compress) carries neither")
        if self.compress is not None and self.dp_clip is not None:
            raise ValueError("a compressed batch (compress) folds nothing, so no dp_clip")
        if self.locals is not None and self.compress is None:
            raise ValueError("locals go only with a compressed batch (compress)")
        if self.dp_clip is not None and self.weight != "once":
            raise ValueError("dp_clip: a private round's sum weighs every fit once "
                             f"(weight = 'once'), got weight = {self.weight!r}")


@attrs.frozen(kw_only=True)
class TakePartialRequest:
    """Hand over (and forget) the round's partial sum of every fit folded since the last."""

    seq: int = _seq(0)


#: op -> the request's schema.
TRAINER_REQUESTS: dict[str, type] = {
    "set_state": SetStateRequest,
    "fit": FitRequest,
    "grads": GradsRequest,
    "step": StepRequest,
    "take": TakeRequest,
    "apply": ApplyRequest,
    "get_state": GetStateRequest,
    "held_out": HeldOutRequest,
    "evaluate": EvaluateRequest,
    "stage": StageRequest,
    "stop": StopRequest,
    "fit_batch": FitBatchRequest,
    "take_partial": TakePartialRequest,
}

# -- replies (worker -> rank 0, tag TAG_REPLY) ---------------------------------------------


@attrs.frozen(kw_only=True)
class AckReply:
    """Done (``set_state``, ``apply``)."""

    seq: int = _seq()


@attrs.frozen(kw_only=True)
class SetStateReply:
    """Done; or, under `[compression] broadcast`, the delta could not be applied."""

    seq: int = _seq()
    stale: str | None = _field("str, 1..65536 chars", "the delta's `base` is not the model "
                               "this worker holds, or it decoded to another `digest`: "
                               "nothing changed, and rank 0 sends the whole model",
                               optional=True, check=_length(1, MAX_ERROR))


@attrs.frozen(kw_only=True)
class ErrorReply:
    """The request could not be served (any op): the worker's message."""

    seq: int = _seq()
    error: str = _field("str, 1..65536 chars", "what went wrong, for a person",
                        check=_length(1, MAX_ERROR))
    reason: str | None = _field("str", "`aggregation`: the worker's own fold refused a "
                                       "contribution (`fit_batch`: NaN, a range overflow); "
                                       "`nonfinite`: a fit's metrics are not finite (the "
                                       "model diverged: rank 0 follows `on_nonfinite`); "
                                       "absent: the request failed. Rank 0 drops the rank "
                                       "for the round (`accept_failures`)",
                                optional=True,
                                check=attrs.validators.in_(("aggregation", "nonfinite")))
    key: int | None = _field("int 0..2^63-1", "`fit_batch`: the key of the fit that failed "
                                              "(a client failing on two ranks is its own "
                                              "failure)",
                             optional=True, check=_between(0, MAX_SEQ))


def _metrics_field(doc: str) -> Any:
    return _field("metrics", doc)


def _kept() -> Any:
    return _field("int 0..2^63-1", "the request's `keep`; only with `keep`", optional=True,
                  check=_between(0, MAX_SEQ))


@attrs.frozen(kw_only=True)
class FitReply:
    """A fit's realized work; its result itself, or the key it is kept under."""

    seq: int = _seq()
    examples: int = _examples("examples the fit processed (its fedavg weight)")
    metrics: Metrics = _metrics_field("the fit's metrics (`train_loss`, ...)")
    state: State | None = _field("state", "the fitted model; only without `keep`",
                                 optional=True)
    kept: int | None = _kept()
    attacked: str | None = _field("str, 1..1024 chars", "the attack this fit ran (a node started "
                                                 "with `--attack`, or a `poison` request): "
                                                 "rank 0 lists the client in `attacked`",
                                  optional=True, check=_length(1, MAX_NAME))


@attrs.frozen(kw_only=True)
class GradsReply:
    """A batch's gradients (or the key they are kept under)."""

    seq: int = _seq()
    examples: int = _examples("rows the gradients were computed on")
    metrics: Metrics = _metrics_field("the batch's metrics")
    gradients: State | None = _field("state", "the gradients; only without `keep`",
                                     optional=True)
    kept: int | None = _kept()


@attrs.frozen(kw_only=True)
class StepReply:
    """A mesh step's realized work (the replica has applied the mean)."""

    seq: int = _seq()
    examples: int = _examples("rows this replica's gradients were computed on")
    metrics: Metrics = _metrics_field("the batch's metrics")
    ring_bytes: int | None = _field("int 0..2^63-1", "bytes this replica's transport sent "
                                    "during the all-reduce (absent: it does not count them)",
                                    optional=True, check=_between(0, MAX_SEQ))


@attrs.frozen(kw_only=True)
class StateReply:
    """A model (``take``: the kept result, now forgotten; ``get_state``: the worker's)."""

    seq: int = _seq()
    state: State = _field("state", "the model, or the kept gradients")


@attrs.frozen(kw_only=True)
class HeldOutReply:
    """The size of the worker's held-out set."""

    seq: int = _seq()
    examples: int = _examples("held-out examples the task has (0: none)")


@attrs.frozen(kw_only=True)
class EvaluateReply:
    """A client's evaluation on its share of the held-out set."""

    seq: int = _seq()
    examples: int = _examples("held-out examples evaluated on")
    metrics: Metrics = _metrics_field("the evaluation's metrics ({} when there were none)")


@attrs.frozen(kw_only=True)
class StageReply:
    """The stage's output activation."""

    seq: int = _seq()
    x: Activation = _field("array", "the activation out of the last node")


@attrs.frozen(kw_only=True)
class BatchResult:
    """One fit of a ``fit_batch``: its key, realized work and metrics (the result is folded)."""

    key: int = _field("int 0..2^63-1", "the fit's key", check=_between(0, MAX_SEQ))
    examples: int = _examples("examples the fit processed")
    metrics: Metrics = _metrics_field("the fit's metrics")
    attacked: str | None = _field("str, 1..1024 chars", "as a fit's", optional=True,
                                  check=_length(1, MAX_NAME))


@attrs.frozen(kw_only=True)
class FitBatchReply:
    """Each fit's realized work, in the request's order; the results are in the partial (with
    ``compress``: in ``payloads``)."""

    seq: int = _seq()
    results: list[BatchResult] = _field("list of result", "one `{key, examples, metrics, "
                                        "attacked?}` per fit asked for, in its order")
    payloads: State | None = _field("state", "when the batch asked for `compress` (and only "
                                    "then): each fit's compressed payload, entry `NAME` of "
                                    "fit `KEY` as `KEY/NAME`", optional=True)


@attrs.frozen(kw_only=True)
class PartialReply:
    """The worker's partial sum for the round (then forgotten)."""

    seq: int = _seq()
    partial: State = _field("state", "`FixedPartial.to_wire()`: `fraction_bits`, `mass`, "
                                     "`count` and int64 sums (docs/strategies.md, \"The round "
                                     "engine\"); after grid batches (`compress.clip_range`) "
                                     "`CodeSum.to_wire()`: `bits`, `mass`, `count`, each "
                                     "key's integer sum packed at `bits` (`sum/KEY`), the "
                                     "keys sent whole's partial (`whole/...`)")


#: op -> the schema of its reply (besides :class:`ErrorReply`, which any op may get).
TRAINER_REPLIES: dict[str, type] = {
    "set_state": SetStateReply,
    "fit": FitReply,
    "grads": GradsReply,
    "step": StepReply,
    "take": StateReply,
    "apply": AckReply,
    "get_state": StateReply,
    "held_out": HeldOutReply,
    "evaluate": EvaluateReply,
    "stage": StageReply,
    "fit_batch": FitBatchReply,
    "take_partial": PartialReply,
}
