"""Every trainer message's schema: what a request and a reply may hold, checked where it enters.

Rule: a trainer message (:mod:`meshkit.train._protocol`) is used only after
it was checked here, against the one attrs class declared for it -- its
fields, their types and their bounds -- structured by one cattrs converter
with ``forbid_extra_keys``. What does not fit is a
:class:`~meshkit.ProtocolError` for its sender:

* a reply, where the coordinator's pools take it in
  (:class:`~meshkit.train.GroupPool`, :class:`~meshkit.train.LocalPool`):
  the rank is declared dead in the ledger with the reason, and the round
  engine serves its clients on the live workers -- never an exception in
  the coordinator;
* a request, where the worker takes it in (:meth:`Trainer.handle`): it is
  answered with ``{"error": ...}`` and the worker serves on.

A contribution is also checked against the round's model
(:func:`check_contribution`): the same keys, and each array the same shape
and dtype, since the fold and the outer step need exactly that.

The check is cheap per message: a handful of fields, and per state one pass
over its keys (no pass over array elements; the wire bounded every length
before allocating, and the fold checks finiteness while it sums). The
converter is built once, at import.

``docs/protocol.md`` §7 lists these classes as tables; a test
(``tests/train/test_messages.py``) parses those tables and compares them
with :func:`field_table`, so the page and the code cannot drift apart.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, NewType, Optional

import attrs
import cattrs
import numpy as np

from meshkit.errors import ProtocolError
from meshkit.secure_aggregation import MAX_CLIENT_ID, MAX_CLIENTS, MAX_LENGTH, MAX_ROW

__all__ = [
    "REQUESTS",
    "REPLIES",
    "ErrorReply",
    "check_request",
    "check_reply",
    "check_contribution",
    "nonfinite_leaf",
    "signature",
    "field_table",
    "MAX_EXAMPLES",
    "MAX_CLIENT_ID",
]

# -- bounds ------------------------------------------------------------------------------

#: The most examples one reply may claim: exactly representable as a float64.
MAX_EXAMPLES = 2 ** 53
#: The most entries a state (a model, gradients) may have.
MAX_STATE_KEYS = 1 << 20
#: The longest state key, metric name or stage node name (characters).
MAX_NAME = 1024
#: The most metrics one reply may carry.
MAX_METRICS = 256
#: The longest error message a worker may send (characters).
MAX_ERROR = 1 << 16
#: Shards, clients, ranks and stage nodes: at most this many.
MAX_COUNT = 1 << 31
#: The longest time budget a fit may be given (seconds: about four months).
MAX_BUDGET = 1e7
#: The most fits one ``fit_batch`` may carry (the engine sends far fewer).
MAX_BATCH = 4096
#: Seeds are unsigned 64-bit integers.
MAX_SEED = 2 ** 64 - 1
#: Kept-result keys are integers 0..MAX_SEQ; sequence numbers signed 64-bit
#: integers (a host relay numbers its own requests below zero).
MAX_SEQ = 2 ** 63 - 1
MIN_SEQ = -(2 ** 63)

# -- the value types beyond JSON's -----------------------------------------------------------

#: A model state: ``name -> array | JSON value`` (docs/protocol.md: "state").
State = NewType("State", dict)
#: Task metrics: ``name -> finite number``.
Metrics = NewType("Metrics", dict)
#: A pipeline activation: an array (or a JSON number or list).
Activation = NewType("Activation", object)
#: A simulated attacker's data poisoning: ``{"name": ATTACK, "options": {key: JSON value}}``.
Poison = NewType("Poison", dict)

#: Secure aggregation (``secagg_*``): client ids, sorted and distinct.
ClientIds = NewType("ClientIds", list)
#: Secure aggregation: a list of integers (ids in any order, seeds, kinds).
Integers = NewType("Integers", list)
#: Secure aggregation: rows of bytes, a 2-d uint8 array (one key, share or sealed share a row).
Rows = NewType("Rows", object)
#: Secure aggregation: a masked vector, 1-d uint32 or uint64 (integers mod 2**modulus_bits).
Masked = NewType("Masked", object)

_JSON_LEAVES = (int, float, str, bool, type(None), list, dict)


def _integer(value: Any, _: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"expected an integer, got {_shown(value)}")
    return int(value)


def _number(value: Any, _: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"expected a number, got {_shown(value)}")
    return float(value)


def _string(value: Any, _: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {_shown(value)}")
    return value


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME:
        raise ValueError(f"{what} must be a string of 1 to {MAX_NAME} characters, got "
                         f"{_shown(value)}")
    return value


def _state(value: Any, _: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"expected a state (name -> array or JSON value), got {_shown(value)}")
    if len(value) > MAX_STATE_KEYS:
        raise ValueError(f"a state of {len(value)} entries; at most {MAX_STATE_KEYS}")
    for key, leaf in value.items():
        _name(key, "a state key")
        if not isinstance(leaf, (np.ndarray, *_JSON_LEAVES)):
            raise TypeError(f"state key {key!r} holds {_shown(leaf)}, not an array or a "
                            f"JSON value")
    return value


def _metrics(value: Any, _: Any) -> dict[str, float]:
    if not isinstance(value, Mapping):
        raise TypeError(f"expected metrics (name -> number), got {_shown(value)}")
    if len(value) > MAX_METRICS:
        raise ValueError(f"{len(value)} metrics; at most {MAX_METRICS}")
    out: dict[str, float] = {}
    for name, number in value.items():
        _name(name, "a metric name")
        if isinstance(number, bool) or not isinstance(number, (int, float, np.number)):
            raise TypeError(f"metric {name!r} is {_shown(number)}, not a number")
        if not math.isfinite(float(number)):
            raise ValueError(f"metric {name!r} is {float(number)!r}; metrics must be finite")
        out[name] = float(number)
    return out


def _poison(value: Any, _: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping) or "name" not in value or set(value) - {"name", "options"}:
        raise TypeError(f"expected an attack {{name, options}}, got {_shown(value)}")
    _name(value["name"], "the attack's name")
    options = value.get("options") or {}
    if not isinstance(options, Mapping) or len(options) > MAX_METRICS:
        raise ValueError(f"the attack's options must be an object of at most {MAX_METRICS} "
                         f"entries, got {_shown(options)}")
    for key, leaf in options.items():
        _name(key, "an attack option")
        if not isinstance(leaf, _JSON_LEAVES):
            raise TypeError(f"attack option {key!r} is {_shown(leaf)}, not a JSON value")
    return {"name": value["name"], "options": dict(options)}


def _client_ids(value: Any, _: Any) -> list[int]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list of client ids, got {_shown(value)}")
    if len(value) > MAX_CLIENTS:
        raise ValueError(f"{len(value)} client ids; at most {MAX_CLIENTS}")
    ids = [_integer(v, None) for v in value]
    if any(not 0 <= v <= MAX_CLIENT_ID for v in ids) or ids != sorted(set(ids)):
        raise ValueError(f"client ids must be distinct integers 0..{MAX_CLIENT_ID}, ascending")
    return ids


def _integers(value: Any, _: Any) -> list[int]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list of integers, got {_shown(value)}")
    if len(value) > MAX_COUNT:
        raise ValueError(f"{len(value)} integers; at most {MAX_COUNT}")
    return [_integer(v, None) for v in value]


def _rows(value: Any, _: Any) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.dtype != np.uint8 or value.ndim != 2:
        raise TypeError(f"expected rows of bytes (a 2-d uint8 array), got {_shown(value)}")
    return value


def _masked(value: Any, _: Any) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.ndim != 1 or value.dtype not in (
            np.dtype(np.uint32), np.dtype(np.uint64)) or not 0 < value.size <= MAX_LENGTH:
        raise TypeError(f"expected a masked vector (a 1-d uint32 or uint64 array of 1 to "
                        f"{MAX_LENGTH} elements), got {_shown(value)}")
    return value


def _activation(value: Any, _: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (np.ndarray, list, int, float)):
        raise TypeError(f"expected an activation (an array), got {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    """A value as an error message shows it: its type, and the value when it is short."""
    if isinstance(value, np.ndarray):
        return f"an array {value.dtype}{list(value.shape)}"
    if isinstance(value, (bool, int, float, str, type(None))):
        text = repr(value)
        if len(text) <= 40:
            return f"{type(value).__name__} {text}"
    return type(value).__name__


def _converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook(int, _integer)
    converter.register_structure_hook(float, _number)
    converter.register_structure_hook(str, _string)
    converter.register_structure_hook(State, _state)
    converter.register_structure_hook(Metrics, _metrics)
    converter.register_structure_hook(Activation, _activation)
    converter.register_structure_hook(Poison, _poison)
    converter.register_structure_hook(ClientIds, _client_ids)
    converter.register_structure_hook(Integers, _integers)
    converter.register_structure_hook(Rows, _rows)
    converter.register_structure_hook(Masked, _masked)
    return converter


# -- fields ------------------------------------------------------------------------------------


def _between(low: float, high: float) -> Callable[[Any, Any, Any], None]:
    def check(_: Any, attribute: Any, value: Any) -> None:
        if not low <= value <= high:
            raise ValueError(f"{attribute.name} = {value!r} is out of range [{low}, {high}]")
    return check


def _length(low: int, high: int) -> Callable[[Any, Any, Any], None]:
    def check(_: Any, attribute: Any, value: Any) -> None:
        if not low <= len(value) <= high:
            raise ValueError(f"{attribute.name} has {len(value)} characters; {low} to {high} "
                             f"are allowed")
    return check


def _field(wire: str, doc: str, *, optional: bool = False, default: Any = attrs.NOTHING,
           check: Callable[[Any, Any, Any], None] | None = None) -> Any:
    """A message field: its wire type and meaning (docs/protocol.md shows both)."""
    validator = None if check is None else (attrs.validators.optional(check) if optional
                                            else check)
    if optional and default is attrs.NOTHING:
        default = None
    return attrs.field(default=default, validator=validator,
                       metadata={"wire": wire, "doc": doc})


def _seq(default: Any = attrs.NOTHING) -> Any:
    return _field("int -2^63..2^63-1", "the request's ticket, echoed by its reply (a host "
                  "relay numbers its own below 0)", default=default,
                  check=_between(MIN_SEQ, MAX_SEQ))


def _shard() -> Any:
    return _field("int 0..shards-1", "which shard (client) of `shards`",
                  check=_between(0, MAX_COUNT))


def _shards() -> Any:
    return _field("int 1..2^31", "how many shards the training (or held-out) set is cut into",
                  check=_between(1, MAX_COUNT))


def _examples(doc: str) -> Any:
    return _field("int 0..2^53", doc, check=_between(0, MAX_EXAMPLES))


def _in_order(message: Any) -> None:
    if message.shard >= message.shards:
        raise ValueError(f"shard {message.shard} of {message.shards}: shard must be below "
                         f"shards")


# -- requests (rank 0 -> worker, tag TAG_REQUEST) ----------------------------------------------


@attrs.frozen(kw_only=True)
class SetStateRequest:
    """The round's global model, sent once per worker per round."""

    seq: int = _seq(0)
    state: State = _field("state", "the model; discards every result an earlier round kept")


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

    def __attrs_post_init__(self) -> None:
        _in_order(self)


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
    worker's exact partial sum for the round (``take_partial`` hands it over)."""

    seq: int = _seq(0)
    fits: list[BatchFit] = _field("list of fit", "1..4096 fits, each `{key, shard, shards, "
                                  "seed}` with a fit's optional `time_budget`, `poison`, "
                                  "`clip_norm`; keys distinct", check=_fits)
    weight: str = _field("str", "each fit's weight in the sum: `examples` (its realized "
                                "work) or `once` (1)",
                         check=attrs.validators.in_(("examples", "once")))
    fraction_bits: int = _field("int 0..62", "the sum's fixed-point resolution, 2^-bits "
                                             "(`meshkit.aggregation.FixedPointSum`)",
                                check=_between(0, 62))
    label: str = _field("str, 1..1024 chars", "what a contribution is called in errors "
                                              "(`client`)", check=_length(1, MAX_NAME))


