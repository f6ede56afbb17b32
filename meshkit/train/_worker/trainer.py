"""The worker side of a training run: a task answering the coordinator's requests.

A worker started with ``meshkit node`` receives a job ``{"kind": "train",
"spec": SPEC}`` from rank 0 and calls :func:`serve_trainer`. SPEC is a JSON
object:

=================  ==========================================================
``task``           registered task name or ``"module:attribute"``
``task_options``   the ``[task]`` table (a JSON object), validated here too
``strategy``       the strategy name (for logs and reports)
``seed``           the run seed
``partitioner``    ``{"name": NAME, "options": {...}}``: how a fit's ``shard``
                   of ``shards`` is cut from the training set (default:
                   contiguous blocks); every worker computes the same split
``data``           ``{"x": ..., "y": ...}``: the training set, sent by the
                   coordinator to a node that asked for it (``--pull-data``;
                   on the wire as the job's ``data.x``/``data.y`` arrays)
``idle_timeout``   seconds to wait for the next request before giving up
                   (default 3600; the coordinator may evaluate between rounds)
``device``         the device placement requires (``[strategy] device``), or
                   absent; the node's own ``--device`` wins over it
``node_attack``    ``{"name": NAME, "options": {...}}``: this node's own
                   ``meshkit node --attack`` (added on the node, never sent)
=================  ==========================================================

Attacks (:mod:`meshkit.attack`): a fit request with ``poison`` (a
simulated data-poisoning attacker, ``[attack]``) trains on poisoned data;
a node with ``node_attack`` poisons every fit it serves -- its data for a
data-poisoning attack, else its update against the state it started from
-- and says so in the reply (``attacked``: the attack's name).

The device reaches the task through its options: a task whose options
class has a ``device`` field (meshkit.torch's, ``digits``) is built with
this node's device (:func:`with_device`); one without runs on the cpu, and
a node asked for another device refuses it rather than ignore the request.

The worker then answers requests (:mod:`meshkit.train._protocol` lists
them) until ``{"op": "stop"}`` or until the coordinator goes away. A request
the task cannot serve is answered with ``{"error": MESSAGE}``, never with
silence: the coordinator would read silence as a stalled worker. The
message of a meshkit error goes as it is (meshkit names problems, never data);
another exception's (a library's, a task's) has its quoted literals replaced
by ``'…'`` (:func:`meshkit.node.sendable`), since libraries quote the data they choked
on (numpy: ``could not convert string 'root:x:0:0:…'``) and the coordinator
must not read a node's files through its errors. The node's log keeps the
whole message and traceback.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Mapping

import attrs
import numpy as np

from meshkit import plugins
from meshkit.aggregation import FixedPointSum
from meshkit.compression import RESIDUAL, SEP, CodeSum, encode_update, is_residual
from meshkit.attack import AttackRound, attack_rng, poisons_data, tamper_contribution
from meshkit.errors import AggregationError, ConfigError, MeshError, PeerLostError, ProtocolError
from meshkit.errors import WireError
from meshkit.node import TrainReport, sendable
from meshkit.partitioner import is_lazy, is_per_node, rows_of_client, split_rows
from meshkit.population import client_held_out_of, client_rows_of, is_population
from meshkit.privacy import ClippedSum, clip_contribution
from meshkit.task import accepts_data, create_task, resolve_task_component
from meshkit.train._failures import DivergedFit
from meshkit.train._messages import LOCAL_SGD_REQUESTS
from meshkit.train._worker.held import Compressors, Stale, apply_broadcast, only, set_state
from meshkit.train._worker.held import by_key, with_local
from meshkit.train._worker.local_sgd import LocalSGD
from meshkit.train._worker.pieces import take_piece
from meshkit.train._worker.residuals import WorkerResiduals
from meshkit.train._messages import MAX_SEQ, MIN_SEQ, check_contribution, check_request
from meshkit.train._messages import signature
from meshkit.train._protocol import TAG_REPLY, TAG_REQUEST, decode, encode
from meshkit.train._worker.secure import SecureClients
from meshkit.train._sharding import shard_bounds, shard_pair
from meshkit.transport import Group

__all__ = ["Trainer", "serve_trainer", "with_device"]

log = logging.getLogger(__name__)


#: Results one worker keeps for the coordinator to take, at most. The round
#: engine asks for far fewer (docs/strategies.md); this refuses a coordinator
#: that would fill a worker's memory.
MAX_KEPT = 8


@attrs.define
class Trainer:
    """Answers trainer requests with a task.

    ``state`` is the model this worker holds: the round's global state
    (``set_state``), or a data-parallel replica (moved by ``apply``). A fit
    never changes it. ``kept`` holds results a request asked to ``keep``
    until the coordinator takes them (``take``); a new ``set_state``
    discards them.
    """

    task: Any
    state: dict[str, Any] | None = None
    kept: dict[int, dict[str, Any]] = attrs.Factory(dict)
    requests: int = 0
    fits: int = 0
    examples: int = 0
    metrics: dict[str, float] = attrs.Factory(dict)
    #: The last request that failed, as the coordinator was told (the report says it).
    error: str | None = None
    #: The key of the ``fit_batch`` fit under way (an error reply names it), or None.
    failing: int | None = None
    #: This worker's group, for ``step``'s all-reduce among the replicas (None:
    #: the trainer answers the requests that need no peers).
    group: Any = None
    #: How a fit's shard is cut (:mod:`meshkit.partitioner`); None: contiguous blocks.
    partitioner: Any = None
    partitioner_name: str = "contiguous"
    #: The run seed: a split is a pure function of it.
    seed: int = 0
    #: The training set the coordinator sent (``--pull-data``), instead of the task's.
    data: tuple[Any, Any] | None = None
    #: This node's own attack (``meshkit node --attack``) and its name; None: honest.
    attack: Any = None
    attack_name: str = ""
    #: The round's exact partial sum of the fits ``fit_batch`` folded here, until
    #: ``take_partial`` hands it over (a new ``set_state`` discards it).
    partial: FixedPointSum | ClippedSum | CodeSum | None = None
    #: ``[strategy] trainable``'s keys (the last ``set_state``'s): a fit answers with
    #: only these; None: with every key.
    trainable: frozenset[str] | None = None
    #: The digest of ``state`` when a broadcast ``set_state`` left it (``[compression]
    #: broadcast``: a delta applies only to it); None after any other.
    digest: str | None = None
    #: Data-poisoning attacks named by fit requests (``poison``), built once each.
    _poisoners: dict[str, Any] = attrs.Factory(dict)
    #: Compressors named by fit requests (``compress``), built once per name and options.
    _compressors: Compressors = attrs.Factory(Compressors)
    #: ``[compression] residual = "worker"``: this worker's clients' residuals.
    residuals: WorkerResiduals = attrs.Factory(WorkerResiduals)
    #: Contiguous blocks' bounds per client count (the blocks themselves are views).
    _blocks: dict[int, list[tuple[int, int]]] = attrs.Factory(dict)
    #: The partitioner's whole split per (set, client count), for a partitioner
    #: without the lazy form (``client_rows``): a pure function of the labels,
    #: the count and the seed, so worked out once for every client.
    _splits: dict[tuple[str, int], Any] = attrs.Factory(dict)
    #: The clients this worker plays in a secure round (``secagg_*`` requests).
    secure: SecureClients = attrs.Factory(SecureClients)
    #: This worker's DiLoCo replica (``replica_*`` and ``inner`` requests), once started.
    replica: LocalSGD | None = None

    def train_data(self) -> tuple[Any, Any]:
        return self.data if self.data is not None else self.task.train_data()

    def _shard(self, index: int, count: int, *, partitioned: bool = False) -> tuple[Any, Any]:
        """Shard ``index`` of ``count``: the client's (a fit) or a contiguous block.

        A client's rows are made or cut for this request and kept by no one
        (a population's ``client_data``, a partitioner's rows): a node never
        holds more than the clients it is serving (docs/simulation.md).
        """
        if not 0 <= index < count:
            raise MeshError(f"shard {index} requested, but there are only {count}")
        if partitioned and self.data is None and is_population(self.task):
            return client_rows_of(self.task, index, count)
        if partitioned and self.partitioner is not None:
            x, y = self.train_data()
            rows = self._rows(y, index, count)
            return x[rows], y[rows]
        x, y = self.train_data()
        if count not in self._blocks:
            if len(x) != len(y):
                shard_pair(x, y, count)  # refuses rows that do not pair, naming both counts
            self._blocks[count] = shard_bounds(len(x), count)
        start, end = self._blocks[count][index]
        return x[start:end], y[start:end]

    def _rows(self, labels: Any, index: int, count: int) -> Any:
        """This client's training rows (a slice when they are one block: no copy)."""
        if is_per_node(self.partitioner):
            # This node's own data is its one client, whatever index it has.
            return slice(0, len(labels))
        if is_lazy(self.partitioner):
            rows = rows_of_client(self.partitioner, labels, count, index, seed=self.seed,
                                  name=self.partitioner_name)
        else:
            key = ("train", count)
            if key not in self._splits:
                self._splits[key] = split_rows(self.partitioner, labels, count,
                                               seed=self.seed, name=self.partitioner_name)
            rows = self._splits[key][index]
        if len(rows) and int(rows[-1]) - int(rows[0]) + 1 == len(rows):
            return slice(int(rows[0]), int(rows[-1]) + 1)
        return rows

    def held_out(self, index: int, count: int) -> tuple[Any, Any]:
        """This client's held-out examples: the task's ``test_data()``, split as training is
        (a population's: its ``client_test_data``)."""
        if self.data is None and is_population(self.task):
            return client_held_out_of(self.task, index, count)
        test_data = getattr(self.task, "test_data", None)
        if not callable(test_data):
            raise ConfigError(f"the task ({type(self.task).__name__}) has no test_data(): "
                              f"there is no held-out data to evaluate on here")
        x, y = test_data()
        if self.partitioner is None or is_per_node(self.partitioner):
            return x, y
        # The held-out set is split by the same rule (and seed) as the training
        # set; a client may hold none of it.
        key = ("held_out", count)
        if key not in self._splits:
            self._splits[key] = self.partitioner.split(np.asarray(y), count, seed=self.seed)
        rows = np.asarray(self._splits[key][index], dtype=np.int64)
        return x[rows], y[rows]

    def handle(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """One request in, one reply out; a failure is an ``error`` reply, not a crash.

        The request is checked against its op's schema first
        (:mod:`meshkit.train._messages`); one that does not fit is answered
        with a ``protocol error`` and changes nothing here.
        """
        self.requests += 1
        op = request.get("op")
        seq = request.get("seq", 0)
        try:
            check_request(request)
        except ProtocolError as exc:
            # A request that does not fit its schema is the coordinator's bug
            # (or not the coordinator's): say so, and serve the next one.
            log.warning("refusing a trainer request: %s", exc)
            self.error = f"protocol error: {exc}"
            return {"error": self.error,
                    "seq": seq if isinstance(seq, int) and not isinstance(seq, bool)
                    and MIN_SEQ <= seq <= MAX_SEQ else 0}
        self.failing = None
        try:
            reply = self._dispatch(op, request)
        except DivergedFit as exc:
            # The model diverged (a NaN loss): the run's on_nonfinite decides, not a drop.
            log.warning("trainer request %r: %s", op, exc)
            reply = {"error": f"{'fit' if op == 'fit_batch' else op}: {exc}",
                     "reason": "nonfinite"}
            self.error = reply["error"]
        except AggregationError as exc:
            # This worker's own fold refused a fit's result (NaN, out of range):
            # the coordinator raises it as the fold's refusal, as its own fold would.
            log.warning("trainer request %r: the fold refused a result: %s", op, exc)
            reply = {"error": f"{op}: {exc}", "reason": "aggregation"}
            self.error = reply["error"]
        except Exception as exc:  # the coordinator must hear why, not see a hang
            log.exception("trainer request %r failed", op)
            # A batch's failure is one of its fits': say "fit", as the flat round does.
            name = "fit" if op == "fit_batch" else op
            reply = {"error": f"{name}: {type(exc).__name__}: {sendable(exc)}"}
            self.error = reply["error"]
        if "error" in reply and self.failing is not None:
            reply["key"] = self.failing  # which fit of a batch failed
        reply["seq"] = seq
        return reply

    def _dispatch(self, op: Any, request: Mapping[str, Any]) -> dict[str, Any]:
        if isinstance(op, str) and op.startswith("secagg_"):
            return self.secure.handle(op, request, self._secure_fit)
        if op in LOCAL_SGD_REQUESTS:
            if self.replica is None:
                self.replica = LocalSGD(self.task, group=self.group)
            reply = self.replica.handle(op, request, self._seeded_batch)
            self.examples += int(reply.get("examples", 0))
            return reply
        if op == "fit":
            if request.get("set_state"):
                # The round's model came with this worker's first fit of the round: held as
                # a set_state would hold it, then the fit starts from the model held.
                self._hold(request)
                request = dict(request)  # (copied in C, then three keys dropped)
                for field in ("state", "set_state", "trainable"):
                    request.pop(field, None)
            state, examples, metrics, attacked = self._fit(request)
            if request.get("compress") is not None:
                state = self._compressed(request, state)
            reply = self._answer(request, "state", state, examples, metrics)
            if attacked:
                reply["attacked"] = attacked
            return reply
        if op == "fit_batch":
            return self._fit_batch(request)
        if op == "take_partial":
            if self.partial is None:
                raise MeshError("no partial sum is held here; fit_batch folds one (a new "
                                "round discards it)")
            partial, self.partial = self.partial, None
            if isinstance(partial, CodeSum):  # [compression] clip_range: integer codes
                return {"partial": partial.to_wire()}
            return {"partial": partial.partial().to_wire()}
        if op == "set_state":
            if request.get("digest") is not None:  # [compression] broadcast
                try:
                    self.state, self.digest = apply_broadcast(self.state, self.digest, request,
                                                              self._compressors)
                except Stale as exc:
                    # Nothing changed: the coordinator sends the whole model next.
                    log.info("set_state: %s; asking for the whole model", exc)
                    return {"stale": str(exc)}
                self.trainable = None
                # A new round: whatever the last one left unclaimed is stale.
                self.kept.clear()
                self.partial = None
            else:
                self._hold(request)
            return {}
        if op == "grads":
            state = self._require_state(op)
            result = self.task.gradients(state, *self._batch(request))
            self.examples += int(result.examples)
            return self._answer(request, "gradients", result.state, result.examples,
                                _metrics(result.metrics, op))
        if op == "step":
            # Data-parallel on a mesh: the replicas average their gradients
            # among themselves (no fold on the coordinator), then each applies
            # the same mean. A failed all-reduce is an error, never a local step.
            state = self._require_state(op)
            if self.group is None:
                raise MeshError("'step' needs the worker's group (serve_trainer passes it)")
            result = self.task.gradients(state, *self._batch(request))
            before = getattr(self.group, "bytes_out", None)
            mean = self.group.mesh_all_reduce(result.state, 1.0,
                                              ranks=[int(r) for r in request["ranks"]])
            self.state, self.digest = dict(self.task.apply(state, mean)), None
            self.examples += int(result.examples)
            reply = {"examples": int(result.examples), "metrics": _metrics(result.metrics, op)}
            if isinstance(before, int):  # the transport counts its bytes (tcp)
                reply["ring_bytes"] = int(self.group.bytes_out) - before
            return reply
        if op == "take":
            key = int(request["key"])
            if key not in self.kept:
                raise MeshError(f"no result {key} is kept here (kept: "
                                f"{sorted(self.kept) or 'none'}); a new round discards them")
            if request.get("piece") is not None:  # one piece of it (issue 39)
                return {"state": take_piece(self.kept, key, int(request["piece"]),
                                            int(request["piece_bytes"]))}
            return {"state": self.kept.pop(key)}
        if op == "apply":
            self.state = dict(self.task.apply(self._require_state(op), request["gradients"]))
            self.digest = None
            return {}
        if op == "get_state":
            return {"state": self._require_state(op)}
        if op == "held_out":
            test_data = getattr(self.task, "test_data", None)
            if not callable(test_data):
                return {"examples": 0}
            return {"examples": int(len(test_data()[1]))}
        if op == "evaluate":
            model = with_local(request["state"] if "state" in request
                                else self._require_state(op), request)
            x, y = self.held_out(int(request["shard"]), int(request["shards"]))
            if len(y) == 0:
                return {"examples": 0, "metrics": {}}
            if accepts_data(self.task):
                metrics = self.task.evaluate(model, x, y)
            elif (self.partitioner is None or is_per_node(self.partitioner)) and not (
                    self.data is None and is_population(self.task)):
                metrics = self.task.evaluate(model)  # its whole held-out set is this client's
            else:
                raise ConfigError(
                    "the task's evaluate(state) cannot evaluate on one client's share of "
                    "the held-out set; give it evaluate(state, x=None, y=None)")
            figures = _metrics(metrics, op)
            # A task whose client reads its own held-out data (a Flower client
            # handed only its partition id) says over how many examples its
            # figures are; the client's evaluation is weighed by that.
            counted = figures.pop("examples", float(len(y)))
            if counted != int(counted) or counted < 0:
                raise MeshError(f"the task's evaluate reported examples = {counted}; it is "
                                f"a count of held-out examples (a whole number, at least 0)")
            return {"examples": int(counted), "metrics": figures}
        if op == "stage":
            x = request["x"]
            for node in request["nodes"]:
                x = self.task.run_stage(request.get("state", {}), node, x)
            return {"x": x}
        raise MeshError(f"unknown trainer request {op!r}")

    def _fit_batch(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Fit each client of the batch and fold it into the round's partial sum.

        With ``dp_clip`` (a private round) the partial is the exact sum of the fits'
        clipped *updates* (:class:`meshkit.privacy.ClippedSum`, the coordinator's own
        rule, so the same bits as folding each there), and each result says whether its
        update was within the clip norm (``metrics.unclipped``, adaptive clipping's bit).
        """
        model = self._require_state("fit_batch")
        if request.get("compress") is not None:
            return self._fit_compressed_batch(request)
        bits = int(request["fraction_bits"])
        private = request.get("dp_clip")
        if self.partial is None:
            if private is None:
                self.partial = FixedPointSum(fraction_bits=bits)
            else:
                clipped = any(fit.get("clip_norm") is not None for fit in request["fits"])
                self.partial = ClippedSum(model, clip_norm=float(private),
                                          clipped_by_clients=clipped)
        if isinstance(self.partial, CodeSum) or (private is None) != isinstance(
                self.partial, FixedPointSum):
            raise MeshError("fit_batch mixes private (dp_clip) and plain batches in one round")
        if self.partial.fraction_bits != bits:
            raise MeshError(f"fit_batch with fraction_bits = {bits}, but this round's partial "
                            f"sum counts in 2^-{self.partial.fraction_bits}")
        if isinstance(self.partial, ClippedSum) and self.partial.clip_norm != private:
            raise MeshError(f"fit_batch with dp_clip = {private}, but this round's sum clips "
                            f"to {self.partial.clip_norm}")
        label = str(request["label"])
        results = []
        # Each fit is checked against the round's model before it is folded, as the
        # coordinator checks a flat round's: a client whose fit has the wrong keys or
        # shapes (a 0-d array where a vector belongs) fails alone, named, and never
        # becomes the template of this worker's sum.
        expected = signature(only(model, self.trainable))
        for fit in request["fits"]:
            key = int(fit["key"])
            self.failing = key  # named in the error reply if this fit fails
            state, examples, metrics, attacked = self._fit({**fit, "op": "fit"})
            check_contribution(state, expected, f"{label} {key}'s fit", finite=False)
            if isinstance(self.partial, ClippedSum):
                norm = self.partial.add(state, source=f"{label} {key}")
                if "unclipped" not in metrics:
                    # clip = "coordinator": the bit of the norm before this clip (with
                    # clip = "client" the fit's own clip said it already)
                    metrics["unclipped"] = float(norm <= self.partial.clip_norm)
            else:
                weight = float(examples) if request["weight"] == "examples" else 1.0
                self.partial.add(state, weight, source=f"{label} {key}")
            self.failing = None
            del state  # folded: a batch holds one fit's result at a time
            result: dict[str, Any] = {"key": key, "examples": examples, "metrics": metrics}
            if attacked:
                result["attacked"] = attacked
            results.append(result)
        return {"results": results}

    def _fit_compressed_batch(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """``[compression]``: fit each client of the batch in turn and answer with each one's
        compressed payload (``state``), in order; nothing is folded here -- the coordinator
        folds each payload as it decodes it (:class:`meshkit.compression.CompressedSum`).
        With ``compress.clip_range`` each fit's codes on that shared grid go into the
        round's one exact integer sum instead (:class:`meshkit.compression.CodeSum`,
        weighed by ``weight``), which ``take_partial`` hands over."""
        results, payloads = [], {}
        local = by_key(request.get("locals") or {})
        chosen = request["compress"]
        grid: CodeSum | None = None  # with clip_range: the round's one exact sum of codes
        if chosen.get("clip_range") is not None:
            model = only(self._require_state("fit_batch"), self.trainable)
            if self.partial is None:
                self.partial = CodeSum(self._compressors.of(chosen), model, raw=chosen["raw"],
                                       clip_range=float(chosen["clip_range"]))
            if not isinstance(self.partial, CodeSum) \
                    or self.partial.clip_range != chosen["clip_range"]:
                raise MeshError("fit_batch mixes grid sums (compress.clip_range) of other "
                                "ranges, or other batches, in one round")
            grid = self.partial
        for fit in request["fits"]:
            key = int(fit["key"])
            self.failing = key  # named in the error reply if this fit fails
            one = {**fit, "op": "fit", "compress": chosen, "local": local.pop(key, {})}
            state, examples, metrics, attacked = self._fit(one)
            if grid is not None:
                grid.add_fit(model, state, examples if request["weight"] == "examples" else 1,
                             seed=int(fit["seed"]), source=f"{request['label']} {key}")
            else:
                for name, value in self._compressed(one, state).items():
                    payloads[f"{key}/{name}"] = value
            del state
            result: dict[str, Any] = {"key": key, "examples": examples, "metrics": metrics}
            if attacked:
                result["attacked"] = attacked
            results.append(result)
        self.failing = None
        if grid is not None:  # take_partial hands the sum over
            return {"results": results}
        return {"results": results, "payloads": payloads}

    def _fit(self, request: Mapping[str, Any]) -> tuple[dict[str, Any], int, dict[str, float], str]:
        """One client's fit: (its state, examples, metrics, the attack it ran or "")."""
        x, y = self._shard(int(request["shard"]), int(request["shards"]), partitioned=True)
        start = request["state"] if "state" in request else self._require_state("fit")
        start = with_local(start, request)
        poisoner, attacked = self._data_attack(request)
        if poisoner is not None:
            x, y = poisoner.poison(x, y, classes=self._classes())
        budget = request.get("time_budget")
        if budget is None:
            result = self.task.fit(start, x, y, seed=int(request["seed"]))
        else:
            result = self.task.fit(start, x, y, seed=int(request["seed"]),
                                   time_budget=float(budget))
        self.fits += 1
        self.examples += int(result.examples)
        self.metrics = metrics = _metrics(result.metrics, "fit")
        state = only(result.state, self.trainable)
        if self.attack is not None and not poisons_data(self.attack):
            # A real node sees only its own update: contributors = attackers = 1.
            state = tamper_contribution(
                self.attack, state, start,
                AttackRound(client=int(request["shard"]), contributors=1, attackers=1,
                            rng=attack_rng(self.seed, int(request["seed"]))),
                name=f"attack {self.attack_name}")
            attacked = self.attack_name
        if request.get("clip_norm") is not None:
            # [privacy] clip = "client": the update leaves this node clipped
            clip = float(request["clip_norm"])
            state, norm = clip_contribution(start, state, clip)
            metrics["unclipped"] = float(norm <= clip)
        return dict(state), int(result.examples), metrics, attacked

    def _compressed(self, request: Mapping[str, Any], fitted: dict[str, Any]) -> dict[str, Any]:
        """A fit's result as its compressed payload (:mod:`meshkit.compression`): the update
        against the model it started from, with the client's residual fed back."""
        chosen = request["compress"]
        start = request["state"] if "state" in request else self._require_state("fit")
        pinned = chosen.get("residual")  # residual = "worker": kept here, never sent
        residual = ({k[:-len(SEP + RESIDUAL)]: v for k, v in (request.get("local") or {}).items()
                     if is_residual(k)} if pinned is None
                    else self.residuals.take(pinned["client"], pinned.get("from")))
        payload, kept = encode_update(self._compressors.of(chosen), with_local(start, request),
                                      fitted, seed=int(request["seed"]), raw=chosen["raw"],
                                      residual=residual, residuals=pinned is None)
        if pinned is not None:
            self.residuals.keep(pinned["client"], int(request["seed"]), pinned.get("from"), kept)
        return payload

    def _secure_fit(self, request: Mapping[str, Any]
                    ) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        """One client's fit for a secure round, by the ``fit`` op's own path: (fitted, start)."""
        start = self._require_state("secagg_mask")
        state, _, _, _ = self._fit({**request, "op": "fit"})
        return state, start

    def _data_attack(self, request: Mapping[str, Any]) -> tuple[Any, str]:
        """The data-poisoning attack this fit runs (and its name), or (None, "")."""
        poison = request.get("poison")
        if poison:
            name = str(poison["name"])
            if name not in self._poisoners:
                self._poisoners[name] = plugins.default().create(
                    "attack", name, dict(poison.get("options") or {}))
            return self._poisoners[name], name
        if self.attack is not None and poisons_data(self.attack):
            return self.attack, self.attack_name
        return None, ""

    def _classes(self) -> int:
        """The task's label count, read from its training labels (a label-flip needs it)."""
        labels = np.asarray(self.train_data()[1])
        if not np.issubdtype(labels.dtype, np.integer) or labels.size == 0:
            raise ConfigError(f"a label-flipping attack needs integer class labels; this "
                              f"task's training labels are {labels.dtype} ({labels.size} rows)")
        return int(labels.max()) + 1

    def _seeded_batch(self, shard: int, shards: int, batch_size: int,
                      seed: int) -> tuple[Any, Any]:
        """An inner step's batch: ``batch_size`` rows of the shard drawn with ``seed``."""
        return self._batch({"shard": shard, "shards": shards, "batch_size": batch_size,
                            "seed": seed})

    def _batch(self, request: Mapping[str, Any]) -> tuple[Any, Any]:
        """The rows of a ``grads``/``step`` request: its shard, or a seeded batch of it."""
        x, y = self._shard(int(request["shard"]), int(request["shards"]))
        batch = int(request.get("batch_size") or 0)
        if 0 < batch < len(y):
            rows = np.sort(np.random.default_rng(int(request["seed"])).choice(
                len(y), size=batch, replace=False))
            x, y = x[rows], y[rows]
        return x, y

    def _answer(self, request: Mapping[str, Any], field: str, result: Mapping[str, Any],
                examples: int, metrics: dict[str, float]) -> dict[str, Any]:
        """The reply to a fit or grads: the result itself, or kept for a later ``take``."""
        reply: dict[str, Any] = {"examples": int(examples), "metrics": metrics}
        keep = request.get("keep")
        if keep is None:
            reply[field] = dict(result)
            return reply
        if len(self.kept) >= MAX_KEPT and int(keep) not in self.kept:
            raise MeshError(f"asked to keep result {keep}, but {len(self.kept)} results "
                            f"(the most a worker keeps) are waiting to be taken already")
        self.kept[int(keep)] = dict(result)
        reply["kept"] = int(keep)
        return reply

    def _hold(self, request: Mapping[str, Any]) -> None:
        """The round's model, as a ``set_state`` (or a fit with ``set_state``) sends it."""
        self.state, self.trainable = set_state(self.state, request)
        self.digest = None
        # A new round: whatever the last one left unclaimed is stale.
        self.kept.clear()
        self.partial = None

    def _require_state(self, op: str) -> dict[str, Any]:
        if self.state is None:
            raise MeshError(f"{op!r} before any model was set on this worker")
        return self.state


def _metrics(metrics: Mapping[str, Any], op: str) -> dict[str, float]:
    """A task's metrics as a reply carries them; a non-finite one is the task's error.

    A reply with a NaN or infinite metric does not fit its schema
    (:mod:`meshkit.train._messages`) and would cost this worker its rank as a
    protocol breach; an honest task that diverged says so instead.
    """
    out = {str(k): float(v) for k, v in metrics.items()}
    bad = {k: v for k, v in out.items() if not math.isfinite(v)}
    if bad:
        shown = ", ".join(f"{k} = {v}" for k, v in sorted(bad.items()))
        raise DivergedFit(f"the task's {op} reported {shown}; metrics must be finite numbers "
                          f"(a diverged model? lower the learning rate, or set [strategy] "
                          f"on_nonfinite = \"skip-round\")")
    return out


def with_device(name: str, options: Mapping[str, Any], device: str) -> dict[str, Any]:
    """The ``[task]`` options with ``device`` set, when the task has a ``device`` option.

    ``auto`` changes nothing. A task without a ``device`` option runs on the
    cpu: any other device is a :class:`ConfigError` (the node was asked for
    hardware the task would silently not use).
    """
    options = dict(options)
    if device.strip().lower() in ("", "auto"):
        return options
    component = resolve_task_component(name)
    fields = attrs.fields_dict(component.options) if component.options is not None else {}
    if "device" in fields:
        options["device"] = device
    elif device.strip().lower() != "cpu":
        raise ConfigError(
            f"task {name!r} has no device option, so it runs on the cpu; this node was "
            f"asked to run it on {device!r}. Use a task that takes a device (meshkit.torch's "
            f"does) or start the node with --device cpu")
    return options


def serve_trainer(group: Group, spec: Mapping[str, Any], control: Any = None, *,
                  device: str = "auto", signing: Any = None) -> TrainReport:
    """Serve trainer requests from rank 0 until told to stop; returns a ``TrainReport``.

    ``control`` is a :class:`meshkit.NodeControl` (its stop flag is observed
    between requests) or None. ``device`` is the device this node's task
    runs on (:func:`with_device`); ``signing`` its node key and roster for
    signed secure rounds (:class:`~meshkit.train._worker.secure.Signing`), or None.
    """
    started = time.monotonic()
    try:
        built = _trainer(spec, device, group)
        if signing is not None:
            built.secure.signing = signing
        trainer: Trainer | None = built
        failure: MeshError | None = None
    except MeshError as exc:
        # Answer every request with the reason instead of leaving: the
        # coordinator waits on replies, and silence would read as a stalled
        # worker (dropped after [mesh] timeout) rather than as this error.
        log.error("rank %s cannot build the task: %s", group.rank, exc)
        trainer, failure = None, exc
    idle = float(spec.get("idle_timeout", 3600.0))
    poll = min(idle, 1.0)
    idle_since = time.monotonic()
    stopped: str | None = None
    while True:
        if _stopped(control):
            stopped = "stop"
            break
        try:
            frame = group.recv(0, TAG_REQUEST, timeout=poll)
        except PeerLostError as exc:
            # The transport says "lost" for a dead coordinator and for a quiet
            # one alike; only the dead one ends the job.
            if 0 in group.dead or time.monotonic() - idle_since > idle:
                stopped = f"coordinator lost: {exc}"
                break
            continue
        idle_since = time.monotonic()
        if trainer is not None:
            # The fault injection's exit waits for the next request: the coordinator
            # has taken the last reply in by then, so no close can discard it.
            trainer.secure.after_reply()
        try:
            request = decode(frame)
        except ProtocolError as exc:
            # Not a message at all: say so (the coordinator waits on a reply).
            log.warning("refusing a trainer request frame: %s", exc)
            request = {"op": None, "seq": frame.get("seq", 0)}
            failed: str | None = f"protocol error: {exc}"
        else:
            failed = None
        if isinstance(request.get("op"), str) and request["op"] == "stop":
            break
        if failed is not None:
            seq = request["seq"]
            reply = {"error": failed, "seq": seq if isinstance(seq, int) else 0}
        elif trainer is None:
            reply = {"error": f"cannot build the task on this worker: {failure}",
                     "seq": request.get("seq", 0)}
        else:
            reply = trainer.handle(request)
        try:
            _send_reply(group, request, reply, trainer)
        except PeerLostError as exc:
            stopped = f"coordinator lost: {exc}"
            break
    if failure is not None:
        raise failure
    assert trainer is not None  # built, or failure was raised above
    log.info("trainer on rank %s finished%s", group.rank,
             f": {stopped}" if stopped else "")
    return _train_report(group, trainer, stopped, time.monotonic() - started)


def _send_reply(group: Group, request: Mapping[str, Any], reply: Mapping[str, Any],
                trainer: Trainer | None) -> None:
    """Send ``reply``; one the wire cannot carry (a dtype it lacks, more entries than a frame
    holds) is answered with an error reply saying why, so the coordinator drops this rank
    for that request at once instead of waiting out its timeout on a rank that serves on.

    Raises:
        PeerLostError: the coordinator is gone (the job ends).
    """
    try:
        group.send(0, TAG_REPLY, encode(reply))
        return
    except PeerLostError:
        raise
    except WireError as exc:
        op = request.get("op")
        why = f"{op if isinstance(op, str) else 'request'}: the reply could not be sent: {exc}"
    log.error("rank %s: %s", group.rank, why)
    if trainer is not None:
        trainer.error = why
    seq = reply.get("seq", 0)
    group.send(0, TAG_REPLY, encode({"error": why, "seq": seq}))


def _trainer(spec: Mapping[str, Any], device: str = "auto", group: Any = None) -> Trainer:
    """The worker's task (on ``device``), partitioner and (pulled) data, as the spec says."""
    name = str(spec["task"])
    trainer = Trainer(create_task(name, with_device(name, spec.get("task_options") or {},
                                                    device)),
                      group=group, seed=int(spec.get("seed", 0)))
    chosen = spec.get("partitioner")
    if chosen:
        name = str(chosen["name"])
        trainer.partitioner = plugins.default().create("partitioner", name,
                                                       dict(chosen.get("options") or {}))
        trainer.partitioner_name = name
    data = spec.get("data")
    if data:
        trainer.data = (np.asarray(data["x"]), np.asarray(data["y"]))
    attack = spec.get("node_attack")
    if attack:
        trainer.attack_name = str(attack["name"])
        trainer.attack = plugins.default().create("attack", trainer.attack_name,
                                                  dict(attack.get("options") or {}))
    return trainer


def _stopped(control: Any) -> bool:
    if control is None:
        return False
    for name in ("stopped", "should_stop", "is_stopped"):
        value = getattr(control, name, None)
        if callable(value):
            return bool(value())
        if value is not None:
            return bool(value)
    return False


def _train_report(group: Group, trainer: Trainer, stopped: str | None,
                  seconds: float) -> TrainReport:
    return TrainReport(rank=group.rank, steps=trainer.requests,
                       rounds=trainer.fits, examples=trainer.examples,
                       metrics=dict(trainer.metrics), stopped=stopped, error=trainer.error,
                       seconds=seconds)
