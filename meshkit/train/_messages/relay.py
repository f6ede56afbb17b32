"""What the coordinator asks a host relay, and its answers (docs/protocol.md §4.1).

Checked like every trainer message: attrs classes declared with the schema
language of :mod:`.fields`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import attrs
import cattrs

from meshkit.errors import ProtocolError
from meshkit.train._messages.fields import (MAX_COUNT, MAX_ERROR, MAX_EXAMPLES, MAX_NAME, MAX_SEQ,
                                            Metrics, State, _between, _field, _length)
from meshkit.train._messages.fields import _metrics as structure_metrics
from meshkit.train._messages.fields import _state as structure_state

__all__ = ["FoldRequest", "FanoutRequest", "parse_relay_request", "FoldAnswer", "RelayFailure",
           "parse_fold_answer"]

# -- the messages: what the coordinator asks a relay (docs/protocol.md §4.1) -------------

_converter = cattrs.Converter(forbid_extra_keys=True)


def _strict(kind: type, check: Callable[[Any], bool]) -> Callable[[Any, Any], Any]:
    def hook(value: Any, _: Any) -> Any:
        if not check(value):
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
        return value
    return hook


# No coercion: "3" is not an int, 1 is not a bool, a float is not an int.
_converter.register_structure_hook(
    int, _strict(int, lambda v: isinstance(v, int) and not isinstance(v, bool)))
_converter.register_structure_hook(bool, _strict(bool, lambda v: isinstance(v, bool)))
_converter.register_structure_hook(str, _strict(str, lambda v: isinstance(v, str)))
_converter.register_structure_hook(
    float, lambda v, _: float(_strict(float, lambda x: isinstance(x, (int, float))
                                      and not isinstance(x, bool))(v, _)))
# States and metrics as the trainer protocol checks them (key names, counts, finite metrics).
_converter.register_structure_hook(State, structure_state)
_converter.register_structure_hook(Metrics, structure_metrics)


def _positive_or_none(_: Any, attribute: Any, value: float | None) -> None:
    if value is not None and not (0 < value < math.inf):
        raise ValueError(f"{attribute.name} must be positive seconds or null, got {value}")


def _ranks(_: Any, attribute: Any, value: list[int]) -> None:
    if not value or any(not 1 <= r < MAX_COUNT for r in value) or len(set(value)) != len(value):
        raise ValueError(f"{attribute.name} must be distinct worker ranks, got {value}")


def _keys(position: int, *, distinct: bool = False) -> Callable[[Any, Any, Any], None]:
    """Each entry's key (the entry itself, or its element ``position``) is in 0..2^63-1."""
    def check(_: Any, attribute: Any, value: list[Any]) -> None:
        keys = [v if position < 0 else v[position] for v in value]
        if any(not 0 <= k <= MAX_SEQ for k in keys):
            raise ValueError(f"{attribute.name}: keys must be in 0..2^63-1")
        if distinct and len(set(keys)) != len(keys):
            raise ValueError(f"{attribute.name} names a key twice")
    return check


def _each(position: int, check: Callable[[Any, Any, Any], None]) -> Callable[[Any, Any, Any], None]:
    """``check`` on element ``position`` of every entry of a list field."""
    def run(instance: Any, attribute: Any, value: list[Any]) -> None:
        for entry in value:
            check(instance, attribute, entry[position])
    return run


_KEY = "key: int 0..2^63-1"


@attrs.frozen
class FoldRequest:
    """``fold``: serve these keys on your ranks; answer with the partial mean and its mass."""

    work: list[tuple[int, dict[str, Any]]] = _field(
        f"list of [key, request], 1 or more, keys distinct ({_KEY})",
        "the `fit`/`grads` requests (§7) to serve, by key; folded in this order",
        check=attrs.validators.and_(attrs.validators.min_len(1), _keys(0, distinct=True)))
    ranks: list[int] = _field(
        "list of int 1..2^31-1, distinct, 1 or more",
        "the relay's ranks the coordinator counts live (a rank that rejoined is not, until it "
        "is taken back between rounds)", check=_ranks)
    weight: str = _field('"examples" or "once"', "each contribution's weight: its `examples`, "
                         "or 1", check=attrs.validators.in_(("examples", "once")))
    weighted: bool = _field("bool", "the mean's setting: true, `sum w·x / sum w` (fedavg); "
                            "false, a plain mean of equal weights (allreduce)")
    wide: bool = _field("bool", "the mean's setting: accumulate float32 in float64")
    allow_nonfinite: bool = _field("bool", "the mean's setting: fold NaN/inf instead of refusing")
    aggregator: str | None = _field(
        "str, up to 1024 chars, or null", "the aggregator's name, for the mean's errors",
        check=attrs.validators.optional(_length(0, MAX_NAME)))
    window: int = _field("int 1..2^31", "the round engine's window: contributions its fold "
                         "holds at once", check=_between(1, MAX_COUNT))
    label: str = _field("str, up to 1024 chars", "what the round calls this work, for logs",
                        check=_length(0, MAX_NAME))
    timeout: float | None = _field("float > 0, or null", "seconds each request to a rank may "
                                   "take (null: no limit)", check=_positive_or_none)
    state: State | None = _field("state", "the round's global state (once per relay); absent: "
                                 "each rank's own", optional=True)
    accept_failures: bool = _field(
        "bool", "`[strategy] accept_failures`: a rank's failure drops it for the round (true) "
                "or fails the request (false)", default=True,
        check=attrs.validators.instance_of(bool))

    def to_wire(self) -> dict[str, Any]:
        wire = {"op": "fold", "work": [[k, r] for k, r in self.work],
                **{f.name: getattr(self, f.name) for f in attrs.fields(FoldRequest)
                   if f.name not in ("work", "state")}}
        if self.state is not None:
            wire["state"] = self.state
        return wire


