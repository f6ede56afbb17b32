"""One whole round in one process: every client's state machine and the coordinator's, no sockets.

For tests and benchmarks (the way Flower's simulation runs its clients in
one process): real keys, real shares, real masks, and the messages handed
from one machine to the other directly. Clients can be made to drop at
each stage; every call's CPU time is recorded per side and stage, and
every upload's payload (:func:`payload_bytes`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable, Collection, Mapping, Optional, TypeVar

import attrs
import numpy as np

from meshkit_secagg._client import ClientRound
from meshkit_secagg._messages import payload_bytes
from meshkit_secagg._params import SecAggParams
from meshkit_secagg._server import SecAggResult, ServerRound

__all__ = ["simulate_round", "Simulation", "STAGES"]

#: The stages a simulation times, in order.
STAGES = ("advertise", "share", "mask", "unmask", "finish")

_T = TypeVar("_T")


@attrs.frozen(eq=False)
class Simulation:
    """A simulated round: its result and what it cost."""

    result: SecAggResult
    #: stage -> CPU seconds summed over every client.
    client_seconds: Mapping[str, float]
    #: stage -> the coordinator's CPU seconds.
    server_seconds: Mapping[str, float]
    #: stage -> payload bytes uploaded by every client together.
    upload_bytes: Mapping[str, int]


def simulate_round(params: SecAggParams, updates: Mapping[int, np.ndarray], round_seed: bytes,
                   *, drop_before_sharing: Collection[int] = (),
                   drop_after_masking: Collection[int] = (),
                   drop_before_unmasking: Collection[int] = (),
                   length: Optional[int] = None) -> Simulation:
    """Runs one round over the clients of ``updates`` (client id -> quantised vector).

    ``drop_before_sharing`` advertise keys and then vanish;
    ``drop_after_masking`` compute their masked input but it never arrives
    (the coordinator cancels their pairwise masks); ``drop_before_unmasking``
    send masked input and then send no unmasking shares. Refusals and
    protocol errors propagate as the state machines raise them. ``length``,
    when given, is the updates' length, and ``updates`` is read one client
    at a time, as each masks (so a lazy mapping keeps one update in memory).
    """
    if length is None:
        lengths = {v.shape for v in updates.values()}
        if len(lengths) != 1 or len(next(iter(lengths))) != 1:
            raise ValueError("every update must be one vector of one length")
        (length,), = lengths
    client_s: dict[str, float] = defaultdict(float)
    server_s: dict[str, float] = defaultdict(float)
    upload: dict[str, int] = defaultdict(int)

    def timed(book: dict[str, float], stage: str, call: Callable[..., _T], *args: Any) -> _T:
        start = time.process_time()
        try:
            return call(*args)
        finally:
            book[stage] += time.process_time() - start

    server = timed(server_s, "advertise", ServerRound, params, sorted(updates), round_seed, length)
    clients = {c: timed(client_s, "advertise", ClientRound, params, c, round_seed, length)
               for c in sorted(updates)}
    for c, client in clients.items():
        advert = timed(client_s, "advertise", client.advertise)
        upload["advertise"] += payload_bytes(advert)
        timed(server_s, "advertise", server.receive_advert, advert)
    rosters = timed(server_s, "advertise", server.rosters)
    for c, roster in rosters.items():
        bundle = timed(client_s, "share", clients[c].share, roster)
        upload["share"] += payload_bytes(bundle)
        if c not in drop_before_sharing:
            timed(server_s, "share", server.receive_shares, bundle)
    deliveries = timed(server_s, "share", server.deliveries)
    for c, delivery in deliveries.items():
        masked = timed(client_s, "mask", clients[c].mask, delivery, updates[c])
        if c not in drop_after_masking:
            upload["mask"] += payload_bytes(masked)
            timed(server_s, "mask", server.receive_masked, masked)
    requests = timed(server_s, "mask", server.unmask_requests)
    for c, request in requests.items():
        reply = timed(client_s, "unmask", clients[c].unmask, request)
        if c not in drop_before_unmasking:
            upload["unmask"] += payload_bytes(reply)
            timed(server_s, "unmask", server.receive_unmask, reply)
    result = timed(server_s, "finish", server.finish)
    return Simulation(result, dict(client_s), dict(server_s), dict(upload))
