"""The one round engine: every strategy's contributions reach the fold here, and only here.

Rule: a round's contributions (clients' fits, replicas' gradients) are
folded one at a time, in key order (the client or shard id), through the
aggregator's streaming fold, while the coordinator holds at most ``window``
whole contributions besides what the fold itself keeps (one, for the
built-in means). So coordinator memory does not grow with the number of
workers or clients, and the fold order -- hence every bit of the result --
does not depend on which worker answered first.

How a round goes (:func:`fold_round`):

1. The round's global state, when there is one, goes once to each worker
   the round needs. In a round of fits it goes with the worker's first fit
   (the fit's ``set_state``: the worker holds it as a ``set_state`` would,
   discarding what an earlier round left on the worker), one message
   instead of two. A worker lost on that fit is lost as on any fit (a
   worker that died between rounds costs its first client one strike of
   step 7's two, as a worker dying mid-fit does); an ``error`` reply to it
   (the worker may have refused it before holding the state) has its next
   request carry the state again; a worker brought in mid-round to stand in
   for a lost one is sent its state with its first fit the same way. Other
   rounds (gradients) send ``set_state`` first and hand a worker work only
   after it acknowledged it.
2. The keys are planned round-robin over those workers, in key order (the
   first worker the first key, ...), and handed out one request at a time
   per worker; a worker done with its plan takes over the last planned key
   of the busiest ready worker, so a slow worker does not hold up the round.
   A fit's result stays on its worker (``keep``) and the reply is small. A
   worker keeps at most :data:`HOLD` results waiting (more only when the
   fold waits on the next key).
3. The coordinator pulls results (``take``) only for the first ``window``
   keys not folded yet, and folds each as soon as every key before it is
   folded. A key handed out while it is among those first ``window`` keys
   is not kept: its result comes back with the fit's answer (one message,
   not three), since it would be pulled as soon as it answered; every
   result pulled or on its way is a distinct key of the window, so the
   bound holds. A small model's results reach further: the window is
   widened by as many results as fit in :data:`INLINE_BYTES` (4 MiB; none
   for a model above it, :func:`.flat.inline_reach`), which do not count
   against ``window`` -- so a digits-sized round sends one fit a client and
   no ``take``, and the coordinator holds at most ``window`` model-sized
   results plus 4 MiB of small ones.
4. A worker that dies or stalls (the pool declares it dead in the ledger)
   loses everything it held or was doing for this round; those keys go
   back to the front of the queue and are served again by a live worker in
   the same round. A fit is a pure function of (global state, shard, seed),
   so the re-served contribution is the very same bits. A key no live
   worker is left to serve is recorded as not served, with the reason.
5. A key pinned to a rank (``Work.rank``: a client whose data only that
   node has) is planned for that worker alone and never taken over; when
   that worker is lost, the key is not served this round.

5. With a round deadline (``deadline`` seconds, ``[strategy]
   round_timeout``), the engine stops handing out work when it passes:
   every key whose fit had not answered by then is *late*, recorded in
   ``not_served`` (the reason starts with ``late``) and in ``Folded.late``,
   and its request is abandoned in the pool (:meth:`WorkerPool.abandon`),
   so the worker is not declared dead and its late reply is discarded when
   it comes, never taken for the next round's. Keys that had answered are
   still pulled and folded.

6. Every reply was checked against its schema where the pool took it in
   (:mod:`meshkit.train._messages`); one that did not fit came back as a
   lost worker, its rank declared dead with a ``protocol error`` reason. A
   pulled result is checked here against the round's model too (a fit's:
   the same keys; gradients: some of them; each array the same shape and
   dtype as the model's): one that does not match
   costs its rank the same way, and its keys are served again -- a
   malformed or hostile worker costs its own rank, never the round.

7. A member's failure -- an ``error`` reply, a contribution that does not
   match the round's model or holds NaN or inf -- drops that rank for the
   rest of the round and its keys are served again; a client that fails on
   two ranks is the client's failure and is not served again this round
   (:mod:`meshkit.train._failures` decides, and counts the rank's strikes
   towards quarantine). With ``[strategy] accept_failures = false`` any of
   them stops the run instead. NaN and inf are scanned for at the boundary
   (one sum per float array) -- except when the fold is the engine's own
   strict mean (``fedavg``, ``allreduce``), which finds them while it sums
   at no extra cost: when it refuses a contribution, the round is played
   again from the start with the boundary scan on, so the sender is dropped
   exactly as above and the result is the same bits (every fit is a pure
   function of its client). An honest round never pays for a second pass
   over a model; a hostile one costs one round's work again. A fold that
   lets them through (``[aggregator] allow_nonfinite = true``) is not
   scanned: the user asked for them. Under the strict mean a finite value
   out of its range (:meth:`MeanFold.value_limit`: 1.3e154 in a float64
   sum, 1.8e19 in a float32 one; a worker's 1e308) is refused the same way:
   the fold's test per chunk sees it in the running sum, and the boundary
   scan (a replay, a relay's own fold) tests each contribution's values
   against the limit in the same pass as NaN.

The flat round plays on the scheduler the batched round shares
(:mod:`.scheduler`: requests in flight, who serves next, what a lost worker
or a member's failure costs -- steps 1, 2, 4 and 7); :class:`.flat.FlatRound`
supplies its requests and what a pulled contribution folds into.

Which path a round takes is one table, :data:`ROUND_PATHS`, asked in order:
collective (every rank plays its slice, :mod:`.collective`), relayed (host
relays fold their ranks' contributions and the coordinator one partial per
relay, :mod:`.relayed`), compressed batched (a worker answers a batch of clients with
each one's compressed payload, folded chunk by chunk into one exact sum,
:mod:`.compressed`), batched (each worker folds its own clients exactly,
:mod:`.batched`), and the flat round above, which plays every other round.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Generic, Mapping, Sequence, TypeVar

import attrs

from meshkit.aggregation import MeanFold, exact_mean, one_at_a_time
from meshkit.errors import AggregationError, RefusedError
from meshkit.privacy import ClippedSum
from meshkit.train._local_keys import ClientLocal
from meshkit.train._rounds.collective import fold_collectively
from meshkit.train._attacks import AttackedFold, poison_request
from meshkit.train._messages import signature
from meshkit.train._rounds.batched import batch_applies, fold_batched
from meshkit.train._relay.host import answer_request
from meshkit.train._rounds.relayed import (RelayPlan, fold_through_relays, relay_plan_applies,
                                          relay_weight)
from meshkit.train._pool import WorkerPool
from meshkit.train._strategy import StrategyContext
from meshkit.train._rounds.compressed import (Unpacker, compressed_batch_applies, compressed_work,
                                              flat_payload_fold, play_compressed_batched)
from meshkit.train._rounds.flat import FlatRound, PieceFlatRound
from meshkit.train._rounds.pieces import pieces_apply
from meshkit.train._rounds.work import (DEFAULT_WINDOW, HOLD, INLINE_BYTES, Folded, Work,
                                       by_examples, once, train_loss)

__all__ = ["Work", "Folded", "fold_round", "by_examples", "once", "train_loss", "HOLD",
           "INLINE_BYTES", "DEFAULT_WINDOW", "answer_relay_request", "RoundCall", "RoundPath", "ROUND_PATHS",
           "round_path"]

log = logging.getLogger(__name__)

def fold_round(ctx: StrategyContext, work: Sequence[Work], *,
               state: Mapping[str, Any] | None = None,
               weight: Callable[[Mapping[str, Any]], float] = by_examples,
               window: int = DEFAULT_WINDOW, fold: Any = None,
               label: str = "client", deadline: float | None = None,
               reference: Mapping[str, Any] | None = None,
               local: ClientLocal | None = None, batch: bool = True,
               send_state: Callable[[int], Mapping[str, Any]] | None = None,
               on_stale: Callable[[int], None] | None = None) -> Folded:
    """Serve ``work`` on the live workers and fold the contributions in key order.

    ``state`` (the round's global state) is sent once to each worker the
    round needs; without it the workers' own state is used (data-parallel
    replicas). ``weight(reply)`` gives a contribution's weight from its small
    reply (default: examples seen). ``fold`` defaults to the aggregator's
    (``ctx.aggregation_begin()``). ``label`` names contributions in errors
    (``"client 3 (rank 2)"``). ``deadline`` (seconds from now; None or 0:
    none) is the round deadline of the module docstring's step 5.
    ``reference`` is the model every contribution must match key for key
    (shape and dtype; default: ``state``): a result that does not is its
    worker's :class:`~meshkit.ProtocolError` (module docstring, step 6). With
    ``local`` (the run's :class:`ClientLocal`, FedBN), each pulled
    contribution's local keys are kept there for its key (the client) and
    only the rest is folded, so the result lacks them. ``batch=False`` plays
    the round flat (per client) even where the batched round
    (:mod:`meshkit.train._rounds.batched`) applies: its result then is the
    aggregator's own fold in key order, bit for bit. ``send_state(rank)``
    is the ``set_state`` request each worker is sent (default: ``state``
    whole; in a flat round of fits its ``state`` and ``trainable`` go with the
    worker's first fit); ``[strategy] trainable`` sends the whole model only to a worker
    that lacks it (:class:`meshkit.train.Trainable`), and its round is never
    relayed or collective. ``on_stale(rank)`` is told of a worker that answered its
    ``set_state`` ``stale`` (``[compression] broadcast``: it lacks the delta's base,
    :mod:`meshkit.train._broadcast`) before ``send_state(rank)`` is asked again, for the
    whole model.

    Which way the round is played is :data:`ROUND_PATHS`' first path that
    applies (:func:`round_path`).
    """
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    if deadline is not None and not deadline >= 0:
        raise ValueError(f"deadline must be a number of seconds >= 0, got {deadline}")
    keys = [w.key for w in work]
    if len(set(keys)) != len(keys):
        raise ValueError(f"every piece of work needs its own key, got {keys}")
    call = RoundCall(ctx, work, state=state, weight=weight, window=window, given=fold,
                     label=label, deadline=deadline, reference=reference, local=local,
                     batch=batch, send_state=send_state, on_stale=on_stale)
    folded = round_path(call).play(call)
    if call.compressed is not None and ctx.residual_pins is not None:
        ctx.residual_pins.folded(folded.served, call.requests)
    return folded


_T = TypeVar("_T")


class _once(Generic[_T]):
    """``functools.cached_property`` without Python 3.11's class-wide lock (3.12 dropped
    it): a round's call reads eight of them once each, and the lock and its lookups were
    ~30 calls a round (issue 36). Computed on first read, then an attribute."""

    def __init__(self, func: Callable[[Any], _T]) -> None:
        self.func, self.name, self.__doc__ = func, func.__name__, func.__doc__

    def __get__(self, obj: Any, owner: Any = None) -> _T:
        if obj is None:  # read on the class: the descriptor, as cached_property gives
            return self  # type: ignore[return-value]
        value = obj.__dict__[self.name] = self.func(obj)
        return value


class RoundCall:
    """One call of :func:`fold_round`, and what decides its path, each worked out once.

    The derived values are computed the first time a path asks for them, in
    the table's order: the collective path is decided before the round's
    fold is begun, since every rank then folds its own slice.
    """

    def __init__(self, ctx: StrategyContext, work: Sequence[Work], *,
                 state: Mapping[str, Any] | None,
                 weight: Callable[[Mapping[str, Any]], float], window: int, given: Any,
                 label: str, deadline: float | None, reference: Mapping[str, Any] | None,
                 local: ClientLocal | None, batch: bool,
                 send_state: Callable[[int], Mapping[str, Any]] | None = None,
                 on_stale: Callable[[int], None] | None = None) -> None:
        self.ctx, self.work, self.state, self.weight = ctx, work, state, weight
        self.send_state, self.on_stale = send_state, on_stale
        self.window, self.given, self.label, self.deadline = window, given, label, deadline
        self.reference = state if reference is None else reference
        self.local, self.batch = local, batch

    @_once
    def attack(self) -> Any:
        """The run's simulated attack; a given fold (a relay group's, a collective
        rank's) is never attacked again."""
        return self.ctx.attack if self.given is None else None

    @_once
    def fold(self) -> Any:
        """The round's fold: the given one, else the aggregator's, measured from the
        round's global state (the reference a rule on updates measures from) and
        wrapped by a simulated attack (:mod:`meshkit.train._attacks`)."""
        if self.given is not None:
            return self.given
        fold = self.ctx.aggregation_begin(reference=self.state)
        if self.attack is not None:
            fold = AttackedFold(fold, self.attack, self.state,
                                {w.key: int(w.request.get("seed", w.key)) for w in self.work})
        return fold

    @_once
    def compressed(self) -> tuple[list[Work], ClientLocal | None, Unpacker] | None:
        """A compressed round's work (fits asking for ``compress``), the store its local
        keys and residuals are kept in, and its decoder (:func:`compressed_work`); None
        when contributions come whole."""
        if self.ctx.compression is None or self.state is None or not all(
                w.request.get("op") == "fit" for w in self.work):
            return None
        return compressed_work(self.ctx, self.work, self.state, self.local)

    @property
    def unpack(self) -> Unpacker | None:
        return None if self.compressed is None else self.compressed[2]

    @property
    def fold_local(self) -> ClientLocal | None:
        """The client-local store the flat round keeps local keys (and residuals) in."""
        return self.local if self.compressed is None else self.compressed[1]

    @_once
    def requests(self) -> dict[int, Mapping[str, Any]]:
        work = self.work if self.compressed is None else self.compressed[0]
        return {w.key: poison_request(self.attack, w.key, w.request) for w in work}

    @_once
    def pinned(self) -> dict[int, int]:
        # A compressed round may pin its clients (residual = "worker": .pins).
        work = self.work if self.compressed is None else self.compressed[0]
        return {w.key: w.rank for w in work if w.rank is not None}

    @_once
    def how(self) -> str | None:
        """Each contribution's weight as a name a worker or relay can apply
        (``"examples"``, ``"once"``), or None when a round must fold flat: a
        deadline is kept per client, pinned work stays on its node, an attack
        poisons single contributions, local keys fold whole contributions, and a
        compressed round's contributions cross the wire compressed once (relays and the
        batched round would sum whole ones: meshkit.compression._plan)."""
        if self.deadline or self.pinned or self.local or self.attack \
                or self.compressed is not None:
            return None
        return relay_weight(self.weight, by_examples)

    @_once
    def mean(self) -> Any:
        """The strict mean sums may stand in for, decided by the aggregator's declared
        traits (a given fold is a relay group's own mean, or a collective rank's feed)."""
        if self.how is None:
            return None
        return self.fold if self.given is not None else exact_mean(self.ctx.aggregator, self.fold)

    @_once
    def relays(self) -> RelayPlan | None:
        if self.mean is None or self.send_state is not None:
            return None  # a relay sends its workers the round's state whole
        return relay_plan_applies(self.ctx, self.mean, self.how, [w.key for w in self.work])


@attrs.frozen
class RoundPath:
    """One way a round is played: when it applies (in words, and as a test), and how."""

    name: str
    when: str
    applies: Callable[[RoundCall], bool]
    play: Callable[[RoundCall], Folded]


def _play_collective(call: RoundCall) -> Folded:
    if call.send_state is not None:
        raise RefusedError(
            "[strategy] trainable: a collective (torchrun spmd) round has every rank hold "
            "and fold the whole model, so it cannot send only the trainable keys; drop "
            "trainable, or run with the coordinator's round engine (meshkit run)")
    # Every rank plays the round: its slice, one exact partial, one all-reduce.
    return fold_collectively(call.ctx, call.work, state=call.state, weight=call.weight,
                             window=call.window, label=call.label, serve=fold_round,
                             folded_type=Folded,
                             unsupported=bool(call.deadline or call.local or call.ctx.attack
                                              or call.ctx.compression))


def _play_relayed(call: RoundCall) -> Folded:
    assert call.relays is not None and call.how is not None  # relayed's `applies` checked
    result, served, not_served, replies, failed = fold_through_relays(
        call.ctx, call.relays, call.requests, call.state, call.how, call.window, call.mean,
        call.label, _play_group)
    return Folded(result, served, not_served, replies, attacked=_declared(served, replies),
                  failed=failed)


def _batched_applies(call: RoundCall) -> bool:
    # A given fold is batched only when it is a private round's exact sum of clipped
    # updates (meshkit.privacy.ClippedSum): each worker folds its clients' clipped updates.
    return (call.batch and (call.given is None or isinstance(call.given, ClippedSum))
            and call.reference is not None and call.mean is not None
            and batch_applies(call.mean, call.how, call.requests, call.state,
                              len(call.ctx.live)))


def _play_batched(call: RoundCall) -> Folded:
    assert call.how is not None and call.state is not None  # batch_applies checked both
    assert call.reference is not None
    result, served, not_served, replies, failed = fold_batched(
        call.ctx, call.requests, call.state, call.how, call.label, signature(call.reference),
        name=call.mean.name,
        private=call.given if isinstance(call.given, ClippedSum) else None,
        send_state=call.send_state)
    return Folded(result, served, not_served, replies, attacked=_declared(served, replies),
                  failed=failed)


def _play_flat(call: RoundCall) -> Folded:
    ctx, fold, state = call.ctx, call.fold, call.state
    # A compressed round under a linear rule sums each payload chunk by chunk, exactly
    # (never a float copy of a contribution); the client-local store is the fold's.
    payloads = flat_payload_fold(call)
    if payloads is not None:
        fold = payloads
    expected = None if call.reference is None else signature(call.reference)
    # The engine's own strict mean finds NaN/inf while it sums (step 7): no scan first.
    # A fold told to let them through ([aggregator] allow_nonfinite) is not overruled.
    allows = bool(getattr(fold, "allow_nonfinite", False))
    replay = call.given is None and call.attack is None and type(fold) is MeanFold \
        and not allows
    # Under the strict mean a value beyond its range is its sender's too (step 7): the
    # boundary, when it scans (a replay, a relay's fold), tests it in the same pass.
    limit = fold.value_limit if type(fold) is MeanFold else None
    # A model above one piece comes in pieces, folded as they arrive (.pieces).
    pieces = replay and not (call.fold_local or call.unpack or call.deadline or call.send_state) \
        and pieces_apply(fold, call.reference, call.requests, ctx.piece_bytes)
    round_ = (PieceFlatRound if pieces else FlatRound)(
        ctx, call.requests, state, call.weight, call.window, fold, call.label,
        pinned=call.pinned, deadline=call.deadline or None, expected=expected,
        local=None if payloads is not None else call.fold_local or None,
        scan=not replay and not allows, unpack=call.unpack,
        limit=limit, state_request=call.send_state, on_stale=call.on_stale)
    if pieces:
        assert call.reference is not None  # pieces_apply checked
        round_.use_pieces(call.reference, ctx.piece_bytes)  # type: ignore[attr-defined]
    try:
        folded = round_.play()
    except AggregationError as exc:
        if not replay:
            raise
        log.warning("the fold refused a contribution (%s); the round is played again with "
                    "every contribution scanned at the boundary", exc)
        again = ctx.aggregation_begin(reference=state)
        if pieces:
            # The grouping of a fold in pieces, so the replay has its bits (.pieces).
            one_at_a_time(again)
        round_ = FlatRound(ctx, call.requests, state, call.weight, call.window, again, call.label,
                        pinned=call.pinned, deadline=call.deadline or None, expected=expected,
                        local=call.fold_local or None, scan=True, unpack=call.unpack,
                        limit=limit, state_request=call.send_state, on_stale=call.on_stale)
        folded = round_.play()
    simulated = set(getattr(fold, "attacked", ()))
    attacked = tuple(sorted(simulated | set(_declared(folded.served, folded.replies))))
    # Folded is frozen: the same record when nothing changes (a round with no attack).
    return folded if attacked == folded.attacked else attrs.evolve(folded, attacked=attacked)


#: The round paths, in the order they are asked: the first that applies plays the round.
#: (The secure round is not here: a strategy that declares ``secure`` calls
#: :func:`meshkit.train.secure_sum` instead, :mod:`meshkit.train._rounds.secure`.)
ROUND_PATHS: tuple[RoundPath, ...] = (
    RoundPath("collective",
              "every rank plays the round (torchrun spmd: no coordinator) and the caller "
              "gave no fold of its own",
              lambda call: call.ctx.collective is not None and call.given is None,
              _play_collective),
    RoundPath("relayed",
              "some live worker is behind a host relay, the aggregator is linear (or the "
              "caller gave a strict mean), and nothing needs single contributions: no round "
              "deadline, no pinned work, no simulated attack, no local keys, no compression",
              lambda call: call.relays is not None, _play_relayed),
    RoundPath("compressed batched",
              "a compressed round of fits, the aggregator linear, at least two fits a worker, "
              "and as for batched: each worker answers a batch with its fits' compressed "
              "payloads, folded chunk by chunk into one exact sum -- or, with [compression] "
              "clip_range, with one exact integer sum of their codes on the shared grid "
              "(.compressed)",
              compressed_batch_applies, play_compressed_batched),
    RoundPath("batched",
              "the aggregator is linear (or the round is private: its fold a ClippedSum), "
              "nothing needs single contributions, and there are at least two fits a "
              "worker: each worker folds its own clients exactly",
              _batched_applies, _play_batched),
    RoundPath("flat", "every other round: one contribution at a time, in key order",
              lambda call: True, _play_flat),
)


def round_path(call: RoundCall) -> RoundPath:
    """The first of :data:`ROUND_PATHS` that applies to ``call`` (the last always does)."""
    return next(path for path in ROUND_PATHS if path.applies(call))


def _declared(served: Mapping[int, int], replies: Mapping[int, Mapping[str, Any]]
              ) -> tuple[int, ...]:
    """The served keys whose node said it attacked (``meshkit node --attack``)."""
    return tuple(sorted(k for k in served if replies.get(k, {}).get("attacked")))


def _play_group(ctx: StrategyContext, requests: Mapping[int, Mapping[str, Any]], *,
                state: Mapping[str, Any] | None, weight: str, window: int, fold: Any,
                label: str) -> Folded:
    """One relay group's keys through the flat engine (a relay's, or the direct workers')."""
    return fold_round(ctx, [Work(k, r) for k, r in requests.items()], state=state,
                      weight=by_examples if weight == "examples" else once, window=window,
                      fold=fold, label=label)


def answer_relay_request(pool: WorkerPool, carried: frozenset[int], name: str,
                         message: Mapping[str, Any]) -> dict[str, Any]:
    """A host relay's answer to the coordinator's request ``message`` (``fold`` or
    ``fanout``), served on its own ranks through ``pool``
    (:func:`meshkit.train._relay.host.answer_request`)."""
    return answer_request(pool, carried, name, message, _play_group)