@attrs.frozen
class FanoutRequest:
    """``fanout``: send one request (``inner`` and its ``fields``) to several of your ranks."""

    inner: str = _field("str, 1..1024 chars", "the op to send each rank (`apply`, "
                        "`set_state`, ...)", check=_length(1, MAX_NAME))
    ranks: list[int] = _field("list of int 1..2^31-1, distinct, 1 or more",
                              "the ranks to send it to", check=_ranks)
    timeout: float | None = _field("float > 0, or null", "seconds each rank may take to answer "
                                   "(null: no limit)", check=_positive_or_none)
    #: The inner request's own fields (``apply``'s ``gradients``, say).
    fields: dict[str, Any] = attrs.field(factory=dict, metadata={
        "name": "...", "wire": "the `inner` op's fields (§7)",
        "doc": "sent to each rank as that op's request; each rank checks them"})

    def to_wire(self) -> dict[str, Any]:
        return {**self.fields, "op": "fanout", "inner": self.inner, "ranks": self.ranks,
                "timeout": self.timeout}


def _describe(exc: BaseException, type_: Any) -> str:
    """One field's problem: the validator's own words where it has them."""
    if isinstance(exc, (ValueError, TypeError)) and str(exc):
        return str(exc)
    return cattrs.v.format_exception(exc, type_)


def _finite_mass(_: Any, attribute: Any, value: float) -> None:
    if not (0 <= value < math.inf):
        raise ValueError(f"{attribute.name} must be a finite sum of weights >= 0, got {value}")


@attrs.frozen
class FoldAnswer:
    """A relay's answer to ``fold``: the partial mean, its mass, who served what."""

    op: str = _field('"fold"', "the request answered", check=attrs.validators.in_(("fold",)))
    mass: float = _field("float, finite, >= 0", "the sum of the weights folded",
                         check=_finite_mass)
    count: int = _field("int 0..2^31", "how many contributions were folded",
                        check=_between(0, MAX_COUNT))
    served: list[tuple[int, int]] = _field(
        f"list of [key, rank] ({_KEY}, rank one the relay carries)",
        "who served each key", check=attrs.validators.and_(_keys(0), _each(1, _between(
            1, MAX_COUNT - 1))))
    not_served: list[tuple[int, str]] = _field(
        f"list of [key, why] ({_KEY}, why: str up to 65536 chars)",
        "the keys the relay could not serve, and why (served again elsewhere)",
        check=attrs.validators.and_(_keys(0), _each(1, _length(0, MAX_ERROR))))
    replies: list[tuple[int, int, Metrics]] = _field(
        f"list of [key, examples, metrics] ({_KEY}, examples: int 0..2^53), served keys only",
        "each served key's small reply (§7)", check=attrs.validators.and_(
            _keys(0), _each(1, _between(0, MAX_EXAMPLES))))
    state: State | None = _field("state", "the partial mean; absent when nothing was served",
                                 optional=True)
    attacked: list[int] = _field(f"list of keys ({_KEY}), served keys only",
                                 "the served keys whose rank said it attacked (`meshkit node "
                                 "--attack`)", default=attrs.Factory(list), check=_keys(-1))
    failed: list[tuple[int, str]] = _field(
        "list of [rank, why] (rank one the relay carries, why: str up to 65536 chars)",
        "the ranks dropped for the round for their own failure (`accept_failures`), and why",
        default=attrs.Factory(list), check=attrs.validators.and_(
            _each(0, _between(1, MAX_COUNT - 1)), _each(1, _length(0, MAX_ERROR))))
    own: list[int] = _field(f"list of keys ({_KEY}), not-served keys only",
                            "the keys whose failure is their client's (failed on two ranks): "
                            "not served again this round", default=attrs.Factory(list),
                            check=_keys(-1))


