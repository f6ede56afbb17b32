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
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import attrs

from meshkit.aggregation import MeanFold
from meshkit.errors import AggregationError, MeshError, WorkerError
from meshkit.train._pool import Reply
from meshkit.train._strategy import StrategyContext

__all__ = ["RelayPlan", "relay_groups", "relay_weight", "relay_plan_applies",
           "fold_through_relays", "serve_fold"]

log = logging.getLogger(__name__)

#: What :func:`fold_through_relays` gives back: (result, served, not_served, replies).
RelayFolded = tuple[dict[str, Any] | None, dict[int, int], dict[int, str],
                    dict[int, Mapping[str, Any]]]

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
    relays = getattr(ctx.pool, "relays", None)
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
    except Exception:  # noqa: BLE001 (a weight that needs more than a reply: fold flat)
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
        return self._pool.dead  # type: ignore[no-any-return]

    def live(self, ranks: Any) -> list[int]:
        return [r for r in self._pool.live(ranks) if r in self._direct]

    def declare_dead(self, rank: int, reason: str) -> None:
        self._pool.declare_dead(rank, reason)

    def send(self, rank: int, request: Mapping[str, Any], timeout: float | None) -> int:
        return self._pool.send(rank, request, timeout)  # type: ignore[no-any-return]

    def abandon(self, ticket: int) -> None:
        self._pool.abandon(ticket)

    @property
    def pending(self) -> int:
        return int(self._pool.pending) - len(self._tickets)

    def receive(self, block: bool = True, until: float | None = None) -> Reply | None:
        while True:
            reply = self._pool.receive(block, until) if until is not None else (
                self._pool.receive(block))
            if reply is None or reply.seq not in self._tickets:
                return reply  # type: ignore[no-any-return]
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

    def take(name: str, keys: list[int], answer: Mapping[str, Any]) -> list[int]:
        """Record one group's answer; the keys it could not serve."""
        if answer.get("error"):
            if answer.get("reason") == "aggregation":
                raise AggregationError(f"host relay {name!r}: {answer['error']}")
            rank = answer.get("rank")
            if isinstance(rank, int):
                raise WorkerError(rank, str(answer["error"]))
            raise MeshError(f"host relay {name!r} failed: {answer['error']}")
        for key, rank in answer.get("served", []):
            served[int(key)] = int(rank)
        for key, examples, metrics in answer.get("replies", []):
            replies[int(key)] = {"examples": int(examples), "metrics": dict(metrics)}
        for key, why in answer.get("not_served", []):
            not_served[int(key)] = (f"{why}" if name == DIRECT
                                    else f"host relay {name!r}: {why}")
        covered = [int(k) for k, _ in answer.get("served", [])]
        if covered and "state" in answer:
            partials.append((min(covered), dict(answer["state"]), float(answer["mass"]),
                             name))
        return [int(k) for k, _ in answer.get("not_served", [])]

    # Each wave either serves keys or loses a group, so one wave per group
    # (and one more) suffices.
    for wave in range(len(plan.relays) + 2):
        if not todo:
            break
        if wave:  # after a relay or a direct worker was lost: who is still live
            plan = relay_groups(ctx) or RelayPlan({}, ctx.live)
        ranks = plan.ranks
        if not ranks:
            break
        owner = {r: n for n, rs in plan.relays.items() for r in rs}
        planned: dict[str, list[int]] = {}
        for i, key in enumerate(todo):
            planned.setdefault(owner.get(ranks[i % len(ranks)], DIRECT), []).append(key)

        def request_for(name: str, keys: list[int]) -> dict[str, Any]:
            request: dict[str, Any] = {
                "op": "fold", "work": [[k, dict(requests[k])] for k in keys],
                "ranks": list(plan.direct if name == DIRECT else plan.relays[name]),
                "weight": weight, "weighted": fold.weighted, "wide": fold.wide,
                "allow_nonfinite": fold.allow_nonfinite, "aggregator": fold.name,
                "window": window, "label": label, "timeout": ctx.timeout}
            if state is not None:
                request["state"] = state
            return request

        tickets: dict[int, tuple[str, list[int]]] = {}
        for name, keys in planned.items():
            if name == DIRECT:
                continue
            # The relay serves its keys one after another on a few ranks: its
            # whole answer may take as long as every request it makes.
            budget = None if ctx.timeout is None else ctx.timeout * (len(keys) + 2)
            tickets[pool.send_relay(name, request_for(name, keys), budget)] = (  # type: ignore[attr-defined]
                name, keys)
        todo = []
        answers: list[Reply] = []
        if DIRECT in planned:
            # The coordinator is the direct workers' relay: it folds their
            # keys while the relays fold theirs.
            view = _DirectView(pool, plan.direct, set(tickets))
            direct_ctx = attrs.evolve(ctx, pool=view, workers=list(plan.direct))
            keys = planned[DIRECT]
            todo.extend(take(DIRECT, keys, serve_fold(direct_ctx, request_for(DIRECT, keys),
                                                      play)))
            answers.extend(view.aside)
        waiting = len(tickets) - len(answers)
        answers.extend(pool.receive() for _ in range(waiting))
        for reply in answers:
            name, keys = tickets[reply.seq]
            if reply.payload is None:
                log.warning("host relay %r lost (%s); %s %s will be served again", name,
                            reply.error, label + ("s" if len(keys) > 1 else ""),
                            ", ".join(map(str, keys)))
                todo.extend(keys)
                continue
            todo.extend(take(name, keys, reply.payload))
        todo.sort()
        for key in todo:
            not_served.pop(key, None)
    for key in todo:
        not_served.setdefault(key, "no live host relay left to serve it, nor a direct worker (dead: " + (
            "; ".join(f"rank {r}: {why}" for r, why in ctx.dead.items()) or "none") + ")")
    if not partials:
        return None, {}, not_served, {}
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
            {k: replies[k] for k in order if k in replies})


