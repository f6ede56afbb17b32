"""The activation relay: how a node serves one pipeline stage (the hot path).

A stage takes activations from the rank before it, runs each through its
function and passes the result to the rank after it, until the job's
``end`` arrives, the stop handle is raised or the step budget is spent
(:func:`serve_stage`). Whatever the stage computes — a :class:`Stage` on a
worker, a board on a fixed-function rank — the relay is this one loop, so a
failure anywhere is reported to rank 0, the job drained to its ``end`` and
the ``end`` passed on, and the pipeline unwinds instead of hanging.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, TypeVar

import attrs
import numpy as np

from meshkit.errors import MeshError, PeerLostError, WireError
from meshkit.node._caps import NodeRole
from meshkit.node._control import NodeControl, recv_polling
from meshkit.node._jobs import TAG_ABORT, TAG_ACT, report_job_error, send_up
from meshkit.node._reports import NodeReport

__all__ = ["StageRoute", "parse_job", "serve_stage"]

log = logging.getLogger(__name__)

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


class _Relay:
    """One stage's side of the activation stream."""

    def __init__(self, group: Any, route: StageRoute, control: NodeControl,
                 timeout: float) -> None:
        self.group = group
        self.prev = route.prev
        self.next = route.next
        self.job = route.job
        self.control = control
        self.timeout = timeout

    def next_activation(self) -> tuple[int, np.ndarray] | None:
        """The next activation of this job, or None at ``end`` (or a stop while idle)."""
        while True:
            msg = recv_polling(self.group, self.prev, TAG_ACT, self.control, self.timeout,
                               self.aborted)
            if msg is None:
                return None
            if "end" in msg:
                if msg["end"] != self.job:
                    continue  # the end of an older, aborted job
                return None
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
                continue
            return head[1], x

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

    def forward(self, seq: int, y: np.ndarray) -> None:
        # One JSON leaf per frame: every leaf costs an encode and a decode on
        # every hop, and these frames are the pipeline's hot path.
        msg = {"act" if self.next != 0 else "result": [self.job, seq], "x": y}
        if self.next == 0:
            send_up(self.group, msg)
        else:
            self.group.send(self.next, TAG_ACT, msg)

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
        try:
            while self.next_activation() is not None:
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
    for an activation; ``role`` and ``device`` go into the report.
    """
    loop = _Relay(group, route, control, timeout)
    send_up(group, {"kind": "ready", "job": loop.job})
    started = time.monotonic()
    served = 0
    stopped: str | None = None
    failure: MeshError | None = None
    while failure is None:
        stopped = control.reason()
        if stopped is not None:
            break
        try:
            item = loop.next_activation()
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
        seq, batch = item
        # A frame may carry several activations (rows); each is one step, and
        # control is checked between them, so a budget or a stop lands on an
        # exact activation even inside a batch.
        ys: list[np.ndarray] = []
        for row in batch:
            if ys:
                stopped = control.reason()
                if stopped is not None:
                    break
            try:
                ys.append(run(row))
            except MeshError as exc:
                failure = exc
                break
            except Exception as exc:  # noqa: BLE001 (a user function or driver broke: report it)
                stage = f" [{route.stage_id}]" if route.stage_id else ""
                failure = MeshError(f"stage{stage} on rank {group.rank} failed: "
                                    f"{type(exc).__name__}: {exc}")
                break
            control.count()
        if ys:
            first = seq
            try:
                for part in _stack(ys):
                    loop.forward(first, part)
                    first += part.shape[0]
            except PeerLostError as exc:
                if loop.next == 0:
                    raise  # the coordinator itself is gone: serve_node decides
                # The next stage died (a mesh send to a dead rank fails at
                # once): a failure of this job, not of this node, which
                # reports it, drains and serves the next job.
                if failure is None:
                    failure = PeerLostError(f"rank {group.rank} could not pass activations "
                                            f"on to rank {loop.next}: {exc}")
            served += len(ys)
        if failure is not None:
            report_job_error(group, loop.job, failure)
            loop.drain()
        elif stopped is not None:
            break
    report = NodeReport(rank=group.rank, role=role, stage_id=route.stage_id, job=loop.job,
                        activations=served, stopped="error" if failure else stopped,
                        error=None if failure is None else str(failure),
                        seconds=time.monotonic() - started, device=device)
    # Pass the end on in every case: after a normal end, an error (we drained
    # to it) or a stop (we are leaving mid-job), the stages after us finish
    # cleanly and report, and the coordinator unwinds the rest.
    loop.forward_end()
    return report
