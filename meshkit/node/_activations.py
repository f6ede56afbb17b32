"""The activation loop: how a node serves one pipeline stage (the hot path).

A stage takes activations from the rank before it, runs each through its
function and passes the result to the rank after it, until the job's
``end`` arrives, the stop handle is raised or the step budget is spent
(:func:`serve_stage`). Whatever the stage computes — a :class:`Stage` on a
worker, a board on a fixed-function rank — the relay is this one loop, so a
failure anywhere is reported to rank 0, the job drained to its ``end`` and
the ``end`` passed on, and the pipeline unwinds instead of hanging.

The hot path runs where the activation was read. The stage diverts its
activations (``group.divert``) and, on a transport whose every link has its
own reader thread (``group.inline_delivery``), the reader that authenticated
and decoded a frame runs the stage on it and writes the result on to the
next rank itself: no thread hand-off, no wake-up of a serving thread, the
received buffer's views going straight into the stage. What runs there is
bounded, so it holds up only the link it read from, and never for long:

* a write that cannot finish within half the stall timeout
  (:data:`INLINE_WRITE_SHARE`) drops the next rank as stalled, as the star
  relay does, well before the ranks sending here give up on this one;
* results bigger than :data:`INLINE_BYTES` (whose write may take long and
  whose wake-up cost is noise) go to the serving thread, and so does the
  rest of the job once a frame took the stage more than :data:`INLINE_BUDGET`
  of CPU time, so a slow stage does not sit on a reader;
* everything that is not a plain activation of this job (its ``end``, a
  stale or malformed frame), a stop or spent budget, and a failure go to the
  serving thread, which runs exactly the loop it runs without inline
  delivery.

The serving thread owns the job: it parks while the reader serves, observes
the stop handle every :data:`~meshkit.node.POLL_INTERVAL` and a job's abort
when nothing arrived for a whole poll, and it re-arms the inline path only
when nothing is queued, so per-sender order holds. One frame is processed at
a time, by one thread or the other, and the stop handle and step budget are
checked between activations wherever they run.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Mapping, TypeVar

import attrs
import numpy as np

from meshkit.errors import MeshError, PeerLostError, WireError
from meshkit.node._caps import NodeRole
from meshkit.node._control import POLL_INTERVAL, NodeControl, recv_polling
from meshkit.node._jobs import TAG_ABORT, TAG_ACT, TAG_UP, report_job_error, send_up
from meshkit.node._reports import NodeReport, sendable

__all__ = ["StageRoute", "parse_job", "serve_stage"]

log = logging.getLogger(__name__)

#: Results of at most this many bytes a frame are written on by the reader
#: that read the activation; bigger ones go through the serving thread.
INLINE_BYTES = 256 << 10
#: A frame whose stage took more CPU time than this (seconds) sends the rest
#: of the job through the serving thread: a slow stage must not sit on a reader.
INLINE_BUDGET = 0.01
#: Share of the stall timeout a reader may wait to write a result on before
#: the next rank is dropped as stalled.
INLINE_WRITE_SHARE = 0.5

T = TypeVar("T")


def _rank(route: Mapping[str, Any], key: str) -> int:
    value = route.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(f"pipeline job: stage.{key} must be a rank, got {value!r}")
    return value


@attrs.frozen
class StageRoute:
    """Which stage of which job a rank serves, where its activations come from
    (``prev``) and where its results go (``next``; 0 is the coordinator)."""

    job: Any
    prev: int
    next: int
    index: int | None = None
    stage_id: str | None = None

    @classmethod
    def from_job(cls, job: Mapping[str, Any]) -> StageRoute:
        """The route of a ``pipeline`` job message; a :class:`WireError` if malformed."""
        if job.get("kind") != "pipeline":
            raise WireError(f"expected a pipeline job, got kind {job.get('kind')!r}")
        route = job.get("stage")
        if not isinstance(route, Mapping):
            raise WireError("pipeline job carries no 'stage' object")
        prev, nxt = _rank(route, "prev"), _rank(route, "next")
        stage_id = route.get("stage_id")
        if stage_id is not None and not isinstance(stage_id, str):
            raise WireError(f"stage message: stage_id must be a string or null, got "
                            f"{stage_id!r}")
        return cls(job=job.get("job"), prev=prev, next=nxt, index=route.get("index"),
                   stage_id=stage_id)


def parse_job(group: Any, job: Mapping[str, Any], parse: Callable[[Mapping[str, Any]], T]) -> T:
    """``parse(job)``, telling rank 0 when the job cannot be parsed.

    Otherwise the coordinator waits for a ``ready`` that never comes until
    its timeout (e.g. a newer coordinator shipping an op this node lacks).
    The :class:`WireError` is raised again after it was reported.
    """
    try:
        return parse(job)
    except WireError as exc:
        report_job_error(group, job.get("job"), WireError(f"rank {group.rank}: {exc}"))
        raise



class _Outcome:
    """What serving one frame produced, for the serving thread to finish.

    ``ys`` are the results computed (``sent`` once written on), ``failure``
    why the stage stopped mid-frame, ``stopped`` the control's reason when it
    ended the frame early, ``send_error`` a failed inline write.
    """

    __slots__ = ("seq", "ys", "failure", "stopped", "sent", "send_error", "compact")

    def __init__(self, seq: int, ys: list[np.ndarray], failure: MeshError | None,
                 stopped: str | None, compact: bool = False) -> None:
        self.compact = compact
        self.seq = seq
        self.ys = ys
        self.failure = failure
        self.stopped = stopped
        self.sent = False
        self.send_error: PeerLostError | None = None


_STALE = object()


class _Relay:
    """One stage's side of the activation stream (see the module docstring)."""

    def __init__(self, group: Any, route: StageRoute, run: Callable[[np.ndarray], np.ndarray],
                 control: NodeControl, timeout: float) -> None:
        self.group = group
        self.prev = route.prev
        self.next = route.next
        self.job = route.job
        self.stage_id = route.stage_id
        self.run = run
        self.control = control
        self.timeout = timeout
        self.served = 0
        # The diverted feed (unused when the group cannot divert: it is
        # then read with recv_polling, as before). Under ``_lock``, which
        # ``_cv`` waits on: the backlog of payloads and outcomes the serving
        # thread has to take, whether the reader may serve inline
        # (``_armed``), whether it is doing so (``_busy``), and a count of
        # frames it served (activity, for the idle abort check). A plain
        # lock's enter and exit are C calls, a Condition's Python ones, and
        # the reader takes it twice per frame.
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._backlog: collections.deque[Any] = collections.deque()
        self._inline = bool(getattr(group, "inline_delivery", False))
        self._armed = False
        self._busy = False
        self._closed = False
        self._inline_frames = 0
        self._diverted = False
        self._draining = False
        self._act_prefix = f"act/{self.job}/"

    # -- the diverted feed --------------------------------------------------------------

    def open(self) -> None:
        """Divert this stage's activations to :meth:`_arrived` (before ``ready``)."""
        divert = getattr(self.group, "divert", None)
        if divert is None:
            return
        queued = divert(self.prev, TAG_ACT, self._arrived)
        self._diverted = True
        with self._lock:
            self._backlog.extend(queued)

    def close(self) -> None:
        """End the divert once the reader is out of the stage (its frame done)."""
        if not self._diverted:
            return
        with self._lock:
            self._closed = True
            self._armed = False
            while self._busy:
                self._cv.wait()
            left = len(self._backlog)
            self._backlog.clear()
        self.group.undivert(self.prev, TAG_ACT, self._arrived)
        if left:
            log.debug("rank %d: %d frame(s) of job %r left unserved", self.group.rank, left,
                      self.job)

    def _arrived(self, payload: Mapping[str, Any]) -> bool:
        """On the delivering thread: serve ``payload`` here if armed, else queue it."""
        with self._lock:
            if self._closed:
                return False  # the job is over: to the mailbox, as without a divert
            if not self._armed:
                self._backlog.append(payload)
                self._cv.notify()
                return True
            self._armed = False
            self._busy = True
        leftover: Any = None
        try:
            leftover = self._serve_inline(payload)
        except BaseException as exc:  # noqa: BLE001 (a bug: hand it to the serving thread)
            log.exception("rank %d: serving an activation inline failed", self.group.rank)
            leftover = _Outcome(0, [], MeshError(f"rank {self.group.rank}: {exc}"), None)
        finally:
            with self._lock:
                self._busy = False
                self._inline_frames += 1
                if leftover is not None:
                    self._backlog.append(leftover)
                # Armed again only when the serving thread has nothing to do:
                # else it is woken to take over.
                if leftover is None and self._inline and not self._closed \
                        and self.control.reason() is None:
                    self._armed = True
                else:
                    self._cv.notify_all()
        return True

    def _serve_inline(self, payload: Mapping[str, Any]) -> Any:
        """Serve one frame on the reader; None when done, else what the serving thread takes."""
        if self.control.reason() is not None:
            return payload
        try:
            item = self._parse(payload)
        except WireError:
            return payload
        if item is None or item is _STALE:
            return payload
        seq, batch, compact = item
        # CPU time, not wall time: a reader preempted on a busy machine is
        # not a slow stage. (Control was checked above, before the first row.)
        started = time.thread_time()
        outcome = self.compute(seq, batch, compact)
        if time.thread_time() - started > INLINE_BUDGET:
            self._inline = False  # the rest of this job goes through the serving thread
        ys = outcome.ys
        if outcome.failure is not None or outcome.stopped is not None or not ys \
                or (ys[0].nbytes if len(ys) == 1 else sum(y.nbytes for y in ys)) \
                > INLINE_BYTES:
            return outcome
        deadline = time.monotonic() + INLINE_WRITE_SHARE * self.group.timeout
        try:
            self.forward_all(outcome, deadline)
        except PeerLostError as exc:
            outcome.send_error = exc
            return outcome
        self.served += len(outcome.ys)
        return None

    def _take(self) -> Any:
        """Serving thread: the next payload or outcome; None on a stop (or spent budget).

        While nothing is queued the reader is armed to serve inline and this
        thread parks, waking every :data:`POLL_INTERVAL` to look at the stop
        handle; after a whole poll in which nothing arrived at all it checks
        for an abort (None), a lost ``prev`` or coordinator, or a closed
        group (``PeerLostError``, once everything they sent was taken), and
        ``timeout``. While draining, the reader is not armed and only the
        stop handle ends the wait early.
        """
        deadline = time.monotonic() + self.timeout
        while True:
            with self._lock:
                seen = self._inline_frames
                waited = False
                while True:
                    if not self._busy:
                        # What the reader computed is always finished (sent on);
                        # a frame not yet served waits while stopped or spent.
                        if self._backlog and isinstance(self._backlog[0], _Outcome):
                            self._armed = False
                            return self._backlog.popleft()
                        if self.control.stopped or (
                                not self._draining and self.control.reason() is not None):
                            self._armed = False
                            return None
                        if self._backlog:
                            self._armed = False
                            return self._backlog.popleft()
                        if self._inline and not self._draining and not self._closed:
                            self._armed = True
                        if waited and self._inline_frames == seen:
                            break  # a whole poll and nothing arrived
                        if time.monotonic() >= deadline:
                            break
                    if self._inline_frames != seen:
                        # The reader served frames meanwhile: ``timeout`` bounds
                        # a wait with nothing arriving, not the whole job.
                        seen = self._inline_frames
                        deadline = time.monotonic() + self.timeout
                    left = deadline - time.monotonic()
                    self._cv.wait(min(POLL_INTERVAL, left) if left > 0 else POLL_INTERVAL)
                    waited = True
                self._armed = False
            # Idle: nothing was served here or inline for a whole poll.
            if self.aborted():
                return None
            closed = bool(getattr(self.group, "closed", False))
            dead = self.group.dead
            if closed or self.prev in dead or 0 in dead:
                with self._lock:
                    if self._backlog:
                        continue  # what it sent before it went is served first
                why = ("the group was closed" if closed
                       else dead.get(self.prev) or dead.get(0))
                raise PeerLostError(f"rank {self.group.rank}: waiting for activations from "
                                    f"rank {self.prev}: {why}")
            if time.monotonic() >= deadline:
                raise PeerLostError(
                    f"rank {self.group.rank}: nothing from rank {self.prev} within "
                    f"{self.timeout:g} s")

    # -- what the serving thread and the reader share -----------------------------------

    def _parse(self, msg: Mapping[str, Any]) -> Any:
        """``(seq, x, compact)``, None at this job's end, or ``_STALE``; ``WireError`` if malformed.

        ``compact``: the frame came as ``{"act/<job>/<seq>": x}`` (one entry,
        no JSON leaf to encode and decode on every hop) and its results go on
        in that form; ``{"act": [job, seq], "x": x}`` frames get results in theirs.
        """
        if "end" in msg:
            return None if msg["end"] == self.job else _STALE  # else an older, aborted job's
        if len(msg) == 1:
            ((key, x),) = msg.items()
            if key.startswith(self._act_prefix) and isinstance(x, np.ndarray) and x.ndim == 2:
                seq = key[len(self._act_prefix):]
                if seq.isdigit():
                    return int(seq), x, True
            if key.startswith("act/") and key.count("/") == 2:
                log.debug("rank %d: dropping a stale activation (%s)", self.group.rank, key)
                return _STALE
        head = msg.get("act")
        x = msg.get("x")
        if not (isinstance(head, list) and len(head) == 2 and isinstance(head[1], int)
                and isinstance(x, np.ndarray) and x.ndim == 2):
            raise WireError(
                f"rank {self.group.rank}: malformed activation from rank {self.prev} "
                f"(expected 'act': [job, seq] and a 2-D array 'x' of rows)")
        if head[0] != self.job:
            log.debug("rank %d: dropping a stale activation of job %r", self.group.rank,
                      head[0])
            return _STALE
        return head[1], x, False

    def compute(self, seq: int, batch: np.ndarray, compact: bool = False, *,
                first: bool = False) -> _Outcome:
        """Run each row of ``batch`` through the stage, checking control between rows.

        A frame may carry several activations (rows); each is one step, so a
        budget or a stop lands on an exact activation even inside a batch.
        ``first``: control is checked before the first row too.
        """
        ys: list[np.ndarray] = []
        control = self.control
        for row in batch:
            if ys or first:
                stopped = control.reason()
                if stopped is not None:
                    return _Outcome(seq, ys, None, stopped, compact)
            try:
                ys.append(self.run(row))
            except MeshError as exc:
                return _Outcome(seq, ys, exc, None, compact)
            except Exception as exc:  # noqa: BLE001 (a user function or driver broke: report it)
                stage = f" [{self.stage_id}]" if self.stage_id else ""
                return _Outcome(seq, ys, MeshError(
                    f"stage{stage} on rank {self.group.rank} failed: "
                    f"{type(exc).__name__}: {sendable(exc)}"), None, compact)
            control.count()
        return _Outcome(seq, ys, None, None, compact)

    def forward_all(self, outcome: _Outcome, deadline: float | None = None) -> None:
        first = outcome.seq
        if len(outcome.ys) == 1:  # the common case: one row, sent as a (1, n) view
            self.forward(first, outcome.ys[0].reshape(1, -1), deadline, compact=outcome.compact)
            outcome.sent = True
            return
        for part in _stack(outcome.ys):
            self.forward(first, part, deadline, compact=outcome.compact)
            first += part.shape[0]
        outcome.sent = True

    # -- the serving thread ---------------------------------------------------------------

    def next_item(self) -> tuple[int, np.ndarray] | _Outcome | None:
        """The next activation of this job, a frame the reader served in part, or None.

        None at ``end`` (or a stop while idle, or an abort).
        """
        while True:
            if self._diverted:
                msg = self._take()
            else:
                msg = recv_polling(self.group, self.prev, TAG_ACT, self.control,
                                   self.timeout, self.aborted)
            if msg is None or isinstance(msg, _Outcome):
                return msg
            item = self._parse(msg)
            if item is _STALE:
                continue
            return item

    def aborted(self) -> bool:
        """Whether rank 0 abandoned this job (checked only while idle)."""
        while True:
            try:
                msg = self.group.recv(0, TAG_ABORT, timeout=0)
            except PeerLostError:
                return False
            if msg.get("job") == self.job:
                log.info("rank %d: job %r aborted by the coordinator", self.group.rank,
                         self.job)
                return True

    def forward(self, seq: int, y: np.ndarray, deadline: float | None = None, *,
                compact: bool = False) -> None:
        # Every entry costs an encode and a decode on every hop, and these
        # frames are the pipeline's hot path: the compact form has one.
        kind = "act" if self.next != 0 else "result"
        msg = {f"{kind}/{self.job}/{seq}": y} if compact else {kind: [self.job, seq], "x": y}
        tag = TAG_ACT if self.next != 0 else TAG_UP
        if deadline is None:
            self.group.send(self.next, tag, msg)
        else:
            self.group.send(self.next, tag, msg, deadline=deadline)

    def forward_end(self) -> None:
        end = {"end": self.job}
        if self.next != 0:
            try:
                self.group.send(self.next, TAG_ACT, end)
            except PeerLostError as exc:
                log.warning("rank %d: could not pass the end of job %r on to rank %d: %s",
                            self.group.rank, self.job, self.next, exc)

    def drain(self) -> None:
        """After a failure: swallow this job's activations until its end arrives."""
        self._draining = True
        try:
            while self.next_item() is not None:
                pass
        except (PeerLostError, WireError):
            pass