@attrs.frozen
class RelayFailure:
    """A relay's answer that its request failed: ``error``, and why."""

    error: str = _field("str, 1..65536 chars", "what went wrong, for a person",
                        check=_length(1, MAX_ERROR))
    reason: str | None = _field('"aggregation", "nonfinite", or null',
                                "`aggregation`: the fold refused a contribution; `nonfinite`: "
                                "a fit's metrics were not finite (the model diverged: the "
                                "coordinator follows `on_nonfinite`)", optional=True,
                                check=attrs.validators.in_(("aggregation", "nonfinite")))
    rank: int | None = _field("int 1..2^31-1, or null", "the rank whose task raised (the "
                              "worker's own error)", optional=True,
                              check=_between(1, MAX_COUNT - 1))


def parse_fold_answer(message: Mapping[str, Any], keys: Sequence[int],
                      carried: Sequence[int]) -> FoldAnswer | RelayFailure:
    """A relay's answer to a ``fold`` for ``keys``, checked; ``ProtocolError`` if it does not fit.

    Besides each field's type: it names only the keys it was asked for,
    each at most once, served by ranks the relay carries.
    """
    body = {k: v for k, v in message.items() if k not in ("relay", "seq")}
    try:
        if body.get("error") is not None:
            return _converter.structure(body, RelayFailure)
        answer = _converter.structure(body, FoldAnswer)
    except (cattrs.BaseValidationError, ValueError, TypeError, KeyError) as exc:
        detail = ("; ".join(cattrs.transform_error(exc, format_exception=_describe))
                  if isinstance(exc, cattrs.BaseValidationError) else str(exc))
        raise ProtocolError(f"a malformed answer to 'fold': {detail}") from None
    asked, ranks = set(keys), set(carried)
    named = [k for k, _ in answer.served] + [k for k, _ in answer.not_served]
    if len(set(named)) != len(named) or not set(named) <= asked:
        raise ProtocolError(f"its answer to 'fold' names keys {sorted(named)}, asked for "
                            f"{sorted(asked)}")
    if any(r not in ranks for _, r in answer.served):
        raise ProtocolError(f"its answer to 'fold' names ranks "
                            f"{sorted({r for _, r in answer.served})}, it carries "
                            f"{sorted(ranks)}")
    if not {k for k, _, _ in answer.replies} <= {k for k, _ in answer.served}:
        raise ProtocolError("its answer to 'fold' has replies for keys it did not serve")
    if not set(answer.attacked) <= {k for k, _ in answer.served}:
        raise ProtocolError("its answer to 'fold' reports attacks on keys it did not serve")
    if answer.served and answer.state is None:
        raise ProtocolError("its answer to 'fold' served keys but carries no partial state")
    if any(r not in ranks for r, _ in answer.failed):
        raise ProtocolError(f"its answer to 'fold' says ranks "
                            f"{sorted({r for r, _ in answer.failed})} failed, it carries "
                            f"{sorted(ranks)}")
    if not set(answer.own) <= {k for k, _ in answer.not_served}:
        raise ProtocolError("its answer to 'fold' calls keys the clients' failures that it "
                            "does not list as not served")
    return answer


#: Envelope fields every relay request may carry besides its schema's.
_ENVELOPE = ("op", "seq", "via")


def parse_relay_request(message: Mapping[str, Any]) -> FoldRequest | FanoutRequest:
    """The relay request ``message`` is, checked field by field; ``ProtocolError`` if not one."""
    op = message.get("op")
    body = {k: v for k, v in message.items() if k not in _ENVELOPE}
    try:
        if op == "fold":
            return _converter.structure(body, FoldRequest)
        if op == "fanout":
            own = {k: body.pop(k) for k in ("inner", "ranks", "timeout") if k in body}
            return _converter.structure({**own, "fields": body}, FanoutRequest)
    except (cattrs.BaseValidationError, ValueError, TypeError, KeyError) as exc:
        detail = ("; ".join(cattrs.transform_error(exc, format_exception=_describe))
                  if isinstance(exc, cattrs.BaseValidationError) else str(exc))
        raise ProtocolError(f"a malformed host relay request {op!r}: {detail}") from None
    raise ProtocolError(f"an unknown host relay request {op!r} (fold or fanout)")