@attrs.frozen(kw_only=True)
class TakePartialRequest:
    """Hand over (and forget) the round's partial sum of every fit folded since the last."""

    seq: int = _seq(0)


#: op -> the request's schema.
REQUESTS: dict[str, type] = {
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
    """Each fit's realized work, in the request's order; the results are in the partial."""

    seq: int = _seq()
    results: list[BatchResult] = _field("list of result", "one `{key, examples, metrics, "
                                        "attacked?}` per fit asked for, in its order")


@attrs.frozen(kw_only=True)
class PartialReply:
    """The worker's partial sum for the round (then forgotten)."""

    seq: int = _seq()
    partial: State = _field("state", "`FixedPartial.to_wire()`: `fraction_bits`, `mass`, "
                                     "`count` and int64 sums (docs/strategies.md, \"The round "
                                     "engine\")")


#: op -> the schema of its reply (besides :class:`ErrorReply`, which any op may get).
REPLIES: dict[str, type] = {
    "set_state": AckReply,
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

# -- secure aggregation (``[secure_aggregation]``: meshkit.train._secure_round) ---------------

def _ids_field(doc: str) -> Any:
    return _field("client ids", doc)


def _width(rows: Any, width: int | None, what: str, count: int | None = None) -> None:
    """Rows of ``width`` bytes (None: the scheme's width, 1 to MAX_ROW, which the round
    checks against the scheme's traits), ``count`` of them when given."""
    if width is None and not 1 <= rows.shape[1] <= MAX_ROW:
        raise ValueError(f"{what} rows are {rows.shape[1]} bytes wide; they must be 1 to "
                         f"{MAX_ROW}")
    if width is not None and rows.shape[1] != width:
        raise ValueError(f"{what} rows are {rows.shape[1]} bytes wide; they must be {width}")
    if count is not None and rows.shape[0] != count:
        raise ValueError(f"{what} has {rows.shape[0]} rows for {count} entries")


def _aligned(message: Any, *names: str) -> None:
    counts = {name: len(getattr(message, name)) for name in names}
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"{name} has {count}" for name, count in counts.items())
        raise ValueError(f"{' and '.join(names)} must have one entry each per row: {shown}")


def _any_ids(_: Any, attribute: Any, value: list[int]) -> None:
    if not all(0 <= v <= MAX_CLIENT_ID for v in value):
        raise ValueError(f"{attribute.name} must hold client ids 0..{MAX_CLIENT_ID}")


@attrs.frozen(kw_only=True)
class SecAggKeysRequest:
    """Secure round, step 1: start a ClientRound for each of ``clients``; send their adverts."""

    seq: int = _seq(0)
    round: int = _field("int 0..2^31", "the round (named in logs and errors)",
                        check=_between(0, MAX_COUNT))
    clients: ClientIds = _ids_field("the clients this worker plays this round (1 or more)")
    cohort: int = _field("int 2..65536", "the cohort size the round is set up for",
                         check=_between(2, MAX_CLIENTS))
    degree: int = _field("int 0..65536", "neighbours per client (0: complete graph)",
                         check=_between(0, MAX_CLIENTS))
    threshold: int = _field("int 1..65536", "shares that rebuild a client's secret",
                            check=_between(1, MAX_CLIENTS))
    clip_range: float = _field("float (0, 1e12]", "each coordinate of an update is clipped to "
                               "[-clip_range, clip_range] before it is quantised",
                               check=_between(1e-300, 1e12))
    modulus_bits: int = _field("int 1..64", "masked vectors are integers mod 2^modulus_bits",
                               check=_between(1, 64))
    round_seed: Rows = _field("bytes 1x32", "the round's public seed (the graph, the keys' "
                                            "derivations)")
    length: int = _field("int 1..2^31", "elements of an update (the model's float arrays)",
                         check=_between(1, MAX_LENGTH))
    scheme: str | None = _field("string", "the `[secure_aggregation] name` of the round's scheme "
                                "(absent: the default, secagg+)", optional=True,
                                check=lambda _, a, v: None if _name(v, a.name) else None)

    def __attrs_post_init__(self) -> None:
        if not self.clients:
            raise ValueError("clients must name at least one client")
        _width(self.round_seed, 32, "round_seed", 1)


@attrs.frozen(kw_only=True)
class SecAggKeysReply:
    """Each client's fresh public keys and self-mask seed commitment."""

    seq: int = _seq()
    clients: ClientIds = _ids_field("the clients advertising, the request's")
    adverts: Rows = _field("bytes nxA", "per client: its advert (A: the scheme's advert_size; "
                                        "secagg+: share key, mask key, seed commitment, 32 "
                                        "bytes each)")

    def __attrs_post_init__(self) -> None:
        _width(self.adverts, None, "adverts", len(self.clients))


@attrs.frozen(kw_only=True)
class SecAggShareRequest:
    """Step 2: who advertised, with every advert; each client seals shares for its neighbours."""

    seq: int = _seq(0)
    members: ClientIds = _ids_field("every client that advertised (the graph's members)")
    adverts: Rows = _field("bytes nxA", "each member's advert, in `members` order")

    def __attrs_post_init__(self) -> None:
        _width(self.adverts, None, "adverts", len(self.members))


@attrs.frozen(kw_only=True)
class SecAggShareReply:
    """The sealed shares of this worker's clients, one row per (sender, recipient)."""

    seq: int = _seq()
    senders: Integers = _field("list of client ids", "the client that sealed each row",
                                check=_any_ids)
    recipients: Integers = _field("list of client ids", "the neighbour each row is sealed to",
                                   check=_any_ids)
    sealed: Rows = _field("bytes nxS", "the sealed rows (S: the scheme's sealed_size; secagg+: "
                                       "200, an ephemeral X25519 key, then AES-GCM)")

    def __attrs_post_init__(self) -> None:
        _aligned(self, "senders", "recipients")
        _width(self.sealed, None, "sealed", len(self.senders))


@attrs.frozen(kw_only=True)
class SecAggOpenRequest:
    """Step 3: the sealed shares delivered to this worker's clients, to open before anyone masks."""

    seq: int = _seq(0)
    clients: ClientIds = _ids_field("the clients the shares are for (each shared this round)")
    senders: Integers = _field("list of client ids", "who sealed each delivered row",
                                check=_any_ids)
    recipients: Integers = _field("list of client ids", "which of `clients` each row is for",
                                   check=_any_ids)
    sealed: Rows = _field("bytes nxS", "the sealed rows delivered to `clients`")

    def __attrs_post_init__(self) -> None:
        if not self.clients:
            raise ValueError("clients must name at least one client")
        _aligned(self, "senders", "recipients")
        _width(self.sealed, None, "sealed", len(self.senders))


@attrs.frozen(kw_only=True)
class SecAggOpenReply:
    """The accusations: each (sender, recipient) whose sealed share did not open."""

    seq: int = _seq()
    senders: Integers = _field("list of client ids", "the sealer of each share that did not "
                                "open", check=_any_ids)
    recipients: Integers = _field("list of client ids", "the client of this worker it did not "
                                   "open for", check=_any_ids)

    def __attrs_post_init__(self) -> None:
        _aligned(self, "senders", "recipients")


@attrs.frozen(kw_only=True)
class SecAggRevealRequest:
    """Step 3b, only after an accusation: the ephemeral keys this worker's clients sealed with."""

    seq: int = _seq(0)
    senders: Integers = _field("list of client ids", "the accused sealers (this worker's "
                                "clients)", check=_any_ids)
    recipients: Integers = _field("list of client ids", "the accusers, in `senders` order",
                                   check=_any_ids)

    def __attrs_post_init__(self) -> None:
        if not self.senders:
            raise ValueError("senders must name at least one client")
        _aligned(self, "senders", "recipients")


@attrs.frozen(kw_only=True)
class SecAggRevealReply:
    """The ephemeral private key each accused share was sealed with, in the request's order."""

    seq: int = _seq()
    keys: Rows = _field("bytes nxR", "the keys (R: the scheme's reveal_size; secagg+: 32, an "
                                     "X25519 ephemeral private key), each opening one sealed "
                                     "row, nothing else")

    def __attrs_post_init__(self) -> None:
        _width(self.keys, None, "keys")


@attrs.frozen(kw_only=True)
class SecAggMaskRequest:
    """Step 4: fit each client, then mask its quantised update with the neighbours that shared."""

    seq: int = _seq(0)
    clients: ClientIds = _ids_field("the clients to fit and mask (each shared this round)")
    seeds: Integers = _field("list of int 0..2^64-1", "each client's fit seed, in `clients` "
                              "order", check=lambda _, a, v: _each(a, v, 0, MAX_SEED))
    shards: int = _shards()
    excluded: ClientIds = _ids_field("clients taken out of the round after the shares were "
                                     "opened: nobody masks with them")
    time_budget: float | None = _field("float (0, 1e7]", "seconds each fit may take",
                                       optional=True, check=_between(1e-9, MAX_BUDGET))
    clip_norm: float | None = _field("float (0, 1e300]", "`[privacy] clip = \"client\"`: clip "
                                     "each update to this L2 norm first", optional=True,
                                     check=_between(1e-300, 1e300))

    def __attrs_post_init__(self) -> None:
        if not self.clients:
            raise ValueError("clients must name at least one client")
        _aligned(self, "clients", "seeds")
        if set(self.clients) & set(self.excluded):
            raise ValueError("a client to mask cannot be excluded")
        if any(c >= self.shards for c in self.clients):
            raise ValueError(f"a client id must be below shards = {self.shards}")


@attrs.frozen(kw_only=True)
class SecAggMaskReply:
    """The modular sum of this worker's clients' masked inputs (a worker folds its own)."""

    seq: int = _seq()
    clients: ClientIds = _ids_field("the clients whose masked inputs `vector` adds up")
    vector: Masked = _field("uint32 or uint64 array", "their masked inputs' sum mod "
                                                      "2^modulus_bits")

    def __attrs_post_init__(self) -> None:
        if not self.clients:
            raise ValueError("clients must name at least one client")


@attrs.frozen(kw_only=True)
class SecAggUnmaskRequest:
    """Step 5: whose masked input is in the sum (survivors) and who dropped after sharing."""

    seq: int = _seq(0)
    clients: ClientIds = _ids_field("this worker's survivors, who answer")
    survivors: ClientIds = _ids_field("every client whose masked input is in the sum")
    dropped: ClientIds = _ids_field("every client that shared but sent no masked input")

    def __attrs_post_init__(self) -> None:
        if not self.clients or set(self.clients) - set(self.survivors):
            raise ValueError("clients must be survivors, at least one")
        if set(self.survivors) & set(self.dropped):
            raise ValueError("a client cannot be both a survivor and dropped")


@attrs.frozen(kw_only=True)
class SecAggUnmaskReply:
    """The shares each survivor holds: of the survivors' self-mask seeds, the dropped's keys."""

    seq: int = _seq()
    holders: Integers = _field("list of client ids", "the survivor holding each share row",
                                check=_any_ids)
    owners: Integers = _field("list of client ids", "whose secret each row is a share of",
                               check=_any_ids)
    kinds: Integers = _field("list of int 0..1", "0: a self-mask seed's share, 1: a mask "
                              "key's", check=lambda _, a, v: _each(a, v, 0, 1))
    shares: Rows = _field("bytes nxH", "the unmasking shares (H: the scheme's share_size; "
                                      "secagg+: 70, a Shamir share)")

    def __attrs_post_init__(self) -> None:
        _aligned(self, "holders", "owners", "kinds")
        _width(self.shares, None, "shares", len(self.holders))


def _each(attribute: Any, values: list[int], low: int, high: int) -> None:
    if not all(low <= v <= high for v in values):
        raise ValueError(f"{attribute.name} must hold integers {low}..{high}")


#: The secure round's ops (docs/protocol.md §7.2).
SECURE_REQUESTS: dict[str, type] = {
    "secagg_keys": SecAggKeysRequest,
    "secagg_share": SecAggShareRequest,
    "secagg_open": SecAggOpenRequest,
    "secagg_reveal": SecAggRevealRequest,
    "secagg_mask": SecAggMaskRequest,
    "secagg_unmask": SecAggUnmaskRequest,
}
SECURE_REPLIES: dict[str, type] = {
    "secagg_keys": SecAggKeysReply,
    "secagg_share": SecAggShareReply,
    "secagg_open": SecAggOpenReply,
    "secagg_reveal": SecAggRevealReply,
    "secagg_mask": SecAggMaskReply,
    "secagg_unmask": SecAggUnmaskReply,
}
REQUESTS.update(SECURE_REQUESTS)
REPLIES.update(SECURE_REPLIES)

_CONVERTER = _converter()

# -- checking ------------------------------------------------------------------------------


def _structure(cls: type, message: Mapping[str, Any], what: str) -> Any:
    try:
        return _CONVERTER.structure(message, cls)
    except Exception as exc:  # every structuring failure becomes the sender's ProtocolError
        raise ProtocolError(f"{what} does not fit its schema: {_why(exc)}") from None


def _why(exc: BaseException, path: str = "") -> str:
    """One line saying every way a message did not fit (cattrs' nested errors flattened)."""
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        return f"unknown field(s) {', '.join(map(repr, sorted(exc.extra_fields)))}"
    if isinstance(exc, (cattrs.ClassValidationError, cattrs.IterableValidationError)):
        parts = []
        for inner in exc.exceptions:
            notes = [n for n in getattr(inner, "__notes__", ())
                     if isinstance(n, (cattrs.AttributeValidationNote,
                                       cattrs.IterableValidationNote))]
            where = path
            if notes and isinstance(notes[0], cattrs.AttributeValidationNote):
                where = f"{path}.{notes[0].name}" if path else notes[0].name
            elif notes:
                where = f"{path}[{notes[0].index}]"
            parts.append(_why(inner, where))
        return "; ".join(parts)
    if isinstance(exc, KeyError) and path:
        return f"{path}: missing"
    return f"{path}: {exc}" if path else str(exc)


def check_request(request: Mapping[str, Any]) -> Any:
    """``request`` structured as its op's schema; :class:`ProtocolError` when it does not fit."""
    if not isinstance(request, Mapping):
        raise ProtocolError(f"a request must be an object, got {_shown(request)}")
    op = request.get("op")
    cls = REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError(f"unknown trainer request op {op!r}; known: {sorted(REQUESTS)}")
    return _structure(cls, {k: v for k, v in request.items() if k != "op"},
                      f"the {op!r} request")


def check_reply(request: Mapping[str, Any], reply: Mapping[str, Any],
                seq: int | None = None) -> Mapping[str, Any]:
    """``reply`` if it is a well-formed answer to ``request``; else :class:`ProtocolError`.

    Besides the op's schema: the reply echoes ``seq`` (when given), and a
    ``fit``/``grads`` carries ``kept`` equal to the request's ``keep`` with
    keep, its result without. The reply is returned as it came (a mapping;
    its numbers already the right types), so code past the boundary reads
    it as before.
    """
    op = request.get("op")
    if not isinstance(reply, Mapping):
        raise ProtocolError(f"the reply to {op!r} must be an object, got {_shown(reply)}")
    if "error" in reply:
        message = _structure(ErrorReply, reply, f"the error reply to {op!r}")
    else:
        cls = REPLIES.get(op)  # type: ignore[arg-type]
        if cls is None:
            raise ProtocolError(f"a reply to {op!r}, which is never answered")
        message = _structure(cls, reply, f"the reply to {op!r}")
        if op in ("fit", "grads"):
            _check_kept(op, request.get("keep"), message)
        elif op == "fit_batch":
            # The request itself, or what a pool kept of it (_pool._answers_to).
            asked = (list(request["keys"]) if "keys" in request
                     else [fit["key"] for fit in request.get("fits", ())])
            answered = [result.key for result in message.results]
            if answered != asked:
                raise ProtocolError(f"the reply to 'fit_batch' answers keys "
                                    f"{answered[:8]}, asked for {asked[:8]}")
    if seq is not None and message.seq != seq:
        raise ProtocolError(f"the reply to {op!r} echoes seq {message.seq}, not {seq}")
    return reply


def _check_kept(op: str, keep: Any, message: Any) -> None:
    result = "state" if op == "fit" else "gradients"
    present = getattr(message, result) is not None
    if keep is None:
        if message.kept is not None or not present:
            raise ProtocolError(f"the reply to {op!r} without keep must carry {result!r} and "
                                f"no 'kept'")
    elif message.kept != keep or present:
        raise ProtocolError(f"the reply to {op!r} with keep = {keep} must carry kept = "
                            f"{keep} and no {result!r} (got kept = {message.kept!r}"
                            f"{', and ' + result if present else ''})")


#: A state's shape as a contribution must match it: key -> (shape, dtype) for an
#: array, None for a JSON value.
Signature = dict[str, Optional[tuple[tuple[int, ...], Any]]]


def signature(state: Mapping[str, Any]) -> Signature:
    """What :func:`check_contribution` compares: each key's shape and dtype (None: JSON)."""
    out: Signature = {}
    for key, value in state.items():
        out[key] = (value.shape, value.dtype) if isinstance(value, np.ndarray) else None
    return out


def check_contribution(state: Mapping[str, Any], expected: Signature, what: str, *,
                       subset: bool = False, finite: bool = True) -> None:
    """A contribution (a fit's model, gradients) matches the round's model, key for key.

    The same keys (with ``subset``: some of them -- gradients need not carry
    a model's JSON or integer entries), and each array the same shape and
    dtype as the model's (a JSON value where the model has one), and every
    float element finite (:func:`nonfinite_leaf`); :class:`ProtocolError`
    saying the first difference otherwise. One pass over the keys, and one
    cheap pass over each float array's elements (its sum). ``finite=False``
    leaves the elements to the caller: the round engine's own strict mean
    finds NaN and inf while it sums, and the engine replays such a round with
    the scan on (:mod:`meshkit.train._engine`, step 7), so an honest round
    pays for no second pass over a model.
    """
    if subset:
        unknown = [k for k in state if k not in expected]
        if unknown:
            raise ProtocolError(f"{what} does not match the round's model: unknown keys "
                                f"{sorted(unknown)[:5]}")
    elif len(state) != len(expected) or state.keys() != expected.keys():
        missing = sorted(expected.keys() - state.keys())[:5]
        extra = sorted(state.keys() - expected.keys())[:5]
        raise ProtocolError(f"{what} does not match the round's model: missing keys "
                            f"{missing or 'none'}, unknown keys {extra or 'none'}")
    for key, value in state.items():
        want = expected[key]
        if want is None:
            if isinstance(value, np.ndarray):
                raise ProtocolError(f"{what}: {key!r} is an array where the model has a JSON "
                                    f"value")
        elif not isinstance(value, np.ndarray) or value.shape != want[0] \
                or value.dtype != want[1]:
            raise ProtocolError(f"{what}: {key!r} is {_shown(value)} where the model has "
                                f"an array {want[1]}{list(want[0])}")
    for key, value in state.items() if finite else ():
        # Shapes first: a non-finite scan of an array of the wrong shape is wasted.
        if expected[key] is not None and nonfinite_leaf(value):
            raise ProtocolError(f"{what}: {key!r} holds NaN or inf; a contribution must be "
                                f"finite (its sender is dropped, never averaged in)")


def nonfinite_leaf(value: np.ndarray) -> bool:
    """Whether a float array holds a NaN or an infinity (integer and bool arrays never do).

    One pass: the sum is finite exactly when every element is, except that
    finite elements near the dtype's maximum may overflow it (1e308 twice in
    float64, 65504 twice in float16); so a non-finite sum is confirmed
    element by element before it is believed. An honest contribution pays
    for one sum; only a hostile (or huge) one pays for the exact check.
    """
    kind = value.dtype.kind
    if kind not in "fV" or value.size == 0:  # (bfloat16 is kind "V": ml_dtypes)
        return False
    if kind == "V":
        value = value.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        total = value.sum()
    if math.isfinite(float(total)):
        return False
    return not bool(np.isfinite(value).all())


# -- the docs' view --------------------------------------------------------------------------


def field_table(cls: type) -> list[tuple[str, str, str, str]]:
    """A message's fields as docs/protocol.md tabulates them: (field, type, required, meaning)."""
    rows = []
    for f in attrs.fields(cls):
        required = "yes" if f.default is attrs.NOTHING else "no"
        # A field that stands for several on the wire names itself ("...").
        rows.append((f.metadata.get("name", f.name), f.metadata["wire"], required,
                     f.metadata["doc"]))
    return rows
