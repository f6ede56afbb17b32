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

import logging
from typing import Any, Callable, Mapping, Sequence

import attrs

from meshkit.aggregation import MeanFold
from meshkit.errors import AggregationError, MeshError, ProtocolError
from meshkit.errors import WorkerError
from meshkit.train._messages.fields import MAX_ERROR, State
from meshkit.train._messages.relay import (FoldRequest, RelayFailure,
                                           parse_fold_answer)
from meshkit.train._failures import OWN_FAILURE, DivergedFit, RoundFailures, strike
from meshkit.train._pool import Reply
from meshkit.train._strategy import StrategyContext

__all__ = ["RelayPlan", "relay_groups", "relay_weight", "relay_plan_applies",
           "fold_through_relays", "serve_fold"]

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
