"""Where every rank plays the round: its slice of the cohort, one exact partial, one all-reduce.

A *collective* run has no coordinator: every rank runs the same program
(``torchrun ... -m meshkit_torchdist CONFIG`` with ``[transport] mode =
"spmd"``; docs/scaling-out.md). Each rank builds the same components from
the same config and seed, so each samples the same cohort each round; the
strategy (any that declares ``StrategyTraits.collective``: ``federated``)
and the round skeleton are the ones every run uses, and only :func:`meshkit.train.fold_round` differs, by handing the
round to :func:`fold_collectively` when the context has a ``collective``:

1. **Who serves what** (:func:`cohort_slice`): the round's keys in ascending
   order, and rank ``r`` of ``W`` takes every ``W``-th from its own position,
   ``keys[r::W]`` (the order of torch's ``DistributedSampler``).
2. Each rank fits its clients one after another on its own in-process
   trainer (the flat round engine over a one-worker pool: the same
   ``Trainer`` a worker process runs, the same checks on each result) and
   folds them into an exact fixed-point partial
   (:class:`meshkit.aggregation.FixedPointSum`).
3. **One collective per round**: the partial's int64 sums, its mass and
   count, whether this rank was asked to stop, and a small table of who served each client (examples and
   ``train_loss``), packed into one int64 buffer, summed over every rank by
   the :class:`PartialReducer` (on torchdist: one gloo all-reduce). Integer
   sums are exact, so the round's aggregate is the same bits whatever the
   number of ranks and whoever served which client -- the same bits a
   ``meshkit run`` of the config gets, whose engine folds the same
   fixed-point sums.
4. Every rank divides out the mass and applies the same outer step; rank 0
   alone writes the run's files (the launcher's business, not this module's).

The buffer begins with a layout digest (keys, shapes, dtypes, the round's
keys): a rank whose layout differs (another config) is an
:class:`~meshkit.AggregationError` on every rank, found by the same sum.

A rank lost mid-round fails the collective on every survivor within the
reducer's timeout: the round fails with a :class:`~meshkit.PeerLostError`
naming the rank, and the last checkpoint is kept (``--resume`` continues).
Its clients are not replanned: every rank's slice was fixed before the
round, and a torch.distributed group does not shrink. A *client* whose fit
fails on its rank (an error, a contribution that does not fit the model or
is not finite) is that client's failure (:mod:`meshkit.train._failures`: a
round with one worker has no second rank to ask): it is not served, the
rank serves the rest of its slice, and the sum's table tells every rank.

What a collective round does not do (:func:`check_collective` refuses each
before any rank trains): a strategy that does not declare
``StrategyTraits.collective``, an aggregator that does not declare
``AggregatorTraits.linear`` (median, krum, ...: they are not sums; a linear
one's ``weight(w)`` is applied on each rank), ``[privacy]``, ``[attack]``, FedBN
``local_keys`` (a client's local values would live on whichever rank served
it last), ``round_timeout``, and node-local data (``[partitioner] name =
"local"``).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Mapping, Protocol, Sequence

import attrs
import numpy as np

from meshkit.aggregation import (FixedPartial, FixedPointSum, MeanFold, linear_weight,
                                 refuse_unless_linear)
from meshkit.errors import AggregationError, PeerLostError, RefusedError
from meshkit.population import population_size
from meshkit.state import is_array, is_float_dtype
from meshkit.train._strategy import StrategyContext
from meshkit.train._traits import StrategyTraits

__all__ = ["PartialReducer", "cohort_slice", "fold_collectively", "check_collective"]

#: Columns of the per-client table: served (1 on the rank that served it), that
#: rank + 1, examples, whether it reported a train_loss, the loss's float64 bits.
_COLUMNS = 5
#: Header: layout digest, ranks that summed (1 each), mass, count, ranks asking to stop.
_HEADER = 5
#: The largest mass (in the sum's 2**-F units) a rank may put in: the sum of
#: up to 2**10 ranks' still fits an int64.
_MAX_MASS = (1 << 52) - 1


class PartialReducer(Protocol):
    """What a collective run's transport provides: one int64 sum over every rank.

    ``rank`` and ``world`` are this process's place in the run (0-based,
    every rank of the run takes part in every sum). ``stop_requested`` (a
    ``threading.Event``, optional) asks for the run to stop: it travels in
    the round's sum, and every rank stops after that round, between rounds,
    the same round everywhere (a SIGTERM on one rank cannot leave the
    others waiting in a sum it never joins).
    """

    @property
    def rank(self) -> int: ...

    @property
    def world(self) -> int: ...

    def all_reduce(self, buffer: np.ndarray, timeout: float | None) -> None:
        """Sum the flat int64 ``buffer`` in place over every rank (same length everywhere).

        Raises:
            PeerLostError: a rank was lost or stalled past ``timeout`` seconds; the
                message names it. The sum failed on every rank that is left.
        """
        ...


def cohort_slice(keys: Sequence[int], rank: int, world: int) -> list[int]:
    """The keys ``rank`` of ``world`` serves: ``sorted(keys)[rank::world]``."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..{world - 1}, got {rank} of {world}")
    return sorted(keys)[rank::world]


