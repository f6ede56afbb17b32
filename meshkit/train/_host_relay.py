"""How the round engine folds a round through host relays (``meshkit relay``).

Rule: when some live worker is behind a host relay and the aggregator's
fold is the strict mean (:class:`meshkit.aggregation.MeanFold`, the
built-in ``fedavg`` and ``allreduce``), a round crosses the coordinator's
links once per relay, not once per rank behind one. A worker that dialed
the coordinator directly is a relay of one: the coordinator folds the keys
its direct workers serve itself, as a relay folds its ranks', so one phone
beside two relayed hosts does not turn the relays into forwarders.

1. The keys are planned round-robin over the live workers in key order, as
   the flat engine plans them, and grouped by the relay carrying each
   worker (the direct workers are one more group). Each relay gets one
   ``fold`` request: the round's state (once), its keys and their requests.
2. The relay runs the round engine on its own ranks (a lost rank's keys are
   served again there), folds their contributions in key order with the
   same mean (weight = realized work) and answers with the partial mean and
   its mass, the sum of the weights it folded (:func:`serve_fold`). The
   coordinator answers the direct group's request with the same function,
   over its own pool restricted to the direct workers, while the relays
   work; the relays' answers arriving meanwhile are set aside.
3. The coordinator folds the partials in the order of their lowest key,
   weighted by mass, and divides once by the total accepted mass: the flat
   star's weighted mean, exactly in real arithmetic; in floating point the
   sums are grouped differently, so results agree to rounding (within 1e-6
   relative for float32 models, docs/scaling-out.md). The same config,
   seed and relays give the same bits whatever order answers arrive in.
4. A relay that is lost takes its ranks with it (the transport marks them
   dead); its keys, and keys a relay could not serve, are planned again
   over the live groups and served in the same round.

Anything else (no relays, an aggregator that is not a mean, a weight that
is not the examples or a constant) folds flat: the relays then only forward.

Both sides of the protocol live here, once for every transport. The
coordinator's: :func:`fold_through_relays`, over any pool that lists
``relays`` (a :class:`meshkit.train.GroupPool` reads them from the
transport's ``Links.relays``). The relay's: :class:`RelayPool` (the round
engine's pool over the relay's own ranks, reached through what the
transport offers, :class:`RelayRanks`) and :func:`answer_request`
(``meshkit.train.answer_relay_request``), which a transport's relay calls
for each request addressed to it; the transport only carries bytes.

Every message is checked against its schema (attrs classes structured by
cattrs, no coercion): a request that does not fit (:func:`parse_relay_request`)
is answered with an error, never served; an answer that does not fit
(:func:`parse_fold_answer`: a field missing or wrong-typed, a key it was
not asked for, a rank it does not carry, no partial for what it served) is
a :class:`meshkit.ProtocolError` for that relay: its ranks are declared
dead and its keys served again by the others in the same round.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

import attrs
import cattrs

from meshkit.aggregation import MeanFold
from meshkit.errors import AggregationError, MeshError, PeerLostError, ProtocolError, WireError
from meshkit.errors import WorkerError
from meshkit.train._messages import (
    MAX_COUNT,
    MAX_ERROR,
    MAX_EXAMPLES,
    MAX_NAME,
    MAX_SEQ,
    Metrics,
    State,
    check_reply,
)
# The trainer protocol's field declarations and value checks: one schema language for both.
from meshkit.train._messages import _between, _field, _length
from meshkit.train._messages import _metrics as structure_metrics
from meshkit.train._messages import _state as structure_state
from meshkit.train._failures import OWN_FAILURE, DivergedFit, RoundFailures, strike
from meshkit.train._pool import Reply, WorkerPool, protocol_reason
from meshkit.train._secure_relay import serve_masked_sum
from meshkit.train._protocol import TAG_REQUEST, encode
from meshkit.train._strategy import StrategyContext

__all__ = ["RelayPlan", "relay_groups", "relay_weight", "relay_plan_applies",
           "fold_through_relays", "serve_fold", "FoldRequest", "FanoutRequest",
           "parse_relay_request", "FoldAnswer", "RelayFailure", "parse_fold_answer",
           "RelayRanks", "RelayPool", "answer_request"]

log = logging.getLogger(__name__)

#: What :func:`fold_through_relays` gives back: (result, served, not_served, replies, failed).
RelayFolded = tuple[dict[str, Any] | None, dict[int, int], dict[int, str],
                    dict[int, Mapping[str, Any]], dict[int, str]]

#: How a group's keys are played: ``play(ctx, requests, state=, weight=, window=,
#: fold=, label=)`` -> a :class:`meshkit.train.Folded`, ``requests`` key -> request
#: and ``weight`` ``"examples"`` or ``"once"``: the round engine, which passes it in
#: (it imports this module, so this module cannot import it).
Play = Callable[..., Any]

#: The name the coordinator's own group (the direct workers) goes by in logs.
DIRECT = "the coordinator's direct workers"


@attrs.frozen
class RelayPlan:
    """Who serves a relayed round: each relay's live ranks, and the direct workers."""

    relays: dict[str, list[int]]
    direct: list[int]

    @property
    def ranks(self) -> list[int]:
        return sorted([*self.direct, *(r for rs in self.relays.values() for r in rs)])


