"""Where a simulated attack meets the round: the coordinator poisons chosen clients' contributions.

Rule: with an ``[attack]`` table, the round engine's fold is wrapped in an
:class:`AttackedFold`. It keeps the round's contributions (O(clients x
model): an attack is a simulation tool, and an omniscient one needs them
all), and at ``result()`` poisons each attacker's contribution on its
update against the round's global state -- an omniscient attack (ALIE,
IPM) seeing the *honest* updates of the round -- then feeds every
contribution, in key order, to the aggregator's own fold. A data-poisoning
attack (label flipping) is not applied here: the engine adds ``poison`` to
an attacker's fit request and the worker flips its labels
(:mod:`meshkit.train._worker.trainer`). Either way the attacked clients are named
in the round's report (``attacked`` in ``metrics.jsonl``).

A real node started with ``meshkit node --attack NAME`` poisons its own
fits and says so in its reply (``attacked``); the engine records those
clients the same way.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs

from meshkit.attack import (AttackRound, attack_rng, is_omniscient, poisons_data,
                            tamper_contribution, to_update)
from meshkit.errors import AggregationError

__all__ = ["AttackPlan", "AttackedFold", "poison_request"]


@attrs.frozen
class AttackPlan:
    """The run's attack: its name and options, the built attack, the attacking clients."""

    name: str
    options: Mapping[str, Any]
    attack: Any
    clients: tuple[int, ...]
    seed: int = 0

    @property
    def poisons_data(self) -> bool:
        return poisons_data(self.attack)

    def spec(self) -> dict[str, Any]:
        """How a worker builds this attack (a fit request's ``poison``)."""
        return {"name": self.name, "options": dict(self.options)}


def poison_request(plan: AttackPlan | None, key: int,
                   request: Mapping[str, Any]) -> Mapping[str, Any]:
    """An attacker's fit request carries ``poison`` when its attack poisons data."""
    if plan is None or not plan.poisons_data or key not in plan.clients:
        return request
    if request.get("op") != "fit":
        return request
    return {**request, "poison": plan.spec()}


class AttackedFold:
    """The aggregator's fold, with the attackers' contributions poisoned (module docstring)."""

    def __init__(self, fold: Any, plan: AttackPlan, reference: Mapping[str, Any] | None,
                 seeds: Mapping[int, int]) -> None:
        self.fold, self.plan, self.reference, self.seeds = fold, plan, reference, seeds
        self._held: list[tuple[int, Mapping[str, Any], float, str | None]] = []
        #: The clients whose contributions were poisoned (or trained on poisoned data).
        self.attacked: list[int] = []

    def add(self, state: Mapping[str, Any], weight: float = 1.0, *,
            source: str | None = None) -> None:
        raise AggregationError("an attacked round folds by key: the round engine calls "
                               "add_keyed(key, state, weight, source=...)")

    def add_keyed(self, key: int, state: Mapping[str, Any], weight: float = 1.0, *,
                  source: str | None = None) -> None:
        self._held.append((key, state, weight, source))

    def result(self) -> dict[str, Any]:
        held, self._held = self._held, []
        attackers = [k for k, *_ in held if k in self.plan.clients]
        tampering = not self.plan.poisons_data
        honest: Sequence[Mapping[str, Any]] = ()
        if tampering and attackers and is_omniscient(self.plan.attack):
            honest = [to_update(s, self.reference) for k, s, _, _ in held
                      if k not in self.plan.clients]
        for key, state, weight, source in held:
            if key in self.plan.clients:
                self.attacked.append(key)
                if tampering:
                    round_ = AttackRound(client=key, contributors=len(held),
                                         attackers=len(attackers),
                                         rng=attack_rng(self.plan.seed, self.seeds.get(key, key)),
                                         honest=honest)
                    state = tamper_contribution(self.plan.attack, state, self.reference, round_,
                                                name=f"attack {self.plan.name}")
            self.fold.add(state, weight, source=source)
        return dict(self.fold.result())
