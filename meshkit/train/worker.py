"""The worker side of a training run, and the request protocol both sides speak.

A worker started with ``meshkit node`` receives a job ``{"kind": "train",
"spec": SPEC}`` from rank 0 and calls :func:`serve_trainer`. SPEC is a JSON
object:

=================  ==========================================================
``task``           registered task name or ``"module:attribute"``
``task_options``   the ``[task]`` table (a JSON object), validated here too
``strategy``       the strategy name (for logs and reports)
``seed``           the run seed
``idle_timeout``   seconds to wait for the next request before giving up
                   (default 3600; the coordinator may evaluate between rounds)
=================  ==========================================================

The worker then answers requests until ``{"op": "stop"}`` or until the
coordinator goes away. Requests arrive on tag :data:`TAG_REQUEST` and
replies leave on :data:`TAG_REPLY`; each is one flat state (the wire's unit),
where a nested model state travels as ``"state/<key>"`` entries. Every
request carries ``seq`` and its reply echoes it, so a late answer from a
worker that was already given up on can never be taken for a fresh one.

==============  =====================================  ===========================
op              request fields                          reply fields
==============  =====================================  ===========================
``fit``         state, shard, shards, seed              state, examples, metrics
``set_state``   state                                   (ack)
``grads``       shard, shards, seed, batch_size         gradients, examples, metrics
``apply``       gradients                               (ack)
``get_state``   —                                       state
``stage``       nodes, x, state (the stage's keys)      x
``stop``        —                                       (none: the worker returns)
==============  =====================================  ===========================

The data never travels: every node builds the same task and takes shard
``shard`` of ``shards`` of its training data (inputs and targets together).
A request the task cannot serve is answered with ``{"error": MESSAGE}``.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Mapping, Sequence

import attrs

from meshkit.errors import MeshError, PeerLostError, WireError
from meshkit.train.strategy import Reply, shard_pair

__all__ = [
    "TAG_REQUEST",
    "TAG_REPLY",
    "Trainer",
    "LocalPool",
    "GroupPool",
    "serve_trainer",
    "encode",
    "decode",
]

log = logging.getLogger(__name__)

#: Tags of the trainer protocol (user range; the kernel reserves >= 0xFFFF0000).
TAG_REQUEST = 0x6D6B_0101
TAG_REPLY = 0x6D6B_0102

#: Request/reply fields that hold a nested state and travel flattened.
_NESTED = ("state", "gradients")


def encode(message: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten nested states into one wire-level state (``"state/<key>"``)."""
    out: dict[str, Any] = {}
    for key, value in message.items():
        if key in _NESTED and isinstance(value, Mapping):
            # The count (so an empty state still travels) sits beside the
            # flattened keys, where no state key can land: "#state".
            out[f"#{key}"] = len(value)
            for inner, leaf in value.items():
                out[f"{key}/{inner}"] = leaf
        else:
            out[key] = value
    return out