def _stack(ys: list[np.ndarray]) -> list[np.ndarray]:
    """Rows of equal length travel as one (k, n) frame; otherwise one frame each."""
    if len(ys) == 1:
        return [ys[0].reshape(1, -1)]  # a view: no copy for the common single row
    if len({y.size for y in ys}) == 1:
        return [np.stack(ys)]
    return [y.reshape(1, -1) for y in ys]


def serve_stage(group: Any, route: StageRoute, run: Callable[[np.ndarray], np.ndarray], *,
                control: NodeControl, timeout: float = float("inf"),
                role: str = NodeRole.WORKER, device: str = "cpu") -> NodeReport:
    """Serve one pipeline stage computing ``run(x)``; returns its :class:`NodeReport`.

    Announces ``ready`` to rank 0, then runs every activation arriving from
    ``route.prev`` through ``run`` and passes the result on to ``route.next``
    until the job's ``end``, the stop handle or the step budget. An error
    (``run`` raising, a malformed frame, a next stage that died) is reported
    to rank 0; the job is then drained to its ``end``, so this stage still
    reports and the ones after it are released. ``timeout`` bounds each wait
    for an activation; ``role`` and ``device`` go into the report. Where the
    transport allows it, activations are served on the thread that read
    them (see the module docstring); what this promises is the same.
    """
    loop = _Relay(group, route, run, control, timeout)
    loop.open()
    started = time.monotonic()
    stopped: str | None = None
    failure: MeshError | None = None
    try:
        send_up(group, {"kind": "ready", "job": loop.job})
        while failure is None:
            stopped = control.reason()
            if stopped is not None:
                break
            try:
                item = loop.next_item()
            except WireError as exc:
                # A malformed frame: report it and unwind like a failed stage, so
                # rank 0 hears why and this stage still reports at the job's end.
                failure = exc
                report_job_error(group, loop.job, failure)
                loop.drain()
                break
            if item is None:
                stopped = control.reason()  # None: the job's end arrived
                break
            outcome = item if isinstance(item, _Outcome) else loop.compute(*item)
            failure, stopped = outcome.failure, outcome.stopped
            if outcome.ys and not outcome.sent:
                error = outcome.send_error
                if error is None:
                    try:
                        loop.forward_all(outcome)
                    except PeerLostError as exc:
                        error = exc
                if error is not None:
                    if loop.next == 0:
                        raise error  # the coordinator itself is gone: serve_node decides
                    # The next stage died (a mesh send to a dead rank fails at
                    # once): a failure of this job, not of this node, which
                    # reports it, drains and serves the next job.
                    if failure is None:
                        failure = PeerLostError(f"rank {group.rank} could not pass "
                                                f"activations on to rank {loop.next}: {error}")
                loop.served += len(outcome.ys)
            if failure is not None:
                report_job_error(group, loop.job, failure)
                loop.drain()
            elif stopped is not None:
                break
    finally:
        loop.close()
    report = NodeReport(rank=group.rank, role=role, stage_id=route.stage_id, job=loop.job,
                        activations=loop.served, stopped="error" if failure else stopped,
                        error=None if failure is None else str(failure),
                        seconds=time.monotonic() - started, device=device)
    # Pass the end on in every case: after a normal end, an error (we drained
    # to it) or a stop (we are leaving mid-job), the stages after us finish
    # cleanly and report, and the coordinator unwinds the rest.
    loop.forward_end()
    return report