def relay_groups(ctx: StrategyContext) -> RelayPlan | None:
    """The live workers grouped by relay (the rest direct), when some relay carries one."""
    relays = ctx.pool.relays
    if not relays:
        return None
    live = ctx.live
    carried = {r: name for name, ranks in relays.items() for r in ranks}
    groups: dict[str, list[int]] = {}
    direct: list[int] = []
    for rank in live:
        if rank in carried:
            groups.setdefault(carried[rank], []).append(rank)
        else:
            direct.append(rank)
    if not groups:
        return None
    return RelayPlan(groups, direct)


def relay_weight(weight: Callable[[Mapping[str, Any]], float],
                 by_examples: Callable[[Mapping[str, Any]], float]) -> str | None:
    """How a relay can compute ``weight``: ``"examples"``, ``"once"``, or None (it cannot)."""
    if weight is by_examples:
        return "examples"
    try:
        probes = [float(weight({"examples": n, "metrics": {}})) for n in (1, 7)]
    except LookupError as exc:  # it reads more than examples: only a flat fold can weigh
        log.debug("the round's weight reads %s, which a relay cannot see: folding flat", exc)
        return None
    except Exception as exc:  # a bug in the weight, or a weight not meant for this probe
        log.warning("the round's weight function raised %s: %s on a reply of examples "
                    "only; the round folds flat, not at the relays", type(exc).__name__, exc)
        return None
    if probes == [1.0, 7.0]:
        return "examples"  # the examples seen, whatever function reads them
    return "once" if probes == [1.0, 1.0] else None


class _DirectView:
    """The coordinator's pool as its own fold of the direct workers sees it.

    Only the direct workers are live here, and the answers to the relays'
    requests (which arrive on the same pool) are set aside in ``aside``
    for :func:`fold_through_relays`, never handed to the direct round.
    """

    def __init__(self, pool: Any, direct: Sequence[int], relay_tickets: set[int]) -> None:
        self._pool = pool
        self._direct = frozenset(direct)
        self._tickets = relay_tickets
        self.aside: list[Reply] = []

    @property
    def dead(self) -> Mapping[int, str]:
        return self._pool.dead

    def live(self, ranks: Any) -> list[int]:
        return [r for r in self._pool.live(ranks) if r in self._direct]

    def declare_dead(self, rank: int, reason: str) -> None:
        self._pool.declare_dead(rank, reason)

    def send(self, rank: int, request: Mapping[str, Any], timeout: float | None) -> int:
        return self._pool.send(rank, request, timeout)

    def abandon(self, ticket: int) -> None:
        self._pool.abandon(ticket)

    @property
    def relays(self) -> dict[str, list[int]]:
        return {}  # the direct workers' round is flat

    def send_relay(self, name: str, request: Mapping[str, Any], timeout: float | None) -> int:
        raise MeshError("the direct workers' round sends nothing to a host relay")

    @property
    def pending(self) -> int:
        return int(self._pool.pending) - len(self._tickets)

    def receive(self, block: bool = True, until: float | None = None) -> Reply | None:
        while True:
            reply = self._pool.receive(block, until) if until is not None else (
                self._pool.receive(block))
            if reply is None or reply.seq not in self._tickets:
                return reply
            self._tickets.discard(reply.seq)
            self.aside.append(reply)

    def stop_all(self, ranks: Sequence[int]) -> None:
        pass

    def close(self) -> None:
        pass


