"""The trainer protocol: every request the coordinator sends a worker, and its reply.

Requests arrive on tag :data:`TAG_REQUEST` and replies leave on
:data:`TAG_REPLY`; each is one flat state (the wire's unit), where a nested
model state travels as ``"state/<key>"`` entries (:func:`encode`,
:func:`decode`). Every request carries ``seq`` and its reply echoes it, so a
late answer from a worker that was already given up on can never be taken
for a fresh one.

op              request fields                          reply fields
==============  ======================================  =============================
``set_state``   state                                   (ack); discards kept results
``fit``         shard, shards, seed; state?; keep?;     examples, metrics; state or kept;
                poison?                                 attacked?
``grads``       shard, shards, seed, batch_size; keep?  examples, metrics; gradients or kept
``step``        shard, shards, seed, batch_size, ranks  examples, metrics (all-reduce + apply)
``take``        key                                     state (the kept result, dropped)
``apply``       gradients                               (ack)
``get_state``   —                                       state
``stage``       nodes, x, state (the stage's keys)      x
``stop``        —                                       (none: the worker returns)
==============  ======================================  =============================

The ops are ``set_state``, ``fit``, ``grads``, ``step``, ``take``,
``apply``, ``get_state``, ``held_out``, ``evaluate``, ``stage`` and
``stop`` (and a DiLoCo replica's ``replica_init``, ``inner``,
``replica_get``, ``replica_put``: :mod:`meshkit.train._worker.local_sgd`);
every field of every request and reply, its type and its bounds,
is declared once, in :mod:`meshkit.train._messages` (``REQUESTS``,
``REPLIES``), where each message is checked as it enters
(docs/protocol.md §7 tabulates the same classes).

``local`` (a state: the client's own values of the ``[strategy]
local_keys``, FedBN) replaces those keys of the model a ``fit`` or an
``evaluate`` starts from.

A ``fit`` without ``state`` starts from the worker's model (the round's
global state, sent once per worker by ``set_state``), and never changes
it. With ``keep = KEY`` a fit's (or a ``grads``') result stays on the
worker and the reply carries only ``examples``, ``metrics`` and
``kept = KEY``; the coordinator pulls it with ``take`` when the fold is
ready for it (:mod:`meshkit.train._rounds.engine`). Without ``keep`` the reply
carries the result itself.

A ``fit`` with ``poison = {"name": ATTACK, "options": {...}}`` is a
simulated data-poisoning attacker's (``[attack]``, e.g. ``label-flip``):
the worker trains on poisoned data. A reply with ``attacked = NAME`` comes
from a poisoned fit, or from a node started with ``meshkit node --attack``;
the coordinator lists that client in the round's ``attacked``.

``step`` is data-parallel on a mesh: the worker computes its shard's
gradients, averages them with the other ``ranks`` through
``group.mesh_all_reduce`` (no fold on the coordinator) and applies the mean
to its replica, as ``grads`` + ``apply`` would.

The data never travels: every node builds the same task and takes shard
``shard`` of ``shards`` of its training data (inputs and targets together).
A request the task cannot serve is answered with ``{"error": MESSAGE}``;
one that does not fit its schema, with ``{"error": "protocol error: ..."}``.
"""

from __future__ import annotations

import operator
from collections import abc
from typing import Any, Mapping

from meshkit.errors import ProtocolError
from meshkit.transport.tags import TAG_REPLY, TAG_REQUEST

__all__ = ["TAG_REQUEST", "TAG_REPLY", "encode", "decode"]


#: Request/reply fields that hold a nested state and travel flattened.
_NESTED = ("state", "gradients", "local", "partial",
           # a compressed fit_batch's, each entry `KEY/NAME` (meshkit.train._rounds.compressed)
           "locals", "payloads",
           # a DiLoCo replica's (meshkit.train._worker.local_sgd)
           "codes", "scales", "update_codes", "update_scales", "anchor", "optimizer",
           "snapshot", "totals", "shared", "outer_state")


#: ``key.startswith("#")`` and ``"/" in key`` as C callables, for filter().
_COUNT = operator.methodcaller("startswith", "#")
_PATH = operator.methodcaller("__contains__", "/")


def encode(message: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten nested states into one wire-level state (``"state/<key>"``)."""
    out: dict[str, Any] = {}
    for key, value in message.items():
        if key in _NESTED and (type(value) is dict or isinstance(value, abc.Mapping)):
            # The count (so an empty state still travels) sits beside the
            # flattened keys, where no state key can land: "#state".
            out[f"#{key}"] = len(value)
            for inner, leaf in value.items():
                out[f"{key}/{inner}"] = leaf
        else:
            out[key] = value
    return out


def decode(frame: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`encode`.

    A frame that cannot be the encoding of a message -- a field that is both
    a plain value and a flattened state, or a ``#state`` count that is not
    the number of ``state/`` entries -- is a :class:`~meshkit.ProtocolError`
    for its sender (the pools and the worker treat it as any message that
    does not fit its schema).
    """
    # Each request and reply comes through here: the plain fields are copied in C,
    # and only the keys that can be counts or flattened entries are looked at in
    # Python (a loop over every key was four lines an entry, issue 36).
    counts = {}
    for key in filter(_COUNT, frame):
        if key[1:] in _NESTED:
            counts[key[1:]] = frame[key]
    for head in counts:
        if head in frame:
            raise ProtocolError(f"{'#' + head!r} beside a plain {head!r}")
    out: dict[str, Any] = {head: {} for head in counts}
    out.update(frame)
    for head in counts:
        del out["#" + head]
    for key in filter(_PATH, frame):
        head, _, inner = key.partition("/")
        if head in _NESTED:
            if head not in counts:
                raise ProtocolError(f"{key!r} without its count {'#' + head!r}")
            out[head][inner] = out.pop(key)
    for head, count in counts.items():
        if type(count) is not int or count != len(out[head]):
            raise ProtocolError(f"{'#' + head!r} says {count!r} entries, the frame has "
                                f"{len(out[head])}")
    return out