def check_collective(*, strategy: str, aggregator: Any, privacy: Any, attack: Any,
                     partitioner_local: bool, traits: StrategyTraits, where: str,
                     task: Any = None) -> None:
    """Refuse, before any rank trains, what a collective round cannot play (module docstring).

    ``strategy`` is the configured name (for messages only); what it may play is
    its ``traits`` (:class:`meshkit.StrategyTraits`), never its name.
    """
    instead = ("run it with [transport] mode = \"coordinator\" (rank 0 coordinates, the "
               "other ranks serve) or with meshkit run")
    if not traits.collective:
        raise RefusedError(
            f"{where}: [strategy] name = {strategy!r}: a collective run (mode = \"spmd\") "
            f"plays only a strategy that declares the trait StrategyTraits.collective (its "
            f"rounds go through fold_round, each rank folding its slice of the cohort; "
            f"federated declares it), and this one lacks it; {instead}")
    refuse_unless_linear(
        aggregator, where=f"{where}: [aggregator] with [transport] mode = \"spmd\"",
        needs="a collective run sums each rank's clients exactly and adds the sums",
        instead=f"Use a linear aggregator (fedavg), or {instead}")
    fold = aggregator.begin() if callable(getattr(aggregator, "begin", None)) else None
    if isinstance(fold, MeanFold) and fold.allow_nonfinite:
        raise RefusedError(
            f"{where}: [aggregator] allow_nonfinite = true: a collective run's exact sums "
            f"cannot hold a NaN or an infinity; drop it, or {instead}")
    for present, what in ((privacy is not None, "[privacy]"), (attack is not None, "[attack]"),
                          (partitioner_local, "[partitioner] name = \"local\""),
                          (bool(traits.local_keys), "[strategy] local_keys"),
                          (bool(traits.round_timeout), "[strategy] round_timeout")):
        if present:
            raise RefusedError(
                f"{where}: {what} is not played by a collective run (mode = \"spmd\": every "
                f"rank folds its own clients and one sum per round combines them; see "
                f"docs/scaling-out.md for what it leaves out); drop it, or {instead}")
    clients = traits.clients or (population_size(task) or 0)
    if clients < 1:
        raise RefusedError(
            f"{where}: [strategy] clients is not set: a collective run simulates a "
            f"population of clients on every rank, and without a number the federated "
            f"strategy would take one client per worker; set [strategy] clients (or use a "
            f"population task, which says how many clients it has)")