def fold_through_relays(ctx: StrategyContext, plan: RelayPlan,
                        requests: dict[int, Mapping[str, Any]],
                        state: Mapping[str, Any] | None, weight: str, window: int,
                        fold: MeanFold, label: str, play: Play) -> RelayFolded:
    """Serve ``requests`` (key -> request) through the groups of ``plan``; see the module doc."""
    pool = ctx.pool
    partials: list[tuple[int, dict[str, Any], float, str]] = []
    served: dict[int, int] = {}
    replies: dict[int, Mapping[str, Any]] = {}
    not_served: dict[int, str] = {}
    todo = sorted(requests)
    #: Ranks dropped for the round for their own failure, behind relays or direct.
    failed: dict[int, str] = {}
    #: Relays whose request failed this round (accept_failures): not asked again.
    benched: set[str] = set()

    def take(name: str, keys: list[int], carried: Sequence[int],
             message: Mapping[str, Any]) -> list[int]:
        """Record one group's answer; the keys it could not serve."""
        try:
            answer = parse_fold_answer(message, keys, carried)
        except ProtocolError as exc:
            # That relay alone broke the protocol: it loses its ranks, and its
            # keys are served again by the others, in this round.
            why = f"host relay {name!r} broke the protocol: {exc}"
            log.warning("%s; %s %s will be served again", why,
                        label + ("s" if len(keys) > 1 else ""), ", ".join(map(str, keys)))
            for rank in carried:
                pool.declare_dead(rank, why)
            return list(keys)
        if isinstance(answer, RelayFailure):
            if answer.reason == "nonfinite":  # the model's divergence, not the relay's
                raise DivergedFit(f"host relay {name!r}: {answer.error}")
            if ctx.accept_failures and name != DIRECT:
                # A member's failure (meshkit.train._failures): the relay's ranks sit the
                # round out, its keys are served by the others.
                why = f"host relay {name!r} failed: {answer.error}"
                log.warning("%s; %s %s will be served again", why,
                            label + ("s" if len(keys) > 1 else ""), ", ".join(map(str, keys)))
                benched.add(name)
                for rank in carried:
                    failed.setdefault(rank, why)
                return list(keys)
            if answer.reason == "aggregation":
                raise AggregationError(f"host relay {name!r}: {answer.error}")
            if answer.rank is not None:
                raise WorkerError(answer.rank, answer.error)
            raise MeshError(f"host relay {name!r} failed: {answer.error}")
        for rank, why in answer.failed:
            failed.setdefault(rank, why if name == DIRECT else f"host relay {name!r}: {why}")
        for key, rank in answer.served:
            served[key] = rank
        for key, examples, metrics in answer.replies:
            replies[key] = {"examples": examples, "metrics": metrics}
        for key in answer.attacked:  # a rank run with --attack, behind it
            if key in replies:
                replies[key] = {**replies[key],
                                "attacked": f"reported by host relay {name!r}"}
        for key, why in answer.not_served:
            not_served[key] = why if name == DIRECT else f"host relay {name!r}: {why}"
        covered = [k for k, _ in answer.served]
        if covered and answer.state is not None:
            partials.append((min(covered), answer.state, answer.mass, name))
        own = set(answer.own)  # the clients' own failures: not served again this round
        return [k for k, _ in answer.not_served if k not in own]

    # Each wave either serves keys or loses a group, so one wave per group
    # (and one more) suffices.
    for wave in range(len(plan.relays) + 2):
        if not todo:
            break
        if wave:  # after a relay or a direct worker was lost: who is still live
            plan = relay_groups(ctx) or RelayPlan({}, ctx.live)
            plan = RelayPlan({n: rs for n, rs in plan.relays.items() if n not in benched},
                             [r for r in plan.direct if r not in failed])
        ranks = plan.ranks
        if not ranks:
            break
        owner = {r: n for n, rs in plan.relays.items() for r in rs}
        planned: dict[str, list[int]] = {}
        for i, key in enumerate(todo):
            planned.setdefault(owner.get(ranks[i % len(ranks)], DIRECT), []).append(key)

        def request_for(name: str, keys: list[int]) -> FoldRequest:
            return FoldRequest(
                work=[(k, dict(requests[k])) for k in keys],
                ranks=list(plan.direct if name == DIRECT else plan.relays[name]),
                weight=weight, weighted=fold.weighted, wide=fold.wide,
                allow_nonfinite=fold.allow_nonfinite, aggregator=fold.name, window=window,
                label=label, timeout=ctx.timeout,
                state=None if state is None else State(dict(state)),
                accept_failures=ctx.accept_failures)

        tickets: dict[int, tuple[str, list[int], list[int]]] = {}
        for name, keys in planned.items():
            if name == DIRECT:
                continue
            # The relay serves its keys one after another on a few ranks: its
            # whole answer may take as long as every request it makes.
            budget = None if ctx.timeout is None else ctx.timeout * (len(keys) + 2)
            tickets[pool.send_relay(name, request_for(name, keys).to_wire(), budget)] = (
                name, keys, list(plan.relays[name]))
        todo = []
        answers: list[Reply] = []
        if DIRECT in planned:
            # The coordinator is the direct workers' relay: it folds their
            # keys while the relays fold theirs.
            view = _DirectView(pool, plan.direct, set(tickets))
            direct_ctx = attrs.evolve(ctx, pool=view, workers=list(plan.direct))
            keys = planned[DIRECT]
            try:
                todo.extend(take(DIRECT, keys, plan.direct,
                                 serve_fold(direct_ctx, request_for(DIRECT, keys), play)))
            except DivergedFit:
                # The round is abandoned (on_nonfinite): the relays' answers still owed
                # must not be taken for the next round's.
                answered = {r.seq for r in view.aside}
                for ticket in tickets:
                    if ticket not in answered:
                        pool.abandon(ticket)
                raise
            answers.extend(view.aside)
        waiting = len(tickets) - len(answers)
        for _ in range(waiting):
            reply = pool.receive()  # blocking: a reply or a failed ticket, never None
            assert reply is not None
            answers.append(reply)
        for reply in answers:
            name, keys, carried = tickets[reply.seq]
            if reply.payload is None:
                log.warning("host relay %r lost (%s); %s %s will be served again", name,
                            reply.error, label + ("s" if len(keys) > 1 else ""),
                            ", ".join(map(str, keys)))
                todo.extend(keys)
                continue
            todo.extend(take(name, keys, carried, reply.payload))
        todo.sort()
        for key in todo:
            not_served.pop(key, None)
    dead = "; ".join(f"rank {r}: {why}" for r, why in ctx.dead.items()) or "none"
    for key in todo:
        not_served.setdefault(key, f"no live host relay left to serve it, nor a direct "
                                   f"worker (dead: {dead})")
    # The coordinator counts the strikes of ranks behind relays (a relay's context lives
    # one request); the direct workers' engine counted its own.
    direct = set(plan.direct) if plan is not None else set()
    strike(ctx, RoundFailures(ranks={r: w for r, w in failed.items() if r not in direct}))
    if not partials:
        return None, {}, not_served, {}, failed
    # Fold order: each partial at its lowest key, so the bits do not depend
    # on which relay answered first.
    total = MeanFold(weighted=True, name=fold.name, allow_nonfinite=fold.allow_nonfinite,
                     wide=fold.wide, retain=fold.retain, threads=fold.threads)
    for _, partial, mass, name in sorted(partials, key=lambda p: p[0]):
        total.add(partial, mass, source=name if name == DIRECT else f"host relay {name!r}")
    partials.clear()
    result = total.result()
    order = sorted(served)
    return (result, {k: served[k] for k in order}, not_served,
            {k: replies[k] for k in order if k in replies}, failed)


