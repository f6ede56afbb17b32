"""``fedbuff``: buffered asynchronous aggregation, so the slowest client no longer sets the pace.

FedBuff (Nguyen et al., "Federated Learning with Buffered Asynchronous
Aggregation", AISTATS 2022); ``buffer_size = 1`` is FedAsync (Xie et al.,
"Asynchronous Federated Optimization", 2019), whose ``poly`` and ``hinge``
staleness rules are offered too -- in FedBuff's sense: the update against the
version the client started from, applied as it arrives (Xie et al. mix the
returned model into the current one instead; the two agree while that
version is current).

Rules (docs/async.md):

* ``concurrency`` clients train at once, each on the model version it was
  sent (the fit request carries that version). When one finishes, its
  update -- the pseudo-gradient ``Δ = x_start − x_fitted`` against the
  version it started from -- goes into the buffer and a new client is sent
  the current model. Clients are drawn uniformly from those neither in
  flight nor already in the buffer, by a generator seeded with (run seed,
  dispatch number): a client contributes at most once per server step.
* Staleness τ is the number of server steps between the version a client
  started from and the version its update is folded into. Its weight
  ``s(τ)``: ``sqrt`` ``1/√(1+τ)`` (the default, FedBuff's and FLSim's
  convention), ``poly`` ``(1+τ)^-a`` (a = 0.5), ``hinge`` ``1`` for τ <= b
  else ``1/(a(τ−b)+1)`` (a = 10, b = 4, FedAsync's), ``constant`` 1.
  ``max_staleness`` drops an update staler than that (its client is listed
  in the step's ``not_served`` with τ, never folded silently).
* Every ``buffer_size`` K updates the server steps. The buffer holds
  ``Σ n_i s(τ_i) Δ_i`` and ``Σ n_i`` (``n_i`` the examples a client trained
  on with ``fedavg``, 1 with ``allreduce``); the step's consensus is
  ``x − Σ n_i s(τ_i) Δ_i / Σ n_i`` and the outer optimizer steps from it, so
  it descends on the staleness-weighted mean update (with ``average`` and
  ``allreduce`` this is the paper's ``x ← x − (1/K) Σ s(τ_i) Δ_i``; with
  every τ = 0 and K = concurrency = clients it is a FedAvg round). Only the
  float arrays move by updates; integer arrays and JSON values take the
  value of the step's last update.
* Time. On real time (no ``[simulation]``), updates are folded as they
  arrive; each live worker holds at most ``ceil(concurrency / workers)``
  fits, so a dead rank lowers the concurrency and a rejoining one raises it
  again, and a fit lost with its worker is recorded and replaced. On the
  virtual clock (``[simulation] clock = "virtual"``) a client dispatched at
  simulated time t finishes at ``t + duration(client)``
  (:class:`meshkit.simulation.Speeds`), and the coordinator always folds
  the fit with the earliest simulated finish (ties: the earlier dispatch),
  waiting for its worker if need be; a fit lost with its worker is sent
  again to a live one. Arrival order and simulated time are then a pure
  function of the seed, and a replay is bit-identical.
* Checkpoint: after every step, besides the model, the fits in flight
  (client, seed, version, simulated finish), the model versions they need,
  the clock and the dispatch count. ``--resume`` sends those fits again --
  each a pure function of (version, client, seed) -- so a run killed with a
  half-full buffer continues exactly as if it had not been (the buffer's
  updates are recomputed, never lost).

* Aggregators, by their declared traits (:class:`meshkit.AggregatorTraits`,
  never their names). A *linear* one (``fedavg``, ``allreduce``, a
  third-party weighted mean) folds into the buffer's sums as above, ``n_i``
  being its ``weight(examples)``; under the strict mean (``fedavg``,
  ``allreduce``) an update holding a value beyond its range
  (:meth:`meshkit.aggregation.MeanFold.value_limit`, a worker's 1e308) is
  its sender's failure, as NaN is: dropped, the rank named in ``failed``.
  Any other rule (``median``, ``multi-krum``,
  ``centered-clipping``, ...) folds *each buffer*: at the step, every update
  is expressed against the current model, ``x_i' = x − s(τ_i) Δ_i``, and the
  rule combines the K models ``x_i'`` (weights: their examples) with the
  current model as the round's reference -- with every τ = 0 that is the rule
  on a synchronous round of K fits. The buffer then holds K models
  (O(K × model), as a robust round does).

Composes with every outer optimizer, ``time_budget`` (realized work; on real
time only: wall time would break the virtual clock's replay), every
aggregator (above), and host relays (fits are sent flat, relays forward).
Refused, each naming both keys: ``[privacy]`` (which clients reach a buffer
depends on their speed, not on independent sampling, so no subsampling
amplification can be claimed, and meshkit has no accountant for the
buffered mechanism: docs/async.md), ``[secure_aggregation]`` (FedBuff's
privacy claim rests on a trusted enclave holding the buffer, which meshkit
does not have), an omniscient ``[attack]`` (ALIE, IPM: they read a round's
honest updates, and a buffer's arrive one by one), ``evaluate = "clients"``,
and ``[partitioner] name = "local"`` (a client pinned to its node).

* ``[attack]`` (simulation): an attacking client's update is poisoned as it
  arrives, against the version it trained from (``sign-flip``, ``scale``,
  ``gaussian``, ``same-value``), or its fit request carries the data
  poisoning (``label-flip``); each step's ``attacked`` names them.
"""

