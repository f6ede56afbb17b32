"""How the round engine folds a round through host relays (``meshkit relay``).

Rule: when every live worker is behind a host relay and the aggregator's
fold is the strict mean (:class:`meshkit.aggregation.MeanFold`, the
built-in ``fedavg`` and ``allreduce``), a round crosses the coordinator's
links once per relay, not once per rank:

1. The keys are planned round-robin over the live workers in key order, as
   the flat engine plans them, and grouped by the relay carrying each
   worker. Each relay gets one ``fold`` request: the round's state (once),
   its keys and their requests.
2. The relay runs the round engine on its own ranks (a lost rank's keys are
   served again there), folds their contributions in key order with the
   same mean (weight = realized work) and answers with the partial mean and
   its mass, the sum of the weights it folded.
3. The coordinator folds the partials in the order of their lowest key,
   weighted by mass, and divides once by the total accepted mass: the flat
   star's weighted mean, exactly in real arithmetic; in floating point the
   sums are grouped differently, so results agree to rounding (within 1e-6
   relative for float32 models, docs/scaling-out.md). The same config,
   seed and relays give the same bits whatever order answers arrive in.
4. A relay that is lost takes its ranks with it (the transport marks them
   dead); its keys, and keys a relay could not serve, are planned again
   over the live relays and served in the same round.

Anything else (no relays, a worker that dialed the coordinator directly, an
aggregator that is not a mean, a weight that is not the examples or a
constant) folds flat: the relays then only forward.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

from meshkit.aggregation import MeanFold
from meshkit.errors import AggregationError, MeshError, WorkerError
from meshkit.train._strategy import StrategyContext

__all__ = ["relay_groups", "relay_weight", "relay_plan_applies", "fold_through_relays"]

log = logging.getLogger(__name__)

#: What :func:`fold_through_relays` gives back: (result, served, not_served, replies).
RelayFolded = tuple[dict[str, Any] | None, dict[int, int], dict[int, str],
                    dict[int, Mapping[str, Any]]]


def relay_groups(ctx: StrategyContext) -> dict[str, list[int]] | None:
    """Relay name -> its live workers, when every live worker is behind one; else None."""
    relays = getattr(ctx.pool, "relays", None)
    if not relays:
        return None
    live = ctx.live
    carried = {r: name for name, ranks in relays.items() for r in ranks}
    if not live or any(r not in carried for r in live):
        return None
    groups: dict[str, list[int]] = {}
    for rank in live:
        groups.setdefault(carried[rank], []).append(rank)
    return groups


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


def fold_through_relays(ctx: StrategyContext, groups: dict[str, list[int]],
                        requests: dict[int, Mapping[str, Any]],
                        state: Mapping[str, Any] | None, weight: str, window: int,
                        fold: MeanFold, label: str) -> RelayFolded:
    """Serve ``requests`` (key -> request) through the relays in ``groups``; see the module doc."""
    pool = ctx.pool
    partials: list[tuple[int, dict[str, Any], float, str]] = []
    served: dict[int, int] = {}
    replies: dict[int, Mapping[str, Any]] = {}
    not_served: dict[int, str] = {}
    todo = sorted(requests)
    # Each wave either serves keys or loses a relay, so len(groups) + 1 waves suffice.
    for wave in range(len(groups) + 1):
        if not todo:
            break
        if wave:  # after a relay was lost: the relays and ranks still live
            groups = relay_groups(ctx) or {}
        if not groups:
            break
        ranks = sorted(r for rs in groups.values() for r in rs)
        owner = {r: n for n, rs in groups.items() for r in rs}
        planned: dict[str, list[int]] = {}
        for i, key in enumerate(todo):
            planned.setdefault(owner[ranks[i % len(ranks)]], []).append(key)
        tickets: dict[int, tuple[str, list[int]]] = {}
        for name, keys in planned.items():
            request: dict[str, Any] = {
                "op": "fold", "work": [[k, dict(requests[k])] for k in keys],
                "ranks": list(groups[name]),
                "weight": weight, "weighted": fold.weighted, "wide": fold.wide,
                "allow_nonfinite": fold.allow_nonfinite, "aggregator": fold.name,
                "window": window, "label": label, "timeout": ctx.timeout}
            if state is not None:
                request["state"] = state
            # The relay serves its keys one after another on a few ranks: its
            # whole answer may take as long as every request it makes.
            budget = None if ctx.timeout is None else ctx.timeout * (len(keys) + 2)
            tickets[pool.send_relay(name, request, budget)] = (name, keys)  # type: ignore[attr-defined]
        todo = []
        for _ in range(len(tickets)):
            reply = pool.receive()
            name, keys = tickets[reply.seq]
            if reply.payload is None:
                log.warning("host relay %r lost (%s); %s %s will be served again", name,
                            reply.error, label + ("s" if len(keys) > 1 else ""),
                            ", ".join(map(str, keys)))
                todo.extend(keys)
                continue
            answer = reply.payload
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
            for key in answer.get("attacked", []):  # a rank run with --attack, behind it
                if int(key) in replies:
                    replies[int(key)] = {**replies[int(key)],
                                         "attacked": f"reported by host relay {name!r}"}
            lost = [int(k) for k, _ in answer.get("not_served", [])]
            for key, why in answer.get("not_served", []):
                not_served[int(key)] = f"host relay {name!r}: {why}"
            todo.extend(lost)
            covered = [int(k) for k, _ in answer.get("served", [])]
            if covered and "state" in answer:
                partials.append((min(covered), dict(answer["state"]), float(answer["mass"]),
                                 name))
        todo.sort()
        for key in todo:
            not_served.pop(key, None)
    for key in todo:
        not_served.setdefault(key, "no live host relay left to serve it (dead: " + (
            "; ".join(f"rank {r}: {why}" for r, why in ctx.dead.items()) or "none") + ")")
    if not partials:
        return None, {}, not_served, {}
    # Fold order: each partial at its lowest key, so the bits do not depend
    # on which relay answered first.
    total = MeanFold(weighted=True, name=fold.name, allow_nonfinite=fold.allow_nonfinite,
                     wide=fold.wide, retain=fold.retain, threads=fold.threads)
    for _, partial, mass, name in sorted(partials, key=lambda p: p[0]):
        total.add(partial, mass, source=f"host relay {name!r}")
    partials.clear()
    result = total.result()
    order = sorted(served)
    return (result, {k: served[k] for k in order}, not_served,
            {k: replies[k] for k in order if k in replies})


def relay_plan_applies(ctx: StrategyContext, fold: Any, weight: str | None,
                       keys: Sequence[int]) -> dict[str, list[int]] | None:
    """The relay groups when this round can fold through relays (see the module doc), else None."""
    if weight is None or not keys or not isinstance(fold, MeanFold) or fold.count:
        return None
    if not callable(getattr(ctx.pool, "send_relay", None)):
        return None
    return relay_groups(ctx)