def serve_fold(ctx: StrategyContext, request: FoldRequest, play: Play) -> dict[str, Any]:
    """A group's answer to a ``fold`` request: its keys served on ``ctx``'s workers.

    What a host relay runs on its own ranks, and the coordinator on its
    direct workers: the round engine (``play``, :func:`meshkit.train.fold_round`)
    over the request's keys, folded in key order through a weighted
    :class:`MeanFold` (weight = realized work); the answer carries the
    partial mean and its mass, who served what, and each key's small reply.
    """
    fold = MeanFold(weighted=request.weighted, name=request.aggregator or None,
                    allow_nonfinite=request.allow_nonfinite, wide=request.wide)
    ctx.accept_failures = request.accept_failures
    folded = play(ctx, {key: req for key, req in request.work}, state=request.state,
                  weight=request.weight, window=request.window, fold=fold,
                  label=request.label)
    reply: dict[str, Any] = {
        "op": "fold", "mass": fold.mass, "count": fold.count,
        "served": [[k, r] for k, r in folded.served.items()],
        "not_served": [[k, why[:MAX_ERROR]] for k, why in folded.not_served.items()],
        "replies": [[k, int(r.get("examples", 0)), dict(r.get("metrics") or {})]
                    for k, r in folded.replies.items()],
        # Keys a rank run with `meshkit node --attack` served: never hidden upstream.
        "attacked": list(folded.attacked),
        "failed": [[r, why[:MAX_ERROR]] for r, why in folded.failed.items()],
        "own": [k for k, why in folded.not_served.items() if why.startswith(OWN_FAILURE)]}
    if folded.result is not None:
        reply["state"] = folded.result
    return reply