def fold_collectively(ctx: StrategyContext, work: Sequence[Any], *,
                      state: Mapping[str, Any] | None,
                      weight: Callable[[Mapping[str, Any]], float], window: int, label: str,
                      serve: Callable[..., Any], folded_type: type,
                      unsupported: bool = False) -> Any:
    """Play one round collectively (module docstring); returns a :class:`Folded`.

    ``serve(ctx, work, state=, weight=, window=, fold=, label=)`` is the flat
    engine, run on this rank's slice over its one-worker pool;
    ``folded_type`` the engine's :class:`Folded` (the engine imports this
    module, not the other way round). ``unsupported``: the round asked for a
    deadline, local keys or an attack, which :func:`check_collective` refuses
    before the run; met here, it is refused again rather than ignored.
    """
    reducer: PartialReducer = ctx.collective
    if unsupported:
        raise RefusedError("a collective round plays no round_timeout, local_keys or "
                           "[attack] (check_collective refuses them before the run)")
    if state is None:
        raise RefusedError("a collective round folds clients' fits of the round's global "
                           "model; a round without one (data-parallel) is not played")
    if any(w.rank is not None for w in work):
        raise RefusedError("a collective round cannot pin a client to a rank (node-local "
                           "data): every rank serves its slice of the cohort")
    keys = sorted(w.key for w in work)
    mine = set(cohort_slice(keys, reducer.rank, reducer.world))
    fixed = FixedPointSum()
    aggregator = ctx.aggregator

    def omega(reply: Mapping[str, Any]) -> float:
        # A linear rule's ωᵢ = weight(wᵢ): every rank holds the aggregator, so
        # (unlike a relay or a batched worker) it applies any declared weight.
        return linear_weight(aggregator, weight(reply))

    local = serve(attrs.evolve(ctx, collective=None), [w for w in work if w.key in mine],
                  state=state, weight=omega, window=window, fold=_Feed(fixed), label=label)
    layout = _layout(state, keys)
    buffer = _pack(layout, fixed, local, keys, reducer.rank)
    asked = getattr(reducer, "stop_requested", None)
    buffer[4] = 1 if asked is not None and asked.is_set() else 0
    try:
        reducer.all_reduce(buffer, ctx.timeout)
    except PeerLostError as exc:
        raise PeerLostError(f"{exc}. {ctx.resume_advice()}") from None
    if buffer[4] > 0:
        # Every rank reads the same sum, so every rank stops after this same round.
        ctx.stop.set()
    return _unpack(layout, buffer, keys, reducer, local, fixed.fraction_bits, folded_type)


class _Feed:
    """The flat engine's fold on this rank: contributions go into the partial, which stays
    a sum (the engine's closing ``result()`` divides nothing; the mass is divided once,
    after the all-reduce)."""

    def __init__(self, fixed: FixedPointSum) -> None:
        self.fixed = fixed

    def add(self, state: Mapping[str, Any], weight: float = 1.0, *,
            source: str | None = None) -> None:
        self.fixed.add(state, weight, source=source)

    def result(self) -> None:
        return None


