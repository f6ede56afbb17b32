"""Running a pipeline from the coordinator: :func:`run_pipeline`.

The coordinator places the stages, ships each rank its stage, streams
activations into the first one with several in flight (consecutive ones of
one length sharing a frame), and collects the last stage's outputs in input
order. Every failure — a stage that refuses or fails, a rank that leaves or
dies, a stalled pipeline — unwinds the job here (every live stage drains and
reports) before the first failure is raised.

Where the transport delivers on a reader thread per link, the next frame
does not wait for this thread to wake up: the reader that brings a result
in from the last stage writes the next prepared frame to the first stage
itself (:class:`_Feed`), and this thread keeps a window's worth of frames
prepared ahead and does the bookkeeping behind it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import attrs
import numpy as np

import meshkit.errors as errors
from meshkit.errors import ConfigError, MeshError, PeerLostError, WireError
from meshkit.node import (
    TAG_ABORT,
    TAG_ACT,
    TAG_UP,
    NodeCaps,
    NodeReport,
    report_from_json,
    send_job,
)
from meshkit.pipeline._placement import Placement, place
from meshkit.pipeline._stages import Stage

__all__ = ["BATCH_BYTES", "PipelineResult", "run_pipeline"]

log = logging.getLogger(__name__)

#: With automatic batching, a frame packs activations up to about this many
#: bytes: small ones share frames, large ones (where the per-frame cost is
#: already amortised) travel alone so every hop can work on a different one.
BATCH_BYTES = 256 << 10
#: How often the coordinator re-reads the dead ledger while waiting (seconds).
POLL = 0.5
_job_ids = itertools.count(1)


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
            dead = self.group.dead  # a copy; empty (falsy) while everyone lives
            newly_dead = sorted((dead.keys() & self.ranks) - self.reports.keys()
                                - self._dead_seen) if dead else None
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
            if len(msg) == 1 and next(iter(msg)).startswith("result/"):
                ((key, x),) = msg.items()
                _, job, seq = key.split("/", 2) if key.count("/") == 2 else ("", "", "")
                if not seq.isdigit():
                    raise WireError(f"pipeline job {self.job}: rank {src} sent a malformed "
                                    f"result header {key!r}")
                if src in self.ranks and job == str(self.job):
                    return src, {"kind": "result", "seq": int(seq), "x": x}
                continue
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
                if not isinstance(report, NodeReport):  # a train report has no place here
                    raise WireError(f"pipeline job {self.job}: rank {src} sent a "
                                    f"{type(report).__name__}, not a node report")
                self.reports[src] = report
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
        ledger = self.group.dead
        if not ledger or self.failure is not None:
            return  # asked after every result: nothing to work out while no one died
        dead = sorted(ledger.keys() & (self.ranks - self.reports.keys()))
        if dead:
            self.failure = PeerLostError(
                f"pipeline job {self.job}: rank(s) {dead} died: "
                + "; ".join(f"rank {r}: {self.group.dead[r]}" for r in dead))


class _Feed:
    """Frames prepared for the first stage, sent by whichever thread has room first.

    This thread prepares frames (:meth:`add`); a result coming in from the
    last stage frees its rows' room in the window, and the reader that read
    it sends the next prepared frame on the spot (:meth:`_result`, diverted
    from the last rank's ``TAG_UP``) before the result goes on to the
    mailbox, so the window refills without a thread hand-off. Sends happen
    in order, under one lock.
    """

    def __init__(self, group: Any, job: int, first: int, last: int, in_flight: int) -> None:
        self.group = group
        self.job = job
        self.first = first
        self.last = last
        self.in_flight = in_flight
        self._lock = threading.Lock()
        self._ready: list[tuple[int, np.ndarray]] = []
        self._moving = 0  # activations sent and not yet seen back here
        self._closed = False
        self.inline = bool(getattr(group, "inline_delivery", False)) and hasattr(group, "divert")
        if self.inline:
            group.divert(last, TAG_UP, self._result)

    @property
    def ahead(self) -> int:
        """Activations to keep prepared beyond those in flight (none without a reader)."""
        return self.in_flight if self.inline else 0

    def add(self, seq: int, frame: np.ndarray) -> None:
        """Queue a prepared frame and send what the window has room for."""
        with self._lock:
            self._ready.append((seq, frame))
            self._pump(None)

    def _pump(self, deadline: float | None) -> None:
        # Without a reader refilling it, run_pipeline's own window is the limit.
        while self._ready and not self._closed and (
                not self.inline or self._moving == 0
                or self._moving + self._ready[0][1].shape[0] <= self.in_flight):
            seq, frame = self._ready.pop(0)
            self._moving += frame.shape[0]
            # The compact form: one entry, no JSON leaf (see meshkit.node).
            msg = {f"act/{self.job}/{seq}": frame}
            if deadline is None:
                self.group.send(self.first, TAG_ACT, msg)
            else:
                self.group.send(self.first, TAG_ACT, msg, deadline=deadline)

    def _result(self, payload: Mapping[str, Any]) -> bool:
        """On the last rank's reader: a result frees room; refill it. Always declined
        (the result goes on to the mailbox, where :func:`run_pipeline` takes it)."""
        x = _compact_result(payload, self.job)
        if x is None:
            return False
        with self._lock:
            self._moving = max(0, self._moving - x.shape[0])
            try:
                # Bounded like a stage's own write: a first stage that takes
                # nothing is dropped rather than holding this reader.
                self._pump(time.monotonic() + 0.5 * self.group.timeout)
            except PeerLostError as exc:
                log.debug("pipeline job %d: refilling rank %d failed: %s", self.job,
                          self.first, exc)
        return False

    def close(self) -> None:
        """No more frames go out (the job ends or unwinds); prepared ones are dropped."""
        with self._lock:
            self._closed = True
            self._ready.clear()
        if self.inline:
            self.group.undivert(self.last, TAG_UP, self._result)


def _compact_result(msg: Mapping[str, Any], job: int) -> np.ndarray | None:
    """The rows of a ``{"result/<job>/<seq>": x}`` frame of ``job``, or None."""
    if len(msg) != 1:
        return None
    ((key, x),) = msg.items()
    if not (key.startswith(f"result/{job}/") and isinstance(x, np.ndarray) and x.ndim == 2):
        return None
    return x


def _error_from(msg: Mapping[str, Any], src: int) -> MeshError:
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
    feed = _Feed(group, job, first, placed[-1], in_flight)
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
            window = in_flight + feed.ahead
            while (not exhausted or lookahead) and len(pending) < window \
                    and collector.failure is None:
                room = min(batch, window - len(pending))
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
                feed.add(sent, frame)
                pending.update(range(sent, sent + len(rows)))
                sent += len(rows)
            if collector.failure is not None or not pending:
                break
            src, msg = collector.take()
            if msg.get("kind") == "result":
                seq = msg.get("seq")
                y = msg.get("x")
                if not isinstance(seq, int) or not isinstance(y, np.ndarray) or y.ndim != 2 \
                        or not (seq in pending if y.shape[0] == 1
                                else set(range(seq, seq + y.shape[0])) <= pending):
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
        feed.close()
        _unwind(group, placement, collector, job, set(placed), started=True, abort_all=True)
        raise
    feed.close()
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