def relay_plan_applies(ctx: StrategyContext, fold: Any, weight: str | None,
                       keys: Sequence[int]) -> RelayPlan | None:
    """The relay plan when this round can fold through relays (see the module doc), else None."""
    if weight is None or not keys or not isinstance(fold, MeanFold) or fold.count:
        return None
    return relay_groups(ctx)


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


# -- the relay's side: its pool over its own ranks, and its answers ---------------------------


class RelayRanks(Protocol):
    """What a transport's host relay offers the kernel: its ranks' links.

    ``dead`` (rank -> why) and ``joined`` are the relay's view of its ranks;
    ``lost(rank, reason)`` drops a rank (and tells the coordinator);
    ``send_down(rank, tag, state)`` writes the relay's own frame to a rank
    (raising ``PeerLostError`` when it is not connected).
    """

    @property
    def dead(self) -> Mapping[int, str]: ...

    @property
    def joined(self) -> set[int]: ...

    def lost(self, rank: int, reason: str) -> None: ...

    def send_down(self, rank: int, tag: int, state: Mapping[str, Any]) -> None: ...


#: Where a host relay's own request numbers start: far above any the
#: coordinator uses (it counts from 1), inside the trainer protocol's range
#: of ``seq`` (0..2^63-1).
RELAY_SEQ = 1 << 62