@attrs.frozen
class _Layout:
    keys: tuple[str, ...]
    sizes: tuple[int, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    digest: int


def _layout(state: Mapping[str, Any], cohort: Sequence[int]) -> _Layout:
    names, sizes, dtypes, shapes = [], [], [], []
    for key, value in state.items():
        if not (is_array(value) and is_float_dtype(np.asarray(value).dtype)):
            raise RefusedError(
                f"a collective round sums float arrays only, and the model's {key!r} is "
                f"{type(value).__name__ if not is_array(value) else np.asarray(value).dtype}: "
                f"its value on each rank could not be checked equal by one sum; run with "
                f"[transport] mode = \"coordinator\" or with meshkit run")
        array = np.asarray(value)
        names.append(key)
        sizes.append(int(array.size))
        dtypes.append(str(array.dtype))
        shapes.append(tuple(int(n) for n in array.shape))
    described = repr((names, sizes, dtypes, shapes, list(cohort))).encode()
    # 31 bits: the digest times the world still fits an int64 many times over.
    digest = int.from_bytes(hashlib.blake2b(described, digest_size=4).digest(), "big") >> 1
    return _Layout(tuple(names), tuple(sizes), tuple(dtypes), tuple(shapes), digest)


def _pack(layout: _Layout, fixed: FixedPointSum, local: Any, keys: Sequence[int],
          rank: int) -> np.ndarray:
    total = _HEADER + sum(layout.sizes) + _COLUMNS * len(keys)
    buffer = np.zeros(total, np.int64)
    buffer[0], buffer[1] = layout.digest, 1
    if fixed.count:
        partial = fixed.partial()
        if not 0 <= partial.mass <= _MAX_MASS:
            raise AggregationError(
                f"rank {rank}: the round's mass ({fixed.mass:g} examples) is past what one "
                f"int64 sum of every rank's holds; sample fewer clients a round")
        buffer[2], buffer[3] = int(partial.mass), int(partial.count)
        at = _HEADER
        for key, size in zip(layout.keys, layout.sizes):
            buffer[at:at + size] = np.asarray(partial.sums[key], np.int64).reshape(-1)
            at += size
    table = buffer[_HEADER + sum(layout.sizes):].reshape(len(keys), _COLUMNS)
    for i, client in enumerate(keys):
        if client not in local.served:
            continue
        reply = local.replies[client]
        table[i, 0], table[i, 1] = 1, rank + 1
        table[i, 2] = int(reply.get("examples", 0))
        loss = (reply.get("metrics") or {}).get("train_loss")
        if loss is not None:
            table[i, 3] = 1
            table[i, 4] = np.float64(loss).view(np.int64)
    return buffer


def _unpack(layout: _Layout, buffer: np.ndarray, keys: Sequence[int], reducer: PartialReducer,
            local: Any, fraction_bits: int, folded_type: type) -> Any:
    world = reducer.world
    if int(buffer[1]) != world or int(buffer[0]) != layout.digest * world:
        raise AggregationError(
            f"rank {reducer.rank}: the ranks of this collective run disagree on the round "
            f"(the model's keys, shapes or dtypes, or the round's clients): every rank must "
            f"run the same config with the same seed")
    sums: dict[str, np.ndarray] = {}
    at = _HEADER
    for key, size in zip(layout.keys, layout.sizes):
        sums[key] = buffer[at:at + size].copy()
        at += size
    table = buffer[at:].reshape(len(keys), _COLUMNS)
    served: dict[int, int] = {}
    replies: dict[int, Mapping[str, Any]] = {}
    not_served: dict[int, str] = {}
    for i, client in enumerate(keys):
        count, who = int(table[i, 0]), int(table[i, 1]) - 1
        if count == 1 and 0 <= who < world:
            served[client] = who
            metrics = ({"train_loss": float(np.int64(table[i, 4]).view(np.float64))}
                       if table[i, 3] == 1 else {})
            replies[client] = {"examples": int(table[i, 2]), "metrics": metrics}
        elif count == 0:
            owner = i % world
            not_served[client] = local.not_served.get(client) or f"rank {owner} could not serve it"
        else:
            raise AggregationError(f"client {client} was folded by {count} ranks; each client "
                                   f"belongs to one rank's slice")
    count = int(buffer[3])
    if count != len(served):
        raise AggregationError(f"the collective sum holds {count} contributions but the "
                               f"ranks report {len(served)} served clients")
    result = None
    if count:
        total = FixedPointSum(fraction_bits=fraction_bits)
        total.merge(FixedPartial(
            fraction_bits, int(buffer[2]), count,
            sums={k: v.reshape(shape) for (k, v), shape in zip(sums.items(), layout.shapes)},
            dtypes={k: np.dtype(d) for k, d in zip(layout.keys, layout.dtypes)},
            order=list(layout.keys)), source="the ranks' sum")
        result = total.result()
    return folded_type(result, served, not_served, replies)
