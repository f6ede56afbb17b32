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

__all__ = ["Attack", "AttackRound", "Attackers", "choose_attackers", "to_update", "from_update",
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


#: Up to this many clients, ``fraction`` draws its attackers from one seeded
#: permutation of every client (the choice docs/robustness.md's figures were made
#: with); beyond it, from a seeded bijection evaluated per client (O(1) each).
PERMUTED_UP_TO = 10_000

_MASK64 = (1 << 64) - 1


def _mix(value: int) -> int:
    """splitmix64's finaliser: a 64-bit integer hash (the Feistel rounds' function)."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


@attrs.frozen
class _Bijection:
    """A seeded permutation of ``range(size)``, one element at a time: a 4-round Feistel
    network on the smallest even bit width covering ``size``, cycle-walking back into
    range (fewer than 4 steps on average). O(1) memory and work per element."""

    size: int
    seed: int
    half: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        bits = max(2, (self.size - 1).bit_length())
        object.__setattr__(self, "half", (bits + 1) // 2)

    def _round(self, r: int, value: int) -> int:
        return _mix(_mix(self.seed ^ (r << 56)) ^ value) & ((1 << self.half) - 1)

    def _once(self, x: int, rounds: range) -> int:
        mask = (1 << self.half) - 1
        left, right = x >> self.half, x & mask
        for r in rounds:
            left, right = right, left ^ self._round(r, right)
        return (left << self.half) | right

    def _undo(self, y: int) -> int:
        mask = (1 << self.half) - 1
        left, right = y >> self.half, y & mask
        for r in reversed(range(4)):
            left, right = right ^ self._round(r, left), left
        return (left << self.half) | right

    def forward(self, x: int) -> int:
        x = self._once(x, range(4))
        while x >= self.size:  # cycle-walk: the bijection of the wider domain, restricted
            x = self._once(x, range(4))
        return x

    def inverse(self, y: int) -> int:
        y = self._undo(y)
        while y >= self.size:
            y = self._undo(y)
        return y


@attrs.frozen
class Attackers:
    """The attacking clients of a run, as a sorted, immutable collection.

    Either listed (``clients = [...]``, or ``fraction`` of at most
    :data:`PERMUTED_UP_TO` clients), or -- ``fraction`` of a population --
    the ``count`` clients a seeded bijection of the ``population`` maps below
    ``count``: ``client in attackers`` is O(1) and nothing is O(N).
    """

    listed: tuple[int, ...] = ()
    population: int = 0
    count: int = 0
    bijection: _Bijection | None = None
    _members: frozenset[int] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_members", frozenset(self.listed))

    def __contains__(self, client: object) -> bool:
        if self.bijection is None:
            return client in self._members
        if isinstance(client, bool) or not isinstance(client, (int, np.integer)):
            return False
        return 0 <= int(client) < self.population and \
            self.bijection.forward(int(client)) < self.count

    def __len__(self) -> int:
        return len(self.listed) if self.bijection is None else self.count

    def __iter__(self) -> Any:
        if self.bijection is None:
            return iter(self.listed)
        return iter(sorted(self.bijection.inverse(j) for j in range(self.count)))

    def __bool__(self) -> bool:
        return len(self) > 0

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Attackers):
            return tuple(self) == tuple(other)
        if isinstance(other, (tuple, list)):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.population, self.count, self.listed, self.bijection))

    def describe(self, shown: int = 10) -> str:
        """``[3, 8]``, or the first ``shown`` ids and how many more."""
        if len(self) <= shown:
            return str(list(self))
        first = sorted(self.bijection.inverse(j) for j in range(shown)) if self.bijection \
            else list(self.listed[:shown])
        return f"{len(self):,} of {self.population:,} (e.g. {first})"


def choose_attackers(clients: int, *, explicit: Sequence[int] = (), fraction: float = 0.0,
                     seed: int = 0, where: str = "[attack]") -> Attackers:
    """The attacking clients, fixed for the run: ``explicit`` ids, or ``round(fraction *
    clients)`` of them chosen with the run seed -- by one permutation of every client up to
    :data:`PERMUTED_UP_TO` clients, by a seeded bijection (O(1) per client) beyond."""
    if explicit:
        wrong = [c for c in explicit if not 0 <= int(c) < clients]
        if wrong:
            raise ConfigError(f"{where} clients: {wrong} are not clients of this run (there "
                              f"are {clients}: 0..{clients - 1})")
        return Attackers(listed=tuple(sorted({int(c) for c in explicit})), population=clients,
                         count=len({int(c) for c in explicit}))
    count = int(round(fraction * clients))
    if fraction > 0 and count == 0:
        raise ConfigError(f"{where} fraction = {fraction:g} of {clients} clients rounds to no "
                          f"attacker; raise fraction or list the clients")
    if clients <= PERMUTED_UP_TO:
        order = np.random.default_rng([int(seed) & 0xFFFFFFFF, 0xA77AC]).permutation(clients)
        return Attackers(listed=tuple(sorted(int(c) for c in order[:count])),
                         population=clients, count=count)
    return Attackers(population=clients, count=count,
                     bijection=_Bijection(clients, _mix((int(seed) & _MASK64) ^ 0xA77AC)))


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