class RelayPool:
    """The round engine's :class:`meshkit.train.WorkerPool` over a host relay's own ranks.

    Requests the relay issues carry ``seq`` numbers from :data:`RELAY_SEQ`
    up, the coordinator's count up from 1 (and never get near it): a
    worker echoes ``seq``, so each reply goes back to whoever asked
    (:meth:`owns`). The transport hands the relay's replies
    in with :meth:`deliver` (from its reader of that rank).
    """

    def __init__(self, ranks: RelayRanks) -> None:
        self._ranks = ranks
        self._cv = threading.Condition()
        self._seq = RELAY_SEQ
        #: rank -> (seq, deadline, request) of each request it owes an answer to.
        self._owed: dict[int, collections.deque[tuple[int, float, Mapping[str, Any]]]] = {}
        self._replies: collections.deque[tuple[int, Mapping[str, Any]]] = collections.deque()
        self._failed: collections.deque[Reply] = collections.deque()

    @property
    def dead(self) -> Mapping[int, str]:
        return self._ranks.dead

    def live(self, ranks: Iterable[int]) -> list[int]:
        joined, dead = self._ranks.joined, self._ranks.dead
        return [r for r in ranks if r in joined and r not in dead]

    def declare_dead(self, rank: int, reason: str) -> None:
        self._ranks.lost(rank, reason)

    @property
    def relays(self) -> dict[str, list[int]]:
        return {}  # a relay's own ranks are direct to it

    def send_relay(self, name: str, request: Mapping[str, Any], timeout: float | None) -> int:
        raise MeshError("a host relay does not relay through another relay")

    def abandon(self, ticket: int) -> None:
        raise MeshError("a host relay's round has no deadline to abandon a request at")

    @property
    def pending(self) -> int:
        with self._cv:
            return len(self._failed) + sum(len(q) for q in self._owed.values())

    def send(self, rank: int, request: Mapping[str, Any], timeout: float | None) -> int:
        with self._cv:
            self._seq += 1
            seq = self._seq
        dead = self._ranks.dead
        if rank in dead:
            with self._cv:
                self._failed.append(Reply(rank, None, dead[rank], seq))
            return seq
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        with self._cv:
            self._owed.setdefault(rank, collections.deque()).append((seq, deadline, request))
        try:
            self._ranks.send_down(rank, TAG_REQUEST, encode({**request, "seq": seq}))
        except (PeerLostError, WireError, OSError) as exc:
            self._ranks.lost(rank, f"send failed: {exc}")
        return seq

    @staticmethod
    def owns(seq: Any) -> bool:
        """Whether ``seq`` (a reply's) answers one of the relay's own requests."""
        return isinstance(seq, int) and not isinstance(seq, bool) and seq > RELAY_SEQ

    def deliver(self, rank: int, reply: Mapping[str, Any]) -> None:
        """A worker answered one of the relay's requests (called by the rank's reader)."""
        with self._cv:
            self._replies.append((rank, reply))
            self._cv.notify_all()

    def wake(self) -> None:
        """Look at the ranks again (one was lost, or the relay is closing)."""
        with self._cv:
            self._cv.notify_all()

    def receive(self, block: bool = True, until: float | None = None) -> Reply | None:
        with self._cv:
            while True:
                if self._failed:
                    return self._failed.popleft()
                while self._replies:
                    rank, reply = self._replies.popleft()
                    owed = self._owed.get(rank)
                    if owed and owed[0][0] == reply.get("seq"):
                        seq, _, request = owed.popleft()
                        try:
                            # The same boundary as the coordinator's (GroupPool):
                            # past here no reply lacks a field or holds a wrong type.
                            check_reply(request, reply, seq)
                        except ProtocolError as exc:
                            reason = protocol_reason(exc)
                            threading.Thread(target=self._ranks.lost, args=(rank, reason),
                                             daemon=True).start()
                            return Reply(rank, None, reason, seq)
                        return Reply(rank, reply, None, seq)
                    log.debug("relay: discarding a stale reply from rank %d", rank)
                if not any(self._owed.values()):
                    raise MeshError("receive() with no request outstanding")
                dead = self._ranks.dead
                now = time.monotonic()
                if until is not None and until <= now:
                    return None
                soonest = math.inf if until is None else until
                for rank, owed in self._owed.items():
                    if not owed:
                        continue
                    if rank in dead:
                        seq, _, _ = owed.popleft()
                        return Reply(rank, None, dead[rank], seq)
                    if owed[0][1] <= now:
                        seq, _, _ = owed.popleft()
                        reason = "no answer within the request's timeout (stalled)"
                        # Not under this lock: losing a rank wakes this pool.
                        threading.Thread(target=self._ranks.lost, args=(rank, reason),
                                         daemon=True).start()
                        return Reply(rank, None, reason, seq)
                    soonest = min(soonest, owed[0][1])
                if not block:
                    return None
                self._cv.wait(min(1.0, max(0.0, soonest - now)))

    def stop_all(self, ranks: Sequence[int]) -> None:
        pass

    def close(self) -> None:
        pass


