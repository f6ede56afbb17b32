"""The attack contract: how a chosen client's contribution is poisoned, to test a defence.

An *attack* (kind ``attack``, hook ``meshkit_attacks()``, config table
``[attack]``) is a research tool: it makes chosen clients Byzantine so a
robust aggregator can be measured against them. It works on *updates*,
``contribution - reference`` (the round's global model), over the float
array leaves of a state; other leaves are never touched::

    poisoned = attack.tamper(update, round)     # model poisoning
    x, y = attack.poison(x, y)                  # data poisoning (optional)

``round`` is an :class:`AttackRound`: the attacker's client id, how many
contributors and attackers the round has, a seeded RNG (a pure function
of the run seed, the round and the client, so a run is reproducible), and,
for an attack that declares ``omniscient = True`` (ALIE, IPM), the round's
*honest* updates. Omniscience is only possible in simulation, where the
coordinator holds every contribution (``[attack]`` in the config); on a
real node (``meshkit node --attack``) an attack sees its own update only,
and an omniscient one is refused there.

An attack that declares ``poisons_data = True`` (label flipping) changes
the attacker's training data instead; its ``tamper`` leaves the update as
it is. Which clients attack is decided once per run by
:func:`choose_attackers` (``clients = [...]``, or ``fraction`` of them,
seeded). Every attacked contribution is named in its round's metrics line
(``attacked``): an attack is never hidden.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import attrs
import numpy as np

from meshkit.errors import AggregationError, ConfigError
from meshkit.state import State, is_array, is_float_dtype

__all__ = ["Attack", "AttackRound", "choose_attackers", "to_update", "from_update",
           "tamper_contribution", "attack_rng", "is_omniscient", "poisons_data"]


@attrs.frozen
class AttackRound:
    """What an attack knows when it tampers with one contribution."""

    #: The attacking client's id.
    client: int
    #: Contributors this round (honest and attacking).
    contributors: int
    #: Attackers among them.
    attackers: int
    #: Seeded by (run seed, round, client): the attack's only randomness.
    rng: np.random.Generator
    #: The round's honest updates (an omniscient attack in simulation); () otherwise.
    honest: Sequence[Mapping[str, np.ndarray]] = ()


@runtime_checkable
class Attack(Protocol):
    """What the kernel needs from an attack (built by a ``meshkit_attacks`` factory)."""

    def tamper(self, update: Mapping[str, np.ndarray],
               round: AttackRound) -> Mapping[str, np.ndarray]:
        """The poisoned update (same keys, shapes; float64 is fine, dtypes are restored)."""


def is_omniscient(attack: Any) -> bool:
    """Whether ``attack`` needs the round's honest updates (``omniscient = True``)."""
    return bool(getattr(attack, "omniscient", False))


def poisons_data(attack: Any) -> bool:
    """Whether ``attack`` changes the attacker's training data (``poisons_data = True``)."""
    return bool(getattr(attack, "poisons_data", False))


def attack_rng(seed: int, client_seed: int) -> np.random.Generator:
    """The attack's RNG for one contribution, from the run seed and the fit's seed."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, int(client_seed) & 0xFFFFFFFF,
                                  0xA77AC])


def choose_attackers(clients: int, *, explicit: Sequence[int] = (), fraction: float = 0.0,
                     seed: int = 0, where: str = "[attack]") -> tuple[int, ...]:
    """The attacking clients, fixed for the run: ``explicit`` ids, or ``round(fraction *
    clients)`` of them chosen by a permutation seeded with the run seed."""
    if explicit:
        wrong = [c for c in explicit if not 0 <= int(c) < clients]
        if wrong:
            raise ConfigError(f"{where} clients: {wrong} are not clients of this run (there "
                              f"are {clients}: 0..{clients - 1})")
        return tuple(sorted({int(c) for c in explicit}))
    count = int(round(fraction * clients))
    if fraction > 0 and count == 0:
        raise ConfigError(f"{where} fraction = {fraction:g} of {clients} clients rounds to no "
                          f"attacker; raise fraction or list the clients")
    order = np.random.default_rng([int(seed) & 0xFFFFFFFF, 0xA77AC]).permutation(clients)
    return tuple(sorted(int(c) for c in order[:count]))


def _float_keys(state: State) -> list[str]:
    return [k for k, v in state.items() if is_array(v) and is_float_dtype(v.dtype)]


def to_update(state: State, reference: State | None) -> dict[str, np.ndarray]:
    """The float64 update ``state - reference`` over the float array leaves (no reference: 0)."""
    update = {}
    for key in _float_keys(state):
        value = np.asarray(state[key], dtype=np.float64)
        if reference is not None:
            if key not in reference or np.shape(reference[key]) != value.shape:
                raise AggregationError(f"attack: key {key!r} has no counterpart of shape "
                                       f"{value.shape} in the round's global state")
            value = value - np.asarray(reference[key], dtype=np.float64)
        update[key] = value
    return update


def from_update(state: State, update: Mapping[str, Any], reference: State | None,
                *, name: str = "attack") -> dict[str, Any]:
    """``state`` with its float leaves replaced by ``reference + update`` (dtypes kept)."""
    result = dict(state)
    for key in _float_keys(state):
        if key not in update:
            raise AggregationError(f"{name}: the poisoned update lacks key {key!r}")
        value = np.asarray(update[key], dtype=np.float64)
        if value.shape != np.shape(state[key]):
            raise AggregationError(f"{name}: the poisoned update of {key!r} has shape "
                                   f"{value.shape}, the contribution {np.shape(state[key])}")
        if reference is not None:
            value = value + np.asarray(reference[key], dtype=np.float64)
        with np.errstate(over="ignore"):  # an overflow is refused by tamper_contribution
            result[key] = value.astype(state[key].dtype)
    return result


def tamper_contribution(attack: Any, state: State, reference: State | None,
                        round: AttackRound, *, name: str = "attack") -> dict[str, Any]:
    """``state`` poisoned by ``attack`` (on its update against ``reference``).

    A poisoned contribution that is not finite is an error: an attack that
    overflows proves nothing about a defence.
    """
    update = to_update(state, reference)
    poisoned = attack.tamper(update, round)
    result = from_update(state, poisoned, reference, name=name)
    for key in _float_keys(state):
        if not np.isfinite(np.asarray(result[key], dtype=np.float64)).all():
            raise AggregationError(
                f"{name}: the poisoned contribution of client {round.client} has non-finite "
                f"values in {key!r}; lower the attack's strength")
    return result


def check_fraction(value: float, where: str = "[attack] fraction") -> float:
    """A fraction of clients in [0, 1]."""
    if not (0.0 <= value <= 1.0) or not math.isfinite(value):
        raise ConfigError(f"{where}: expected a number from 0 to 1, got {value!r}")
    return float(value)
