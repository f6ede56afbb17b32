"""The virtual clock's speed model: how long each simulated client takes, from the seed alone.

``[simulation] clock = "virtual"`` (docs/async.md) replaces wall time by
simulated time: every client fit is given a duration in simulated seconds,
and a strategy that runs on the clock (``fedbuff``) orders arrivals by the
simulated moment each fit finishes, never by when its worker really
answered. Durations come from one of:

* ``speeds = "lognormal"`` (the default), ``sigma`` (default 1.0): client
  ``c``'s duration is ``exp(sigma * z_c)`` seconds, ``z_c`` a standard
  normal drawn from ``numpy.random.default_rng([seed, 27, c])``. The median
  duration is 1 s, the mean ``exp(sigma^2 / 2)`` (1.65 s at sigma = 1); a
  client's speed is the same in every fit, as a device's is.
* ``speeds_file = "FILE"``: a CSV of ``client,seconds`` lines (a header
  line ``client,seconds`` may come first), one line per client of the run,
  each duration a finite number > 0.

Either way a duration is a pure function of the run seed and the client
id, so simulated time (and the order of arrivals it decides) replays bit
for bit. What the clock does not model: transfer time, a client's speed
varying between fits, or clients going offline.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Mapping

import attrs
import numpy as np

from meshkit.errors import ConfigError

__all__ = ["Speeds", "lognormal_duration", "read_speeds_file", "LOGNORMAL_MEDIAN"]

#: The median duration of a lognormal client, in simulated seconds.
LOGNORMAL_MEDIAN = 1.0
#: The second word of a lognormal draw's seed (the first is the run seed): the
#: issue that introduced the clock, so no other seeded stream shares it.
_STREAM = 27
#: A speeds file may hold at most this many lines (bounded before it is read whole).
MAX_SPEEDS_LINES = 1 << 22


def lognormal_duration(seed: int, client: int, sigma: float) -> float:
    """Client ``client``'s fit duration in simulated seconds: ``exp(sigma * z)``, median 1."""
    z = float(np.random.default_rng([int(seed), _STREAM, int(client)]).standard_normal())
    return LOGNORMAL_MEDIAN * math.exp(sigma * z)


def read_speeds_file(path: str, where: str) -> dict[int, float]:
    """``client -> seconds`` from a ``client,seconds`` CSV; a :class:`ConfigError` naming
    ``where`` (the file, table and key) and the line for anything that does not fit."""
    file = Path(path)
    try:
        handle = file.open(newline="", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{where} = {path!r}: cannot read it ({exc.strerror or exc})"
                          ) from None
    durations: dict[int, float] = {}
    with handle:
        for number, row in enumerate(csv.reader(handle), start=1):
            if number > MAX_SPEEDS_LINES:
                raise ConfigError(f"{where} = {path!r}: more than {MAX_SPEEDS_LINES} lines")
            if not row or (number == 1 and [c.strip() for c in row] == ["client", "seconds"]):
                continue
            if len(row) != 2:
                raise ConfigError(f"{where} = {path!r}, line {number}: expected "
                                  f"'client,seconds', got {','.join(row)[:60]!r}")
            try:
                client, seconds = int(row[0]), float(row[1])
            except ValueError:
                raise ConfigError(f"{where} = {path!r}, line {number}: expected an integer "
                                  f"client id and a number of seconds, got "
                                  f"{','.join(row)[:60]!r}") from None
            if client < 0 or client in durations:
                raise ConfigError(f"{where} = {path!r}, line {number}: client {client} is "
                                  f"{'negative' if client < 0 else 'listed twice'}")
            if not (math.isfinite(seconds) and seconds > 0):
                raise ConfigError(f"{where} = {path!r}, line {number}: client {client} takes "
                                  f"{seconds!r} s; a duration is a finite number > 0")
            durations[client] = seconds
    return durations


@attrs.frozen
class Speeds:
    """Every client's fit duration on the virtual clock (module docstring).

    ``table`` (a speeds file's) wins when given; otherwise the lognormal
    rule with ``sigma`` and ``seed``.
    """

    seed: int = 0
    sigma: float = 1.0
    table: Mapping[int, float] = attrs.Factory(dict)
    #: Where the table came from (the config's file, table and key), for errors.
    source: str = ""

    def duration(self, client: int) -> float:
        """Simulated seconds one fit of ``client`` takes."""
        if self.table:
            try:
                return float(self.table[client])
            except KeyError:
                raise ConfigError(f"{self.source}: no duration for client {client}; the file "
                                  f"must list every client of the run") from None
        return lognormal_duration(self.seed, client, self.sigma)

    def check_covers(self, clients: int) -> None:
        """Refuse a speeds file that misses one of the run's ``clients``."""
        if not self.table:
            return
        missing = [c for c in range(clients) if c not in self.table]
        if missing:
            shown = ", ".join(map(str, missing[:5])) + (" ..." if len(missing) > 5 else "")
            raise ConfigError(f"{self.source}: no duration for client(s) {shown} of the "
                              f"run's {clients}; list every client 0..{clients - 1}")

    def describe(self) -> str:
        if self.table:
            return f"durations from {self.source} ({len(self.table)} clients)"
        return (f"lognormal durations, sigma = {self.sigma:g}, median "
                f"{LOGNORMAL_MEDIAN:g} s (seed {self.seed})")