from __future__ import annotations

import inspect
import logging
import math
from typing import Any, Callable, Mapping

import attrs
import numpy as np

from meshkit import AggregationError, ConfigError, MeshError, PeerLostError, RefusedError
from meshkit import WorkerError
from meshkit.compression import decode_contribution
from meshkit.attack import AttackRound, attack_rng, is_omniscient, tamper_contribution
from meshkit.partitioner import is_per_node
from meshkit.state import is_float_dtype
from meshkit.population import population_size
from meshkit.aggregation import MeanFold, aggregator_traits, linear_weight
from meshkit.train import Reply, RoundOutcome, StrategyContext, StrategyResult, StrategyTraits
from meshkit.train import DivergedFit, RoundFailures, check_contribution, client_seed
from meshkit.train import reply_failure
from meshkit.train import run_rounds, signature, strike
from meshkit.train import train_loss

from meshkit_strategies._shared import require_rows
from meshkit_strategies.options import FedBuffOptions

__all__ = ["FedBuff", "staleness_weight", "NOT_PRIVATE", "NOT_SECURE"]

log = logging.getLogger(__name__)

#: Why fedbuff plays no ``[privacy]`` round (quoted by the kernel's refusal).
NOT_PRIVATE = (
    "fedbuff's buffers are not sampled rounds: which clients reach a buffer depends on "
    "their speed and the order their fits finish, not on independent Poisson sampling, "
    "so the subsampled Gaussian's amplification cannot be claimed, and meshkit has no "
    "accountant for the buffered mechanism; use [strategy] name = \"federated\" for "
    "differential privacy")
#: Why fedbuff plays no ``[secure_aggregation]`` round.
NOT_SECURE = (
    "FedBuff's privacy claim rests on a trusted execution enclave holding the buffer, which "
    "meshkit does not have; updates reach the server one at a time, so there is no "
    "synchronous cohort whose masks cancel in one sum")
#: Defaults of the rules' parameters (FedAsync's experiments).
POLY_A = 0.5
HINGE_A = 10.0
HINGE_B = 4.0
#: Second word of the client draw's seed (the first is the run seed).
_DRAW_STREAM = 28


def staleness_weight(rule: str, tau: int, a: float | None = None,
                     b: float | None = None) -> float:
    """``s(τ)``: the weight of an update ``tau`` server steps stale (module docstring)."""
    if tau < 0:
        raise ValueError(f"staleness must be >= 0, got {tau}")
    if rule == "sqrt":
        return 1.0 / math.sqrt(1.0 + tau)
    if rule == "poly":
        return float((1.0 + tau) ** -(POLY_A if a is None else a))
    if rule == "hinge":
        a = HINGE_A if a is None else a
        b = HINGE_B if b is None else b
        return 1.0 if tau <= b else 1.0 / (a * (tau - b) + 1.0)
    if rule == "constant":
        return 1.0
    raise ValueError(f"unknown staleness rule {rule!r}")


