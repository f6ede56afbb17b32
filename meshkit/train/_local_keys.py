"""Keys that stay on each client (FedBN): which keys they are, and where each client's are kept.

``[strategy] local_keys = [...]`` names state keys that are never
aggregated: each client trains them from its own last values, and the global
model never takes them from anyone. FedBN (Li et al., *FedBN: Federated
Learning on Non-IID Features via Local Batch Normalization*, ICLR 2021)
keeps the normalisation layers local this way; ``meshkit.torch`` offers
them as the group ``"@norm"``.

Where a client's values live: on the coordinator, per client
(:class:`ClientLocal`), checkpointed with the run. Not on the node: a
client is served by whichever live worker the round engine hands it to,
and a worker that restarts has lost its memory; the coordinator is the one
place that sees every client's fit and writes the checkpoint ``--resume``
reads. What it holds is bounded by the run's client count times the size
of the local keys (two vectors per normalisation layer for FedBN), and each
client's values travel with its fit request (``local``).
"""

from __future__ import annotations

import fnmatch
from typing import Any, Iterable, Mapping

import attrs
import numpy as np

from meshkit.errors import ConfigError, StateError
from meshkit.state import is_array
from meshkit.task import key_groups

__all__ = ["resolve_local_keys", "ClientLocal"]


def resolve_local_keys(patterns: Iterable[str], state: Mapping[str, Any], task: Any, *,
                       where: str = "[strategy] local_keys") -> frozenset[str]:
    """The state's array keys ``patterns`` name: globs (``fnmatch``) or ``"@group"``.

    A group is one the task offers (``task.key_groups()``; ``meshkit.torch``:
    ``"norm"``). An unknown group, or a pattern that names no array of the
    model, is a :class:`ConfigError`: an option that keeps nothing local
    would silently be plain FedAvg.
    """
    arrays = [k for k, v in state.items() if is_array(v)]
    groups = key_groups(task)
    chosen: set[str] = set()
    for pattern in patterns:
        if pattern.startswith("@"):
            name = pattern[1:]
            if name not in groups:
                offered = ", ".join(f'"@{g}"' for g in sorted(groups)) or "none"
                raise ConfigError(
                    f"{where}: {pattern!r} names a key group the task "
                    f"({type(task).__name__}) does not offer (it offers: {offered}); use a "
                    f"glob of state keys such as \"bn*\" instead")
            found = [k for k in arrays if k in groups[name]]
        else:
            found = [k for k in arrays if fnmatch.fnmatchcase(k, pattern)]
        if not found:
            shown = ", ".join(map(repr, arrays[:6])) + (", ..." if len(arrays) > 6 else "")
            raise ConfigError(
                f"{where}: {pattern!r} matches no array of the model (its keys: {shown}); "
                f"fix the pattern, or drop it")
        chosen.update(found)
    return frozenset(chosen)


@attrs.define
class ClientLocal:
    """Each client's own values of the local keys, on the coordinator.

    ``keys`` are the local keys (empty: nothing is kept local). A client
    that has not fitted yet has no values: its first fit starts from the
    global model's.
    """

    keys: frozenset[str] = frozenset()
    values: dict[int, dict[str, np.ndarray]] = attrs.Factory(dict)

    def __bool__(self) -> bool:
        return bool(self.keys)

    def of(self, client: int) -> dict[str, np.ndarray]:
        """The client's values (``{}`` before its first fit)."""
        return dict(self.values.get(client, {}))

    def keep(self, client: int, state: Mapping[str, Any]) -> dict[str, Any]:
        """Keep the client's local keys from its fitted ``state``; the rest is what is folded."""
        if not self.keys:
            return dict(state)
        missing = sorted(self.keys - set(state))
        if missing:
            raise StateError(f"client {client}'s model lacks its local keys "
                             f"{', '.join(map(repr, missing))}")
        self.values[client] = {k: np.array(state[k], copy=True) for k in sorted(self.keys)}
        return {k: v for k, v in state.items() if k not in self.keys}

    def state_dict(self) -> dict[str, np.ndarray]:
        """A flat state for the checkpoint: ``"<client>/<key>"``."""
        return {f"{client}/{key}": value for client, table in sorted(self.values.items())
                for key, value in table.items()}

    def use(self, keys: frozenset[str]) -> None:
        """Set the run's local keys; values restored from a checkpoint must be theirs."""
        stale = sorted({k for table in self.values.values() for k in table} - keys)
        if stale:
            raise StateError(
                f"the checkpoint keeps client-local values of {', '.join(map(repr, stale))}, "
                f"which [strategy] local_keys no longer names; resume with the same "
                f"local_keys, or start afresh with --overwrite")
        self.keys = keys

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (checked against the keys by :meth:`use`)."""
        values: dict[int, dict[str, np.ndarray]] = {}
        for flat, value in state.items():
            client, sep, key = flat.partition("/")
            if not sep or not client.isdigit() or not is_array(value):
                raise StateError(f"checkpoint: client-local entry {flat!r} is not "
                                 f"'<client>/<key>' holding an array")
            values.setdefault(int(client), {})[key] = np.asarray(value)
        self.values = values