def _relay_context(pool: WorkerPool, carried: frozenset[int], timeout: float | None,
                   ranks: Sequence[int]) -> StrategyContext:
    # The coordinator names the ranks it counts live (a rank that rejoined is
    # not, until it is taken back between rounds).
    # A partial context: the relay's fold asks for no task, aggregator or rng,
    # so it is not a StrategyContext by its types and is built untyped.
    partial: dict[str, Any] = dict(task=None, aggregator=None, rng=None)
    return StrategyContext(**partial, pool=pool,
                           workers=sorted(r for r in ranks if r in carried), timeout=timeout)


def _fanout(pool: WorkerPool, carried: frozenset[int], request: FanoutRequest) -> dict[str, Any]:
    """Send one request to several of the relay's ranks; each one's answer."""
    ranks = [r for r in request.ranks if r in carried]
    inner = {**request.fields, "op": request.inner}
    tickets = {pool.send(r, inner, request.timeout): r for r in ranks}
    answers: dict[int, Any] = {}
    for _ in tickets:
        reply = pool.receive()
        assert reply is not None
        answers[tickets[reply.seq]] = (
            [False, reply.error] if reply.payload is None
            else [True, reply.payload.get("error")])
    return {"op": "fanout", "answers": [[r, *answers[r]] for r in ranks]}


def _error_text(text: str) -> str:
    """An error as ``RelayFailure.error`` bounds it: 1..MAX_ERROR characters."""
    return (text or "an error without a message")[:MAX_ERROR]


def answer_request(pool: WorkerPool, carried: frozenset[int], name: str,
                   message: Mapping[str, Any], play: Play) -> dict[str, Any]:
    """A host relay's answer to one request of the coordinator (``TAG_RELAY``).

    ``pool`` reaches the relay's own ranks (a :class:`RelayPool` in a real
    relay; any :class:`meshkit.train.WorkerPool`); ``carried`` are the
    ranks it carries, ``name`` its name in errors.

    ``fold`` is served with the round engine on the relay's own ranks
    (:func:`serve_fold`), ``fanout`` sent to each rank named, ``masked_sum``
    (a secure round's) summed mod 2**bits over the ranks named
    (:func:`meshkit.train._secure_relay.serve_masked_sum`). A failure is
    the answer's ``error`` (``reason = "aggregation"`` for a refused fold,
    ``rank`` for a task's error), never an exception: the coordinator must
    hear, not wait.
    """
    try:
        if message.get("op") == "masked_sum":  # a secure round's (meshkit.train._secure_relay)
            return serve_masked_sum(pool, carried, message)
        request = parse_relay_request(message)
        if isinstance(request, FoldRequest):
            return serve_fold(_relay_context(pool, carried, request.timeout, request.ranks),
                              request, play)
        return _fanout(pool, carried, request)
    except DivergedFit as exc:
        return {"error": _error_text(str(exc)), "reason": "nonfinite"}
    except AggregationError as exc:
        return {"error": _error_text(str(exc)), "reason": "aggregation"}
    except WorkerError as exc:
        # The worker's own message: the coordinator names the rank again.
        return {"error": _error_text(exc.detail), "rank": exc.rank}
    except MeshError as exc:
        return {"error": _error_text(str(exc))}
    except Exception as exc:  # noqa: BLE001 (the coordinator must hear, not wait)
        log.exception("relay %r: request %r failed", name, message.get("op"))
        return {"error": _error_text(f"relay {name!r}: {type(exc).__name__}: {exc}")}