def serve_fold(ctx: StrategyContext, request: Mapping[str, Any], play: Play) -> dict[str, Any]:
    """A group's answer to a ``fold`` request: its keys served on ``ctx``'s workers.

    What a host relay runs on its own ranks, and the coordinator on its
    direct workers: the round engine (``play``, :func:`meshkit.train.fold_round`)
    over the request's keys, folded in key order through a weighted
    :class:`MeanFold` (weight = realized work); the answer carries the
    partial mean and its mass, who served what, and each key's small reply.
    """
    fold = MeanFold(weighted=bool(request.get("weighted", True)),
                    name=request.get("aggregator") or None,
                    allow_nonfinite=bool(request.get("allow_nonfinite", False)),
                    wide=bool(request.get("wide", False)))
    folded = play(ctx, {int(key): dict(req) for key, req in request["work"]},
                  state=request.get("state"),
                  weight="examples" if request.get("weight") == "examples" else "once",
                  window=int(request.get("window") or 1), fold=fold,
                  label=str(request.get("label") or "client"))
    reply: dict[str, Any] = {
        "op": "fold", "mass": fold.mass, "count": fold.count,
        "served": [[k, r] for k, r in folded.served.items()],
        "not_served": [[k, why] for k, why in folded.not_served.items()],
        "replies": [[k, int(r.get("examples", 0)), dict(r.get("metrics") or {})]
                    for k, r in folded.replies.items()]}
    if folded.result is not None:
        reply["state"] = folded.result
    return reply


def relay_plan_applies(ctx: StrategyContext, fold: Any, weight: str | None,
                       keys: Sequence[int]) -> RelayPlan | None:
    """The relay plan when this round can fold through relays (see the module doc), else None."""
    if weight is None or not keys or not isinstance(fold, MeanFold) or fold.count:
        return None
    if not callable(getattr(ctx.pool, "send_relay", None)):
        return None
    return relay_groups(ctx)