@attrs.define
class Flight:
    """One client fit in flight: who, from which version, with which seed, until when."""

    dispatch: int
    client: int
    version: int
    seed: int
    #: Simulated finish time (virtual clock; 0.0 on real time).
    finish: float = 0.0
    rank: int | None = None
    ticket: int | None = None

    def to_json(self) -> list[Any]:
        return [self.dispatch, self.client, self.version, self.seed, self.finish]

    @classmethod
    def from_json(cls, row: Any) -> Flight:
        dispatch, client, version, seed, finish = row
        return cls(int(dispatch), int(client), int(version), int(seed), float(finish))


@attrs.define
class Buffer:
    """``Σ n_i s(τ_i) Δ_i`` over the float arrays, ``Σ n_i``, and who is in it."""

    sums: dict[str, np.ndarray] = attrs.Factory(dict)
    mass: float = 0.0
    #: The last update's integer arrays and JSON values (they take no mean).
    exact: dict[str, Any] = attrs.Factory(dict)
    #: (client, rank, τ, weight n_i s(τ_i), examples, train_loss or None), in fold order.
    entries: list[tuple[int, int, int, float, int, float | None]] = attrs.Factory(list)

    @property
    def clients(self) -> set[int]:
        return {e[0] for e in self.entries}

    def add(self, start: Mapping[str, Any], fitted: Mapping[str, Any], *, client: int,
            rank: int, tau: int, mass: float, scale: float, examples: int,
            loss: float | None) -> None:
        """Fold one update: ``mass * scale * (start - fitted)``; ``mass`` joins ``Σ n_i``."""
        factor = mass * scale
        for key, value in fitted.items():
            if isinstance(value, np.ndarray) and is_float_dtype(value.dtype):
                delta = update(start, value, key, f"client {client}'s update (rank {rank})")
                delta *= factor
                if key in self.sums:
                    self.sums[key] += delta
                else:
                    self.sums[key] = delta
            else:
                self.exact[key] = value
        self.mass += mass
        self.entries.append((client, rank, tau, factor, examples, loss))

    def consensus(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``x − Σ n_i s(τ_i) Δ_i / Σ n_i``, each array in the model's dtype."""
        out: dict[str, Any] = {}
        for key, value in state.items():
            if key in self.sums:
                out[key] = (np.asarray(value, dtype=np.float64) - self.sums[key] / self.mass
                            ).astype(value.dtype)
            else:
                out[key] = self.exact.get(key, value)
        return out


@attrs.define
class _Run:
    """What the asynchronous loop carries between server steps (and checkpoints)."""

    flights: list[Flight] = attrs.Factory(list)
    #: Model versions the flights started from: version -> state.
    models: dict[int, Mapping[str, Any]] = attrs.Factory(dict)
    #: Simulated seconds since the run began (virtual clock).
    clock: float = 0.0
    dispatched: int = 0
    #: Arrived replies the virtual clock has not reached yet: dispatch -> reply.
    arrived: dict[int, Reply] = attrs.Factory(dict)

    def state_dict(self, current: int) -> dict[str, Any]:
        """The checkpoint's ``strategy`` entry (the current version's model is the run's)."""
        needed = {f.version for f in self.flights} - {current}
        return {"flights": [f.to_json() for f in self.flights], "clock": self.clock,
                "dispatched": self.dispatched,
                "models": {str(v): dict(self.models[v]) for v in sorted(needed)}}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        self.flights = [Flight.from_json(row) for row in saved.get("flights", [])]
        self.clock = float(saved.get("clock", 0.0))
        self.dispatched = int(saved.get("dispatched", 0))
        self.models = {int(v): dict(m) for v, m in dict(saved.get("models") or {}).items()}


@attrs.define
class FedBuff:
    """Asynchronous buffered federated learning (module docstring)."""

    options: FedBuffOptions
    _run: _Run = attrs.field(factory=_Run, init=False)
    _failures: RoundFailures = attrs.field(factory=RoundFailures, init=False)

    @property
    def traits(self) -> StrategyTraits:
        """What the kernel reads of this strategy: it has clients, and orders arrivals by
        ``[simulation]``'s virtual clock when there is one; no private, secure or spmd
        rounds (``why_not`` says why)."""
        opts = self.options
        return StrategyTraits(
            partitioned=True, clocked=True, compressed=True, rounds=opts.rounds, clients=opts.clients,
            evaluate=opts.evaluate, device=opts.device, count_clients=self.clients,
            cohort=lambda clients: min(clients, opts.buffer_size),
            accept_failures=opts.accept_failures,
            check=self.check,
            why_not={"private": NOT_PRIVATE, "secure": NOT_SECURE,
                     "collective": "its server steps fold updates as they arrive, not "
                                   "rounds through fold_round"})

    def clients(self, workers: int, partitioner: Any = None, task: Any = None) -> int:
        """How many clients the run has: a population's size when the task is one
        (:mod:`meshkit.population`), else ``[strategy] clients`` (0: one per worker)."""
        size = population_size(task)
        if size is not None:
            if self.options.clients not in (0, size):
                raise ConfigError(
                    f"[strategy] clients = {self.options.clients}, but the task is a "
                    f"population of {size} clients; leave clients out (or set it to {size})")
            return size
        return self.options.clients or workers

    def check(self, *, task: Any, outer_name: str, workers: int, partitioner: Any = None,
              speeds: Any = None, aggregator: Any = None, attack: Any = None,
              compression: Any = None) -> None:
        """Refuse what cannot work, or would silently do nothing, before any process starts."""
        opts = self.options
        if compression is not None and compression.traits.stateful:
            raise RefusedError(
                f"[compression] name = {compression.name!r} with [strategy] name = "
                f"\"fedbuff\": error feedback adds a client's residual to its next update, "
                f"and fedbuff's updates are trained from different versions and folded as "
                f"they arrive, so a residual would land on a model it was not left from (the "
                f"compressor has the trait CompressionTraits.stateful). Use a stateless "
                f"compressor (quantize, or top-k with error_feedback = false), or "
                f"[strategy] name = \"federated\"")
        if attack is not None and is_omniscient(attack.attack):
            raise RefusedError(
                f"[attack] name = {attack.name!r} with [strategy] name = \"fedbuff\": an "
                f"omniscient attack reads the honest updates of a synchronous round, and a "
                f"buffer's updates arrive one by one, trained from different versions. Use a "
                f"non-omniscient attack (sign-flip, scale, gaussian, same-value, label-flip), or "
                f"[strategy] name = \"federated\"")
        if is_per_node(partitioner):
            raise RefusedError(
                "[partitioner] name = \"local\" with [strategy] name = \"fedbuff\": fedbuff "
                "draws each next client from a shared split, and a client pinned to its node "
                "cannot be drawn freely. Use a partitioner that splits the coordinator's data "
                "(iid, dirichlet, ...), or [strategy] name = \"federated\"")
        if opts.evaluate != "coordinator":
            raise RefusedError(
                f"[strategy] evaluate = {opts.evaluate!r} with name = \"fedbuff\": clients "
                f"are always training, on different versions, so there is no moment at which "
                f"the sampled clients evaluate one new global model. Use evaluate = "
                f"\"coordinator\"")
        if opts.staleness_a is not None and opts.staleness not in ("poly", "hinge"):
            raise ConfigError(
                f"[strategy] staleness_a = {opts.staleness_a:g}: only the \"poly\" and "
                f"\"hinge\" rules take a, and staleness = {opts.staleness!r}; drop it")
        if opts.staleness_b is not None and opts.staleness != "hinge":
            raise ConfigError(
                f"[strategy] staleness_b = {opts.staleness_b:g}: only the \"hinge\" rule "
                f"takes b, and staleness = {opts.staleness!r}; drop it")
        clients = self.clients(workers, partitioner, task)
        if clients < opts.buffer_size:
            raise ConfigError(
                f"[strategy] buffer_size = {opts.buffer_size}, but there are only {clients} "
                f"clients, and a client contributes at most once per server step; set "
                f"clients >= {opts.buffer_size} or lower buffer_size")
        if opts.concurrency > clients:
            raise ConfigError(
                f"[strategy] concurrency = {opts.concurrency}, but there are only {clients} "
                f"clients to train at once; lower concurrency or raise clients")
        if opts.time_budget and "time_budget" not in _fit_keywords(task):
            raise ConfigError(
                f"[strategy] time_budget = {opts.time_budget:g}: the task "
                f"({type(task).__name__}) cannot honour a time budget: its fit() takes no "
                f"time_budget argument (docs/tasks.md). Drop time_budget")
        if speeds is not None and opts.time_budget:
            raise RefusedError(
                f"[strategy] time_budget = {opts.time_budget:g} with [simulation]: a time "
                f"budget is wall time, so the work each fit does would depend on the "
                f"machine's load and the virtual clock's run would not replay. Drop "
                f"time_budget (the clock's durations say how slow each client is), or "
                f"remove [simulation] to run on real time")
        if speeds is not None:
            speeds.check_covers(clients)
        require_rows(task, clients)

    # -- the loop ----------------------------------------------------------------

    def run(self, ctx: StrategyContext) -> StrategyResult:
        self.check(task=ctx.task, outer_name=ctx.outer_name, workers=len(ctx.workers),
                   partitioner=ctx.partitioner, speeds=ctx.speeds,
                   aggregator=ctx.aggregator, attack=ctx.attack)
        self._run = _Run()
        if ctx.saved:
            self._run.load_state_dict(ctx.saved)
        steps = [ctx.start_round]

        def play(ctx: StrategyContext, rnd: int, state: Mapping[str, Any]) -> RoundOutcome:
            outcome = self.play_round(ctx, rnd, state)
            steps[0] = rnd
            return outcome

        ctx.strategy_state = lambda: self._run.state_dict(steps[0])
        try:
            return run_rounds(ctx, "fedbuff", self.options.rounds, ctx.initial_state(), play,
                              on_nonfinite=self.options.on_nonfinite, hand_state=False,
                              accept_failures=self.options.accept_failures)
        finally:
            # The fits still out are not needed: their late replies are discarded.
            for flight in self._run.flights:
                if flight.ticket is not None:
                    ctx.pool.abandon(flight.ticket)

    def play_round(self, ctx: StrategyContext, rnd: int,
                   state: Mapping[str, Any]) -> RoundOutcome:
        """One server step: fold arrivals until the buffer holds K updates, then step."""
        opts = self.options
        run = self._run
        version = rnd - 1  # server steps so far: the version ``state`` is
        run.models[version] = state
        buffer = Buffer()
        not_served: dict[int, str] = {}
        # A linear rule folds into the buffer's sums; any other folds the buffer
        # (module docstring), so it keeps each update until the step.
        linear = aggregator_traits(ctx.aggregator).linear
        held: list[tuple[int, dict[str, Any], float]] = []
        attacked: list[int] = []
        # A member's failure (an error reply, a fit that does not fit or is not
        # finite) benches its rank for this step (accept_failures; meshkit.train's
        # RoundFailures): its fit is recorded, and no new fit goes to it.
        self._failures = failures = RoundFailures(accept=ctx.accept_failures)
        expected = signature(state)
        # Under the strict mean (fedavg, allreduce) a finite value beyond its range
        # (MeanFold.value_limit: a worker's 1e308) is its sender's, as NaN is: refused
        # at the boundary, as the flat round refuses it (meshkit.train's round engine).
        limit = _strict_limit(ctx, state) if linear else None
        # Bounded: each pass folds, drops or loses one fit, and a fit is lost
        # at most once per worker.
        passes = 8 * (opts.buffer_size + opts.concurrency + 1) * (len(ctx.workers) + 1)
        for _ in range(passes):
            if len(buffer.entries) >= opts.buffer_size:
                break
            self._top_up(ctx, version, buffer)
            flight, reply = self._next_arrival(ctx)
            if reply.payload is None:
                if not ctx.accept_failures:  # any member failure ends the run
                    raise WorkerError(reply.rank, str(reply.error))
                not_served[flight.client] = f"lost: rank {reply.rank} ({reply.error})"
                self._release(version)
                continue
            start = run.models[flight.version]
            fitted = reply.payload["state"]
            try:
                if ctx.compression is not None:
                    fitted, _ = decode_contribution(
                        ctx.compression.compressor, fitted, start,
                        raw=_sent_whole(ctx, start),
                        what=f"rank {reply.rank}'s fit of client {flight.client}")
                check_contribution(fitted, expected, f"rank {reply.rank}'s fit of client "
                                                     f"{flight.client}", limit=limit)
            except MeshError as exc:  # a ProtocolError: its sender's (or its client's)
                reason = f"protocol error: {exc}"
                if not failures.client_failed(flight.client, reply.rank, reason):
                    failures.rank_failed(reply.rank, reason)
                not_served[flight.client] = f"failed: rank {reply.rank} ({reason})"
                self._release(version)
                continue
            tau = version - flight.version
            if opts.max_staleness is not None and tau > opts.max_staleness:
                not_served[flight.client] = (f"stale: τ = {tau} > max_staleness = "
                                             f"{opts.max_staleness}, dropped")
                self._release(version)
                continue
            if ctx.attack is not None and flight.client in ctx.attack.clients:
                attacked.append(flight.client)
                fitted = self._poisoned(ctx, flight, start, fitted)
            examples = int(reply.payload.get("examples", 0))
            loss = reply.payload.get("metrics", {}).get("train_loss")
            scale = staleness_weight(opts.staleness, tau, opts.staleness_a, opts.staleness_b)
            if linear:
                buffer.add(start, fitted, client=flight.client, rank=reply.rank, tau=tau,
                           mass=linear_weight(ctx.aggregator, examples), scale=scale,
                           examples=examples, loss=None if loss is None else float(loss))
            else:
                who = f"client {flight.client}'s update (rank {reply.rank})"
                held.append((flight.client, against(state, start, fitted, scale, who),
                             float(examples)))
                buffer.entries.append((flight.client, reply.rank, tau, float(examples),
                                       examples, None if loss is None else float(loss)))
                buffer.mass += float(examples)
            not_served.pop(flight.client, None)
            self._release(version)
        else:  # pragma: no cover - a bug in the loop, never a hang
            raise MeshError(f"fedbuff settled {passes} fits without filling the buffer")
        if linear and buffer.mass <= 0:
            raise AggregationError(
                f"fedbuff step {rnd}: the buffer's {len(buffer.entries)} updates trained on 0 "
                f"examples, so fedavg has no weight to divide by")
        if linear:
            consensus = buffer.consensus(state)
        else:
            fold = ctx.aggregation_begin(reference=state)
            for client, model, weight in held:
                fold.add(model, weight, source=f"client {client}")
            held.clear()
            consensus = fold.result()
        new_state = ctx.outer_step(state, consensus)
        metrics = train_loss({"examples": e[4], "metrics": {"train_loss": e[5]}}
                             for e in buffer.entries if e[5] is not None)
        metrics.update(ctx.task.evaluate(new_state))
        histogram: dict[int, int] = {}
        for entry in buffer.entries:
            histogram[entry[2]] = histogram.get(entry[2], 0) + 1
        share = buffer.mass or 1.0
        strike(ctx, failures)
        return RoundOutcome(
            new_state, answered=tuple(sorted({e[1] for e in buffer.entries})),
            clients=tuple(e[0] for e in buffer.entries),
            examples=sum(e[4] for e in buffer.entries), metrics=metrics,
            served={e[0]: e[1] for e in buffer.entries}, not_served=not_served,
            client_examples={e[0]: e[4] for e in buffer.entries},
            staleness=histogram, client_staleness={e[0]: e[2] for e in buffer.entries},
            client_weights={e[0]: e[3] / share for e in buffer.entries},
            attacked=tuple(sorted(set(attacked) & {e[0] for e in buffer.entries})),
            simulated_time=run.clock if ctx.speeds is not None else None,
            failed=dict(failures.ranks))

    # -- dispatch ----------------------------------------------------------------

    def _top_up(self, ctx: StrategyContext, version: int, buffer: Buffer) -> None:
        """Send the fits owed (after a resume) and new ones until ``concurrency`` are out."""
        run = self._run
        live = [r for r in ctx.require_live(1, f"fedbuff step {version + 1}")
                if r not in self._failures.ranks]
        if not live:
            raise PeerLostError(
                f"fedbuff step {version + 1}: every live worker was dropped for this step ("
                + "; ".join(f"rank {r}: {why}" for r, why in self._failures.ranks.items())
                + f"). {ctx.resume_advice()}")
        load = {r: 0 for r in live}
        for flight in run.flights:
            if flight.rank in load and flight.ticket is not None:
                load[flight.rank] += 1
        for flight in run.flights:
            if flight.ticket is None:  # from the checkpoint, or lost with its worker
                self._send(ctx, flight, min(live, key=lambda r: (load[r], r)))
                load[flight.rank] += 1  # type: ignore[index]
        virtual = ctx.speeds is not None
        # Real time: each live worker holds its share, so the concurrency
        # follows the live workers; the virtual clock does not depend on them.
        cap = math.inf if virtual else math.ceil(self.options.concurrency / len(ctx.workers))
        clients = self.clients(len(ctx.workers), ctx.partitioner, ctx.task)
        while len(run.flights) < self.options.concurrency:
            ready = [r for r in live if load[r] < cap]
            if not ready:
                return
            busy = sorted({f.client for f in run.flights} | buffer.clients)
            if len(busy) >= clients:
                return
            draw = np.random.default_rng([ctx.seed, _DRAW_STREAM, run.dispatched])
            client = nth_free(int(draw.integers(clients - len(busy))), busy)
            finish = run.clock + ctx.speeds.duration(client) if virtual else 0.0
            flight = Flight(run.dispatched, client, version,
                            client_seed(ctx.seed, run.dispatched, client), finish)
            run.dispatched += 1
            run.flights.append(flight)
            rank = min(ready, key=lambda r: (load[r], r))
            self._send(ctx, flight, rank)
            load[rank] += 1

    def _poisoned(self, ctx: StrategyContext, flight: Flight, start: Mapping[str, Any],
                  fitted: Mapping[str, Any]) -> Mapping[str, Any]:
        """An attacker's fit as its attack makes it (``[attack]``, module docstring)."""
        plan = ctx.attack
        if plan.poisons_data:  # its labels were poisoned on the worker (the fit request)
            return fitted
        round_ = AttackRound(client=flight.client, contributors=self.options.buffer_size,
                             attackers=len(plan.clients), rng=attack_rng(plan.seed, flight.seed))
        return tamper_contribution(plan.attack, fitted, start, round_,
                                   name=f"attack {plan.name}")

    def _send(self, ctx: StrategyContext, flight: Flight, rank: int) -> None:
        clients = self.clients(len(ctx.workers), ctx.partitioner, ctx.task)
        budget = {"time_budget": self.options.time_budget} if self.options.time_budget else {}
        plan = ctx.attack
        if plan is not None and plan.poisons_data and flight.client in plan.clients:
            budget["poison"] = plan.spec()
        start = self._run.models[flight.version]
        if ctx.compression is not None:  # the update against ``start`` comes back compressed
            budget["compress"] = ctx.compression.request(_sent_whole(ctx, start))
        request = {"op": "fit", "shard": flight.client, "shards": clients, "seed": flight.seed,
                   "state": start, **budget}
        flight.rank = rank
        flight.ticket = ctx.pool.send(rank, request, ctx.timeout)

    def _next_arrival(self, ctx: StrategyContext) -> tuple[Flight, Reply]:
        """The next fit to fold: the first to arrive (real time), or the earliest
        simulated finish (virtual clock), waiting for it if need be."""
        run = self._run
        virtual = ctx.speeds is not None
        target = min(run.flights, key=lambda f: (f.finish, f.dispatch)) if virtual else None
        for _ in range(len(run.flights) * (len(ctx.workers) + 2) + 1):
            if target is not None and target.dispatch in run.arrived:
                run.flights.remove(target)
                run.clock = max(run.clock, target.finish)
                return target, run.arrived.pop(target.dispatch)
            reply = ctx.pool.receive()
            assert reply is not None  # a blocking receive always returns one
            flight = next((f for f in run.flights if f.ticket == reply.seq), None)
            if flight is None:
                log.debug("fedbuff: discarding a reply to no fit in flight (seq %d)", reply.seq)
                continue
            if reply.payload is not None and reply.payload.get("error"):
                # A member's failure: its rank sits the step out (or the run stops,
                # accept_failures = false); the fit counts as lost, or as its client's
                # own once two ranks failed it.
                try:
                    reason = reply_failure(reply.rank, reply.payload,
                                           accept=ctx.accept_failures)
                except DivergedFit:
                    run.flights.remove(flight)  # answered: no longer in flight
                    raise
                assert reason is not None  # the reply carries an error
                if self._failures.client_failed(flight.client, reply.rank, reason):
                    run.flights.remove(flight)
                    return flight, Reply(reply.rank, None,
                                         self._failures.clients[flight.client], reply.seq)
                self._failures.rank_failed(reply.rank, reason)
                reply = Reply(reply.rank, None, reason, reply.seq)
            if not virtual:
                run.flights.remove(flight)
                return flight, reply
            if reply.payload is None:
                # Lost with its worker: the same fit (version, client, seed) goes to
                # a live one, so the simulation does not notice.
                log.warning("fedbuff: rank %d lost (%s); client %d's fit is sent again",
                            reply.rank, reply.error, flight.client)
                flight.ticket = None
                live = [r for r in ctx.require_live(1, "fedbuff")
                        if r not in self._failures.ranks] or ctx.require_live(1, "fedbuff")
                self._send(ctx, flight, live[flight.dispatch % len(live)])
                continue
            run.arrived[flight.dispatch] = reply
        raise MeshError("fedbuff: the fit the clock waits for never arrived")  # pragma: no cover

    def _release(self, version: int) -> None:
        """Forget the model versions no fit in flight needs any more."""
        run = self._run
        needed = {f.version for f in run.flights} | {version}
        for old in [v for v in run.models if v not in needed]:
            del run.models[old]


def _strict_limit(ctx: StrategyContext,
                  state: Mapping[str, Any]) -> Callable[[Any], float | None] | None:
    """The strict mean's range per dtype (:meth:`MeanFold.value_limit`) when the selected
    aggregator folds with it, as the flat round asks; None for any other fold."""
    fold = ctx.aggregation_begin(reference=state)
    return fold.value_limit if type(fold) is MeanFold else None


def _sent_whole(ctx: StrategyContext, state: Mapping[str, Any]) -> list[str]:
    """The keys a compressed fit sends whole: the task's buffers (as the round engine's)."""
    return sorted(ctx.buffers & set(state))


def nth_free(index: int, busy: list[int]) -> int:
    """The ``index``-th client (from 0) not in ``busy`` (sorted, distinct), in
    O(len(busy)): the draw ``[c for c in range(N) if c not in busy][index]``
    made without listing the N clients, so a population of millions costs what
    ten clients do, and the choice is the same."""
    client = index
    for taken in busy:  # each busy client at or below the candidate pushes it up one
        if taken <= client:
            client += 1
        else:
            break
    return client


def _aggregator_name(aggregator: Any) -> str:
    """The selected aggregator's registered name, as its object says it."""
    return str(getattr(aggregator, "name", type(aggregator).__name__))


def update(start: Mapping[str, Any], value: np.ndarray, key: str, who: str) -> np.ndarray:
    """``start[key] − value`` in float64: one key of a pseudo-gradient, refused when not finite."""
    delta = np.subtract(start[key], value, dtype=np.float64)
    if not np.isfinite(delta).all():
        raise AggregationError(
            f"fedbuff: {who} holds NaN or inf in {key!r}; a non-finite update is never "
            f"folded. Lower the task's learning rate")
    return delta


def against(current: Mapping[str, Any], start: Mapping[str, Any], fitted: Mapping[str, Any],
            scale: float, who: str) -> dict[str, Any]:
    """An update as a model of the current version: ``x − scale · (start − fitted)``.

    What a rule that is not linear folds (module docstring): its float arrays in
    the model's dtype; integer arrays and JSON values are the fit's own.
    """
    out: dict[str, Any] = {}
    for key, value in fitted.items():
        if isinstance(value, np.ndarray) and is_float_dtype(value.dtype):
            delta = update(start, value, key, who)
            out[key] = (np.asarray(current[key], np.float64) - scale * delta).astype(value.dtype)
        else:
            out[key] = value
    return out


def _fit_keywords(task: Any) -> set[str]:
    """The keywords ``task.fit`` takes (``time_budget`` too when it takes ``**kwargs``)."""
    try:
        parameters = inspect.signature(task.fit).parameters
    except (TypeError, ValueError):
        return set()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return {"time_budget"}
    return set(parameters)