def decode(frame: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`encode`."""
    out: dict[str, Any] = {}
    for key, value in frame.items():
        head, sep, inner = key.partition("/")
        if sep and head in _NESTED:
            out.setdefault(head, {})[inner] = value
        elif key.startswith("#") and key[1:] in _NESTED:
            out.setdefault(key[1:], {})
        else:
            out[key] = value
    return out


@attrs.define
class Trainer:
    """Answers trainer requests with a task; the model it holds is ``state``."""

    task: Any
    state: dict[str, Any] | None = None
    requests: int = 0
    fits: int = 0
    examples: int = 0
    metrics: dict[str, float] = attrs.Factory(dict)
    _shards: dict[tuple[int, int], tuple[Any, Any]] = attrs.Factory(dict)

    def _shard(self, index: int, count: int) -> tuple[Any, Any]:
        key = (count, index)
        if key not in self._shards:
            x, y = self.task.train_data()
            xs, ys = shard_pair(x, y, count)
            if not 0 <= index < count:
                raise MeshError(f"shard {index} requested, but there are only {count}")
            self._shards[key] = (xs[index], ys[index])
        return self._shards[key]

    def handle(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """One request in, one reply out; a failure is an ``error`` reply, not a crash."""
        self.requests += 1
        op = request.get("op")
        try:
            reply = self._dispatch(op, request)
        except Exception as exc:  # the coordinator must hear why, not see a hang
            log.exception("trainer request %r failed", op)
            reply = {"error": f"{op}: {type(exc).__name__}: {exc}"}
        reply["seq"] = request.get("seq", 0)
        return reply

    def _dispatch(self, op: Any, request: Mapping[str, Any]) -> dict[str, Any]:
        if op == "fit":
            x, y = self._shard(int(request["shard"]), int(request["shards"]))
            result = self.task.fit(request["state"], x, y, seed=int(request["seed"]))
            self.state = dict(result.state)
            self.fits += 1
            self.examples += int(result.examples)
            self.metrics = {k: float(v) for k, v in result.metrics.items()}
            return {"state": self.state, "examples": int(result.examples),
                    "metrics": self.metrics}
        if op == "set_state":
            self.state = dict(request["state"])
            return {}
        if op == "grads":
            import numpy as np

            self._require_state(op)
            x, y = self._shard(int(request["shard"]), int(request["shards"]))
            batch = int(request.get("batch_size") or 0)
            if 0 < batch < len(y):
                rows = np.sort(np.random.default_rng(int(request["seed"])).choice(
                    len(y), size=batch, replace=False))
                x, y = x[rows], y[rows]
            result = self.task.gradients(self.state, x, y)
            self.examples += int(result.examples)
            return {"gradients": dict(result.state), "examples": int(result.examples),
                    "metrics": {k: float(v) for k, v in result.metrics.items()}}
        if op == "apply":
            self._require_state(op)
            self.state = dict(self.task.apply(self.state, request["gradients"]))
            return {}
        if op == "get_state":
            self._require_state(op)
            return {"state": self.state}
        if op == "stage":
            x = request["x"]
            for node in request["nodes"]:
                x = self.task.run_stage(request.get("state", {}), node, x)
            return {"x": x}
        raise MeshError(f"unknown trainer request {op!r}")

    def _require_state(self, op: str) -> None:
        if self.state is None:
            raise MeshError(f"{op!r} before any model was set on this worker")


# -- coordinator side: reaching workers --------------------------------------


@attrs.define
class LocalPool:
    """In-process workers: one :class:`Trainer` per rank, called directly.

    For tests and for strategies on a single machine without processes.
    ``fail(rank, request)`` may return a reason to simulate a lost worker.
    """

    trainers: dict[int, Trainer]
    fail: Callable[[int, Mapping[str, Any]], str | None] | None = None
    log: list[tuple[int, dict[str, Any]]] = attrs.Factory(list)

    @classmethod
    def of(cls, task_factory: Callable[[], Any], ranks: Sequence[int], **kw: Any) -> LocalPool:
        return cls({r: Trainer(task_factory()) for r in ranks}, **kw)

    def call(self, requests: Sequence[tuple[int, Mapping[str, Any]]],
             timeout: float | None) -> list[Reply]:
        replies = []
        for rank, request in requests:
            self.log.append((rank, dict(request)))
            reason = self.fail(rank, request) if self.fail else None
            if reason:
                replies.append(Reply(rank, None, reason))
                continue
            # Round-trip through the wire encoding, so tests exercise it.
            reply = decode(encode(self.trainers[rank].handle(decode(encode(request)))))
            replies.append(Reply(rank, reply))
        return replies

    def close(self) -> None:
        pass


@attrs.define
class GroupPool:
    """Reaches workers through a transport group (the coordinator is rank 0)."""

    group: Any
    _seq: int = 0
    _lost: dict[int, str] = attrs.Factory(dict)

    def call(self, requests: Sequence[tuple[int, Mapping[str, Any]]],
             timeout: float | None) -> list[Reply]:
        per_rank: dict[int, int] = {}
        pending: list[tuple[int, int]] = []
        for rank, request in requests:
            self._seq += 1
            per_rank[rank] = per_rank.get(rank, 0) + 1
            if rank not in self._lost:
                try:
                    self.group.send(rank, TAG_REQUEST, encode({**request, "seq": self._seq}))
                except (PeerLostError, WireError, OSError) as exc:
                    self._lost[rank] = f"send failed: {exc}"
            pending.append((rank, self._seq))
        # A worker serves its requests one after another, so its budget grows
        # with how many it was given.
        busiest = max(per_rank.values(), default=1)
        deadline = None if timeout is None else time.monotonic() + timeout * busiest
        replies = []
        for rank, seq in pending:
            if rank in self._lost:
                replies.append(Reply(rank, None, self._lost[rank]))
                continue
            try:
                replies.append(Reply(rank, self._receive(rank, seq, deadline)))
            except (PeerLostError, WireError, TimeoutError, OSError) as exc:
                reason = str(exc) or type(exc).__name__
                if isinstance(exc, TimeoutError):
                    reason = f"no answer within {timeout:g} s (stalled)"
                self._lost[rank] = reason
                self._declare_dead(rank, reason)
                replies.append(Reply(rank, None, reason))
        return replies

    def _receive(self, rank: int, seq: int, deadline: float | None) -> dict[str, Any]:
        for _ in range(1000):  # bounded: stale replies are few
            # Past the shared deadline a reply that already arrived still
            # counts: waiting on a slow rank must not condemn a prompt one.
            remaining = math.inf if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                frame = self.group.recv(rank, TAG_REPLY, timeout=remaining)
            except PeerLostError:
                if rank in getattr(self.group, "dead", {}):
                    raise
                raise TimeoutError from None
            reply = decode(frame)
            if reply.get("seq") == seq:
                return reply
            log.debug("rank %d: discarding a stale reply (seq %s, want %d)",
                      rank, reply.get("seq"), seq)
        raise WireError(f"rank {rank} sent too many unexpected replies")

    def _declare_dead(self, rank: int, reason: str) -> None:
        # Tell the transport's ledger, so it drops the link and a late frame
        # from the rank can never be mistaken for a live one.
        declare = getattr(self.group, "declare_dead", None)
        if callable(declare):
            try:
                declare(rank, reason)
            except Exception:  # best effort: the rank is dropped here regardless
                log.debug("declare_dead(%d) failed", rank, exc_info=True)

    def stop_all(self, ranks: Sequence[int]) -> None:
        """Tell workers the run is over (best effort: some may be gone)."""
        for rank in ranks:
            if rank in self._lost:
                continue
            try:
                self.group.send(rank, TAG_REQUEST, {"op": "stop", "seq": 0})
            except (PeerLostError, WireError, OSError):
                pass

    def close(self) -> None:
        pass


# -- worker side --------------------------------------------------------------


def serve_trainer(group: Any, spec: Mapping[str, Any], control: Any = None) -> Any:
    """Serve trainer requests from rank 0 until told to stop; returns a ``TrainReport``.

    ``control`` is a :class:`meshkit.NodeControl` (its stop flag is observed
    between requests) or None.
    """
    from meshkit.task import create_task

    started = time.monotonic()
    try:
        trainer: Trainer | None = Trainer(
            create_task(str(spec["task"]), spec.get("task_options") or {}))
        failure: MeshError | None = None
    except MeshError as exc:
        # Answer every request with the reason instead of leaving: the
        # coordinator waits on replies, and silence would read as a stalled
        # worker (dropped after [mesh] timeout) rather than as this error.
        log.error("rank %s cannot build the task: %s", getattr(group, "rank", "?"), exc)
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
            if 0 in getattr(group, "dead", {}) or time.monotonic() - idle_since > idle:
                stopped = f"coordinator lost: {exc}"
                break
            continue
        idle_since = time.monotonic()
        request = decode(frame)
        if request.get("op") == "stop":
            break
        if trainer is None:
            reply = {"error": f"cannot build the task on this worker: {failure}",
                     "seq": request.get("seq", 0)}
        else:
            reply = trainer.handle(request)
        try:
            group.send(0, TAG_REPLY, encode(reply))
        except PeerLostError as exc:
            stopped = f"coordinator lost: {exc}"
            break
    if failure is not None:
        raise failure
    log.info("trainer on rank %s finished%s", getattr(group, "rank", "?"),
             f": {stopped}" if stopped else "")
    return _train_report(group, trainer, stopped, time.monotonic() - started)


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


def _train_report(group: Any, trainer: Trainer, stopped: str | None, seconds: float) -> Any:
    from meshkit.node import TrainReport

    return TrainReport(rank=getattr(group, "rank", -1), steps=trainer.requests,
                       rounds=trainer.fits, examples=trainer.examples,
                       metrics=dict(trainer.metrics), stopped=stopped, seconds=seconds)
