"""Pipelined inference driven by the coordinator: stages, placement, streaming.

A pipeline is an ordered list of :class:`Stage` objects. The coordinator
places each on a rank whose :class:`~meshkit.NodeCaps` accept it
(:func:`place`), ships each rank its stage, streams activations into the
first one with several in flight, and collects the last stage's outputs in
order (:func:`run_pipeline`).

Stages a worker runs (this release keeps them simple; weights travel in the
job message as arrays):

=============  ===============================================================
``identity``   ``y = x``
``scale``      ``y = scale * x``
``relu``       ``y = max(x, 0)``
``tanh``       ``y = tanh(x)``
``affine``     ``y = x @ weights (+ bias)``, then ``activation`` (relu/tanh)
               if set; ``weights`` has shape (in, out)
``call``       ``y = f(x)`` for ``function = "module:function"``, imported on
               the worker (the coordinator is authenticated by the shared
               secret; the module must be installed on the worker)
``None``       a *board stage*: only a fixed-function rank whose descriptor
               has this ``stage_id`` can run it (:meth:`Stage.board`)
=============  ===============================================================

Activations are 1-D float32 vectors (inputs are flattened), as on
fixed-function hardware, whose host links exchange f32.

Placement rules (checked before any activation moves, each refusal a
:class:`~meshkit.PlacementError`):

* a fixed-function rank only ever gets the stage its board implements;
* a board stage goes to a free fixed-function rank implementing its
  ``stage_id``; none -> refused, naming the stage and the boards present;
* any other stage goes to a free worker rank (lowest rank first); with
  ``ranks=`` given explicitly, every (stage, rank) pair is checked;
* :func:`place_training` refuses a training job that would include a
  fixed-function rank (:meth:`NodeCaps.check_train` says why).
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import attrs
import numpy as np

from meshkit.errors import (
    BoardError,
    ConfigError,
    MeshError,
    PeerLostError,
    PlacementError,
    WireError,
)
from meshkit.node import (
    TAG_ABORT,
    TAG_ACT,
    TAG_UP,
    NodeCaps,
    NodeReport,
    _activation,
    report_from_json,
    send_job,
)

__all__ = [
    "OPS",
    "Stage",
    "Placement",
    "PipelineResult",
    "place",
    "place_training",
    "run_pipeline",
    "run_local",
]

log = logging.getLogger(__name__)

#: Ops a worker stage may name (None: a board stage).
OPS = ("identity", "scale", "relu", "tanh", "affine", "call")
_ACTIVATIONS = (None, "relu", "tanh")
_PARAM = "param."
#: With automatic batching, a frame packs activations up to about this many
#: bytes: small ones share frames, large ones (where the per-frame cost is
#: already amortised) travel alone so every hop can work on a different one.
BATCH_BYTES = 256 << 10
#: How often the coordinator re-reads the dead ledger while waiting (seconds).
POLL = 0.5
_job_ids = itertools.count(1)


def _as_weights(value: Any) -> np.ndarray | None:
    return None if value is None else np.ascontiguousarray(value, dtype=np.float32)


@attrs.frozen(eq=False)
class Stage:
    """One pipeline stage (see the module docstring for the ops)."""

    op: str | None = "identity"
    stage_id: str | None = None
    scale: float = 1.0
    function: str | None = None
    activation: str | None = None
    weights: np.ndarray | None = attrs.field(default=None, repr=False)
    bias: np.ndarray | None = attrs.field(default=None, repr=False)
    _fn: Any = attrs.field(default=None, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        where = f"stage [{self.stage_id}]" if self.stage_id else "stage"
        if self.op is None:
            if not self.stage_id:
                raise ConfigError(
                    "a board stage (op None) must set stage_id: it names the "
                    "pre-synthesized stage a fixed-function rank implements")
            return
        if self.op not in OPS:
            raise ConfigError(f"{where}: op must be one of {', '.join(OPS)} (or None for a "
                              f"board stage), got {self.op!r}")
        if self.activation not in _ACTIVATIONS:
            raise ConfigError(f"{where}: activation must be 'relu', 'tanh' or None, "
                              f"got {self.activation!r}")
        if self.op == "affine":
            w = self.weights
            if w is None or w.ndim != 2:
                raise ConfigError(
                    f"{where}: op 'affine' needs weights of shape (in, out), got "
                    f"{None if w is None else w.shape}")
            if self.bias is not None and self.bias.shape != (w.shape[1],):
                raise ConfigError(
                    f"{where}: bias has shape {self.bias.shape}, expected ({w.shape[1]},) "
                    f"to match weights {w.shape}")
            object.__setattr__(self, "weights", _as_weights(w))
            object.__setattr__(self, "bias", _as_weights(self.bias))
        if self.op == "call" and not (self.function and self.function.count(":") == 1):
            raise ConfigError(f"{where}: op 'call' needs function = 'module:function', "
                              f"got {self.function!r}")

    # -- constructors --------------------------------------------------------

    @classmethod
    def board(cls, stage_id: str) -> Stage:
        """A stage only fixed-function hardware implementing ``stage_id`` runs."""
        return cls(op=None, stage_id=stage_id)

    @classmethod
    def affine(cls, weights: Any, bias: Any = None, *, activation: str | None = None,
               stage_id: str | None = None) -> Stage:
        return cls(op="affine", weights=np.asarray(weights, dtype=np.float32),
                   bias=None if bias is None else np.asarray(bias, dtype=np.float32),
                   activation=activation, stage_id=stage_id)

    @property
    def input_elems(self) -> int | None:
        """Elements this stage consumes, when its op fixes it."""
        return int(self.weights.shape[0]) if self.op == "affine" and self.weights is not None \
            else None

    @property
    def output_elems(self) -> int | None:
        return int(self.weights.shape[1]) if self.op == "affine" and self.weights is not None \
            else None

    def describe(self) -> str:
        if self.op is None:
            return f"board stage [{self.stage_id}]"
        label = f" [{self.stage_id}]" if self.stage_id else ""
        return f"{self.op} stage{label}"

    # -- running -------------------------------------------------------------

    def run(self, x: np.ndarray) -> np.ndarray:
        """Compute this stage on one activation (a worker's side)."""
        x = np.asarray(x, dtype=np.float32).reshape(-1)
        op = self.op
        if op is None:
            raise PlacementError(
                f"{self.describe()} runs only on fixed-function hardware implementing it")
        if op == "identity":
            return x
        if op == "scale":
            return np.multiply(x, np.float32(self.scale), dtype=np.float32)
        if op == "relu":
            return np.maximum(x, np.float32(0))
        if op == "tanh":
            return np.tanh(x)
        if op == "affine":
            assert self.weights is not None
            if x.size != self.weights.shape[0]:
                raise PlacementError(
                    f"{self.describe()} takes {self.weights.shape[0]} elements, got an "
                    f"activation of {x.size}: fix the stage feeding it")
            y = x @ self.weights
            if self.bias is not None:
                np.add(y, self.bias, out=y)
            if self.activation == "relu":
                np.maximum(y, np.float32(0), out=y)
            elif self.activation == "tanh":
                np.tanh(y, out=y)
            return y
        # op == "call"
        fn = self._fn
        if fn is None:
            fn = _import_callable(self.function or "", self.describe())
            object.__setattr__(self, "_fn", fn)
        where = f"{self.describe()}: {self.function}"
        try:
            value = fn(x)
        except MeshError:
            raise
        except Exception as exc:  # the user's function: an error naming it, not a crash
            raise MeshError(f"{where} raised {type(exc).__name__}: {exc}") from exc
        return _activation(value, where)

    # -- wire form -------------------------------------------------------------

    def to_message(self) -> dict[str, Any]:
        """The stage as a job-message fragment: ``stage`` JSON + ``param.*`` arrays."""
        spec = {"op": self.op, "stage_id": self.stage_id, "scale": float(self.scale),
                "function": self.function, "activation": self.activation}
        message: dict[str, Any] = {"stage": spec}
        if self.weights is not None:
            message[_PARAM + "weights"] = self.weights
        if self.bias is not None:
            message[_PARAM + "bias"] = self.bias
        return message

    @classmethod
    def from_message(cls, message: Mapping[str, Any]) -> Stage:
        """Rebuild a stage from a job message, refusing anything malformed."""
        spec = message.get("stage")
        if not isinstance(spec, Mapping):
            raise WireError("stage message carries no 'stage' object")
        op = spec.get("op")
        stage_id = spec.get("stage_id")
        function = spec.get("function")
        activation = spec.get("activation")
        scale = spec.get("scale", 1.0)
        for name, value in (("op", op), ("stage_id", stage_id), ("function", function),
                            ("activation", activation)):
            if value is not None and not isinstance(value, str):
                raise WireError(f"stage message: {name} must be a string or null, got {value!r}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise WireError(f"stage message: scale must be a number, got {scale!r}")
        arrays = {}
        for name in ("weights", "bias"):
            value = message.get(_PARAM + name)
            if value is not None and not isinstance(value, np.ndarray):
                raise WireError(f"stage message: {_PARAM}{name} must be an array")
            arrays[name] = value
        try:
            return cls(op=op, stage_id=stage_id, scale=float(scale), function=function,
                       activation=activation, **arrays)
        except ConfigError as exc:
            raise WireError(f"stage message: {exc}") from None


def _import_callable(spec: str, where: str) -> Any:
    import importlib

    module_name, _, attr = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{where}: cannot load {spec!r}: {exc}") from None
    if not callable(target):
        raise ConfigError(f"{where}: {spec!r} is not callable")
    return target


# -- placement ---------------------------------------------------------------------


@attrs.frozen
class Placement:
    """Which rank runs which stage, in pipeline order."""

    stages: tuple[Stage, ...]
    ranks: tuple[int, ...]

    def route(self, index: int) -> tuple[int, int]:
        """(prev, next) ranks of stage ``index``; 0 is the coordinator at both ends."""
        prev = self.ranks[index - 1] if index > 0 else 0
        nxt = self.ranks[index + 1] if index + 1 < len(self.ranks) else 0
        return prev, nxt

    def describe(self) -> str:
        return ", ".join(f"{s.describe()} -> rank {r}" for s, r in zip(self.stages, self.ranks))


def _caps_by_rank(caps: Iterable[NodeCaps]) -> dict[int, NodeCaps]:
    by_rank: dict[int, NodeCaps] = {}
    for c in caps:
        if c.rank in by_rank:
            raise PlacementError(f"two capability records claim rank {c.rank}")
        by_rank[c.rank] = c
    return by_rank


def _boards(by_rank: Mapping[int, NodeCaps]) -> str:
    boards = [f"rank {r} implements [{c.fixed_function.stage_id}]"
              for r, c in sorted(by_rank.items()) if c.fixed_function is not None]
    return "; ".join(boards) if boards else "no fixed-function rank joined"


def place(stages: Sequence[Stage], caps: Iterable[NodeCaps],
          ranks: Sequence[int] | None = None) -> Placement:
    """Assign each stage a rank whose caps accept it, or raise :class:`PlacementError`.

    One stage per rank. With ``ranks`` (one per stage) the assignment is
    checked instead of chosen.
    """
    stages = tuple(stages)
    if not stages:
        raise PlacementError("a pipeline needs at least one stage")
    by_rank = _caps_by_rank(caps)
    if ranks is not None:
        ranks = tuple(ranks)
        if len(ranks) != len(stages):
            raise PlacementError(
                f"ranks: got {len(ranks)} for {len(stages)} stages; give one rank per stage")
        if len(set(ranks)) != len(ranks):
            raise PlacementError(f"ranks: each rank runs one stage, got {list(ranks)}")
        for stage, rank in zip(stages, ranks):
            node = by_rank.get(rank)
            if node is None:
                raise PlacementError(
                    f"{stage.describe()} was placed on rank {rank}, which has not announced "
                    f"its capabilities (known ranks: {sorted(by_rank)})")
            node.check(stage)
            if stage.op is None and node.fixed_function is None:
                raise PlacementError(
                    f"{stage.describe()} was placed on rank {rank}, a worker: it runs only "
                    f"on a fixed-function rank implementing it ({_boards(by_rank)})")
        return Placement(stages, ranks)

    free = dict(sorted(by_rank.items()))
    chosen: list[int] = []
    for stage in stages:
        if stage.op is None:
            match = [r for r, c in free.items()
                     if c.fixed_function is not None and c.accepts(stage)]
            if not match:
                taken = [r for r in chosen if by_rank[r].accepts(stage)
                         and by_rank[r].fixed_function is not None]
                extra = (f"; rank(s) {taken} implementing it already run an earlier stage"
                         if taken else "")
                raise PlacementError(
                    f"no rank can run board stage [{stage.stage_id}]: no fixed-function "
                    f"rank implements it ({_boards(by_rank)}){extra}. Start a node with a "
                    f"board implementing [{stage.stage_id}], or give the stage an op a "
                    f"worker can run")
        else:
            match = [r for r, c in free.items() if c.fixed_function is None]
            if not match:
                raise PlacementError(
                    f"no free worker rank for {stage.describe()} (stage {len(chosen) + 1} of "
                    f"{len(stages)}): {len(by_rank)} rank(s) joined, fixed-function ranks "
                    f"run only their own stage; start more workers")
        chosen.append(match[0])
        del free[match[0]]
    return Placement(stages, tuple(chosen))


def place_training(caps: Iterable[NodeCaps], ranks: Sequence[int] | None = None) -> list[int]:
    """The ranks of a training job, refusing any that cannot train.

    Every rank in ``ranks`` (all announced ranks when None) must pass
    :meth:`NodeCaps.check_train`; the first that does not is a
    :class:`PlacementError` saying why. This runs before any spec is sent.
    """
    by_rank = _caps_by_rank(caps)
    chosen = sorted(by_rank) if ranks is None else list(ranks)
    for rank in chosen:
        node = by_rank.get(rank)
        if node is None:
            raise PlacementError(
                f"training job includes rank {rank}, which has not announced its "
                f"capabilities (known ranks: {sorted(by_rank)})")
        node.check_train()
    return chosen


# -- running -----------------------------------------------------------------------


@attrs.frozen
class PipelineResult:
    """Outputs in input order, each placed rank's report, and the placement.

    With ``run_pipeline(..., on_output=f)`` the outputs went to ``f`` as they
    arrived and :attr:`outputs` is empty; :attr:`count` is how many there were.
    """

    outputs: list[np.ndarray]
    reports: dict[int, NodeReport]
    placement: Placement
    seconds: float
    count: int = 0


class _Collector:
    """Takes replies from the placed ranks, turning failures into errors."""

    def __init__(self, group: Any, job: int, ranks: Sequence[int], timeout: float) -> None:
        self.group = group
        self.job = job
        self.ranks = set(ranks)
        self.timeout = timeout
        self.reports: dict[int, NodeReport] = {}
        self.failure: MeshError | None = None
        #: Ranks that refused or failed their stage (they drain, or never started).
        self.failed: set[int] = set()
        self._dead_seen: set[int] = set()

    def take(self) -> tuple[int, Mapping[str, Any]]:
        """The next reply of this job (stale replies of older jobs are dropped).

        While waiting, the dead ledger is checked every :data:`POLL` seconds:
        a placed rank that dies without reporting sets :attr:`failure` and
        returns ``(rank, {"kind": "dead"})`` once, so a dead stage is noticed
        without waiting out the whole timeout. No reply at all within
        ``timeout`` is a :class:`PeerLostError`.
        """
        deadline = time.monotonic() + self.timeout
        while True:
            newly_dead = sorted((set(self.group.dead) & self.ranks)
                                - self.reports.keys() - self._dead_seen)
            if newly_dead:
                self._dead_seen.update(newly_dead)
                self.check_dead()
                return newly_dead[0], {"kind": "dead"}
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PeerLostError(
                    f"pipeline job {self.job}: no reply from rank(s) "
                    f"{sorted(self.ranks - self.reports.keys())} within {self.timeout:g} s; "
                    f"a stage stalled (raise the timeout if it is just slow)")
            try:
                src, msg = self.group.recv(None, TAG_UP, timeout=min(remaining, POLL))
            except PeerLostError as exc:
                if len(self.group.dead) >= self.group.world_size - 1:
                    raise PeerLostError(f"pipeline job {self.job}: {exc}") from None
                continue  # quiet for a poll: look at the dead ledger again
            if "result" in msg:
                head = msg["result"]
                if not (isinstance(head, list) and len(head) == 2):
                    raise WireError(f"pipeline job {self.job}: rank {src} sent a malformed "
                                    f"result header {head!r}")
                if src in self.ranks and head[0] == self.job:
                    return src, {"kind": "result", "seq": head[1], "x": msg.get("x")}
                continue
            if src not in self.ranks or msg.get("job") != self.job:
                log.debug("dropping a stale reply from rank %d: %r", src, msg.get("kind"))
                continue
            kind = msg.get("kind")
            if kind in ("report", "left"):
                report = report_from_json(msg.get("report") or {})
                self.reports[src] = report  # type: ignore[assignment]
                if kind == "left" and self.failure is None:
                    why = ("stop handle raised" if report.stopped == "stop"
                           else "step budget spent")
                    self.failure = PeerLostError(
                        f"rank {src} left pipeline job {self.job} after "
                        f"{report.activations} activation(s) ({report.stopped}: {why})")
            elif kind == "error":
                self.failed.add(src)
                if self.failure is None:
                    self.failure = _error_from(msg, src)
            return src, msg

    def check_dead(self) -> None:
        dead = sorted(set(self.group.dead) & (self.ranks - self.reports.keys()))
        if dead and self.failure is None:
            self.failure = PeerLostError(
                f"pipeline job {self.job}: rank(s) {dead} died: "
                + "; ".join(f"rank {r}: {self.group.dead[r]}" for r in dead))


def _error_from(msg: Mapping[str, Any], src: int) -> MeshError:
    import meshkit.errors as errors

    cls = getattr(errors, str(msg.get("error")), None)
    if not (isinstance(cls, type) and issubclass(cls, MeshError)):
        cls = MeshError
    text = str(msg.get("message") or "no message")
    return cls(text if f"rank {src}" in text else f"rank {src}: {text}")


def run_pipeline(group: Any, stages: Sequence[Stage] | Placement, caps: Iterable[NodeCaps],
                 inputs: Iterable[Any], *, ranks: Sequence[int] | None = None,
                 in_flight: int = 8, batch: int | None = None,
                 timeout: float | None = None,
                 on_output: Callable[[int, np.ndarray], Any] | None = None) -> PipelineResult:
    """Run ``inputs`` through a pipeline of ``stages`` on the mesh; outputs in order.

    Placement happens first (:func:`place`), so a stage no rank can run is a
    :class:`PlacementError` before any job or activation is sent. Each placed
    rank then gets its stage and answers ``ready`` (a rank that refuses the
    stage is an error here, still before activations move). Up to
    ``in_flight`` activations travel at once so every stage stays busy;
    consecutive activations of one length travel ``batch`` to a frame
    (default ``max(1, in_flight // 4)``, so about four frames are in flight,
    one per hop, and no more than :data:`BATCH_BYTES` of activations a
    frame). Each activation is still computed on its own by every stage:
    batching changes how bytes move, never what is computed.
    A stage that fails, a rank that leaves or dies: the pipeline is unwound
    (every live stage drains and reports) and the first failure is raised.
    ``timeout`` bounds every wait for a reply (the group's timeout when None).

    ``on_output(index, y)`` streams instead of collecting: it is called with
    each output in input order as soon as that output and every one before it
    have arrived, and nothing is kept (``result.outputs`` is empty), so a long
    stream runs in constant memory. An exception it raises aborts the
    pipeline like any other failure and propagates.
    """
    if in_flight < 1:
        raise ConfigError(f"in_flight must be at least 1, got {in_flight}")
    auto_batch = batch is None
    if batch is None:
        batch = max(1, in_flight // 4)
    if batch < 1:
        raise ConfigError(f"batch must be at least 1, got {batch}")
    placement = stages if isinstance(stages, Placement) else place(stages, caps, ranks)
    wait = group.timeout if timeout is None else timeout
    job = next(_job_ids)
    started = time.monotonic()
    placed = placement.ranks
    collector = _Collector(group, job, placed, wait)

    for index, (stage, rank) in enumerate(zip(placement.stages, placed)):
        prev, nxt = placement.route(index)
        message = stage.to_message()
        message["stage"] = {**message["stage"], "prev": prev, "next": nxt, "index": index}
        send_job(group, rank, {"kind": "pipeline", "job": job, **message})
    ready: set[int] = set()
    try:
        while len(ready | collector.reports.keys()) < len(placed):
            src, msg = collector.take()
            if msg.get("kind") == "ready":
                ready.add(src)
            if collector.failure is not None:
                break
    except BaseException:
        _unwind(group, placement, collector, job, ready, started=False)
        raise
    if collector.failure is not None:
        # Ranks that refused their stage never entered the loop; the rest are
        # waiting for activations and are told to abort.
        _unwind(group, placement, collector, job, set(placed) - collector.failed,
                started=False)
        raise collector.failure

    first = placed[0]
    outputs: dict[int, np.ndarray] = {}
    pending: set[int] = set()
    sent = 0
    delivered = 0  # with on_output: outputs before this index were handed over
    source = iter(inputs)
    lookahead: list[np.ndarray] = []
    exhausted = False
    try:
        while True:
            # Fill the window. Consecutive activations of one length share a
            # frame (up to ``batch``), which amortises the per-frame cost (MAC,
            # header, syscalls) without changing what any stage computes.
            while (not exhausted or lookahead) and len(pending) < in_flight \
                    and collector.failure is None:
                room = min(batch, in_flight - len(pending))
                rows: list[np.ndarray] = []
                while len(rows) < room:
                    if auto_batch and rows and (len(rows) + 1) * rows[0].nbytes > BATCH_BYTES:
                        break  # large activations pipeline better one to a frame
                    if lookahead:
                        x = lookahead.pop()
                    else:
                        try:
                            x = next(source)
                        except StopIteration:
                            exhausted = True
                            break
                        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
                    if rows and x.size != rows[0].size:
                        lookahead.append(x)
                        break
                    rows.append(x)
                if not rows:
                    break
                frame = rows[0].reshape(1, -1) if len(rows) == 1 else np.stack(rows)
                group.send(first, TAG_ACT, {"act": [job, sent], "x": frame})
                pending.update(range(sent, sent + len(rows)))
                sent += len(rows)
            if collector.failure is not None or not pending:
                break
            src, msg = collector.take()
            if msg.get("kind") == "result":
                seq = msg.get("seq")
                y = msg.get("x")
                if not isinstance(seq, int) or not isinstance(y, np.ndarray) or y.ndim != 2 \
                        or not set(range(seq, seq + y.shape[0])) <= pending:
                    raise WireError(f"pipeline job {job}: rank {src} sent a malformed or "
                                    f"unexpected result (seq {seq!r})")
                for i, row in enumerate(y):
                    outputs[seq + i] = row
                pending.difference_update(range(seq, seq + y.shape[0]))
                if on_output is not None:
                    while delivered in outputs:
                        on_output(delivered, outputs.pop(delivered))
                        delivered += 1
            collector.check_dead()
    except BaseException:
        # Something broke on this side (a lost first stage, a stalled pipeline,
        # Ctrl-C): abort every stage rather than hope an end gets through.
        _unwind(group, placement, collector, job, set(placed), started=True, abort_all=True)
        raise
    _unwind(group, placement, collector, job, set(placed), started=True)
    if collector.failure is not None:
        raise collector.failure
    return PipelineResult([outputs[i] for i in range(sent)] if on_output is None else [],
                          dict(collector.reports), placement, time.monotonic() - started,
                          count=sent)


def _unwind(group: Any, placement: Placement, collector: _Collector, job: int,
            expect: set[int], *, started: bool, abort_all: bool = False) -> None:
    """End the job and collect the report of every rank in ``expect``.

    Normally the ``end`` marker flows down the pipeline behind the last
    activation and each stage reports as it passes. If activations never
    started, or a rank left or died (so an ``end`` cannot pass through it),
    every remaining stage is told to abort directly.
    """
    aborted = False

    def abort(ranks: Iterable[int]) -> None:
        for r in ranks:
            try:
                group.send(r, TAG_ABORT, {"kind": "abort", "job": job})
            except PeerLostError:
                pass

    if started:
        try:
            group.send(placement.ranks[0], TAG_ACT, {"end": job})
        except PeerLostError:
            pass
    if not started or abort_all:
        abort(placement.ranks)
        aborted = True
    deadline = time.monotonic() + collector.timeout
    while True:
        waiting = expect - collector.reports.keys() - set(group.dead)
        if not waiting or time.monotonic() > deadline:
            break
        if not aborted and isinstance(collector.failure, PeerLostError):
            abort(waiting)
            aborted = True
        try:
            collector.take()
        except PeerLostError:
            break
    missing = expect - collector.reports.keys()
    if missing:
        log.warning("pipeline job %d: rank(s) %s did not report", job, sorted(missing))


def run_local(stages: Sequence[Stage], inputs: Iterable[Any],
              boards: Mapping[str, Any] | None = None) -> list[np.ndarray]:
    """Compute a pipeline in this process (the reference the mesh must match).

    ``boards`` maps a board stage's ``stage_id`` to a board driver.
    """
    outputs = []
    for x in inputs:
        y = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        for stage in stages:
            if stage.op is None:
                if not boards or stage.stage_id not in boards:
                    raise PlacementError(f"run_local: no board given for {stage.describe()}")
                y = _activation(boards[stage.stage_id].execute(y),
                                f"{stage.describe()}: the board", BoardError)
            else:
                y = stage.run(y)
        outputs.append(y)
    return outputs
