"""A node's whole life after ``connect``: announce caps, serve jobs, leave.

:func:`serve_node` is the one job loop: it receives each job rank 0 sends
and hands it to the :data:`JobHandler` registered for its ``kind``. The
loop itself decides only what every kind shares: ``shutdown``, a kind no
handler serves (an error sent upstream), the stop handle and step budget,
and a coordinator that went away. What a job kind does is its handler's
business, so the node layer never imports the layers that define jobs
(``meshkit.pipeline`` serves ``"pipeline"`` jobs, ``meshkit.train``
``"train"`` jobs). The one exception is a board: a fixed-function rank runs
only the stage its hardware implements, which needs no
:class:`~meshkit.pipeline.Stage`, so its pipeline jobs are served here
(:func:`serve_fixed_function`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Mapping

from meshkit.errors import ConfigError, PeerLostError, PlacementError, WireError
from meshkit.node._caps import NodeCaps, NodeRole, send_caps
from meshkit.node._control import NodeControl
from meshkit.node._jobs import recv_job, report_job_error, send_up
from meshkit.node._activations import StageRoute, parse_job, serve_stage
from meshkit.node._reports import NodeReport, TrainReport
from meshkit.node.board import FixedFunction, check_board, execute_checked

__all__ = ["JobHandler", "serve_node", "serve_fixed_function"]

log = logging.getLogger(__name__)

#: How a node ends whose coordinator went away without ending the run.
LOST = "coordinator lost"

#: Serves one job of a kind: ``handler(group, caps, job, control)``, where
#: ``job`` is the job message (see :mod:`meshkit.node`). Returns the job's
#: report, which :func:`serve_node` sends to rank 0, or None when the
#: handler refused the job and already said why upstream
#: (:func:`~meshkit.node.report_job_error`). An exception it raises ends
#: :func:`serve_node` (a lost coordinator excepted: the node leaves).
JobHandler = Callable[[Any, NodeCaps, Mapping[str, Any], NodeControl],
                      NodeReport | TrainReport | None]


def serve_fixed_function(group: Any, board: Any, job: Mapping[str, Any] | None = None, *,
                         advertised: FixedFunction | None = None,
                         control: NodeControl | None = None,
                         timeout: float = float("inf")) -> NodeReport:
    """Serve the one stage a board implements; returns a :class:`NodeReport`.

    Checks first that the board implements the stage this rank advertises
    (``advertised``, the board's own descriptor when None) and that the job
    is that stage; then every activation goes through
    :func:`~meshkit.node.board.execute_checked`, so a mismatched feed is
    refused rather than clocked into the fabric (and a wrong-sized result
    never travels on). ``board`` should be a
    :class:`meshkit.node.board.DeadlineBoard` so a hung board is an error,
    not a hang.
    """
    control = control if control is not None else NodeControl()
    ff: FixedFunction = board.descriptor
    if advertised is not None:
        check_board(board, advertised)
    if job is None:
        job = recv_job(group, control=control)
        if job is None:
            return NodeReport(rank=group.rank, role=NodeRole.FIXED_FUNCTION,
                              stage_id=ff.stage_id, stopped=control.reason(), device="fpga")
    route = parse_job(group, job, StageRoute.from_job)
    try:
        ff.check(route.stage_id)
    except PlacementError as exc:
        refusal = PlacementError(f"rank {group.rank}: {exc}")
        report_job_error(group, route.job, refusal)
        raise refusal from None
    return serve_stage(group, route, functools.partial(execute_checked, board),
                       control=control, timeout=timeout, role=NodeRole.FIXED_FUNCTION,
                       device="fpga")


def _serve_board_job(board: Any, group: Any, caps: NodeCaps, job: Mapping[str, Any],
                     control: NodeControl) -> NodeReport | None:
    try:
        return serve_fixed_function(group, board, job, control=control)
    except (PlacementError, WireError) as exc:
        # Already reported to rank 0 where it could be; keep serving jobs.
        log.warning("rank %d: job %r refused: %s", group.rank, job.get("job"), exc)
        return None


def _coordinator_gone(group: Any, exc: PeerLostError, during: str) -> bool:
    if 0 not in group.dead:
        return False
    log.info("rank %d: the coordinator went away%s (%s); leaving", group.rank, during, exc)
    return True


def _after_loss(group: Any) -> str:
    """How serving ended when the coordinator is gone: did it end the run first?

    A coordinator ending the run sends ``shutdown`` and closes at once, so
    the report a node sends after its last job may find it gone: a
    ``shutdown`` already received still means the run finished.
    """
    try:
        job = recv_job(group, timeout=0.05)
    except (PeerLostError, WireError):
        return LOST
    return "shutdown" if job is not None and job.get("kind") == "shutdown" else LOST


def serve_node(group: Any, caps: NodeCaps, *, jobs: Mapping[str, JobHandler],
               board: Any = None, control: NodeControl | None = None,
               send_handshake: bool = True,
               job_timeout: float = float("inf")) -> list[NodeReport | TrainReport]:
    """A node's whole life after ``connect``: announce caps, serve jobs, leave.

    Sends ``caps`` to rank 0, then hands each job rank 0 sends (see
    :mod:`meshkit.node`) to ``jobs[kind]`` until ``shutdown``, the stop
    handle, the step budget, or a lost coordinator. A kind ``jobs`` does not
    name is reported to rank 0 as an error, and the node serves on. Each
    job's report is sent to rank 0 and returned in the list; how serving
    ended is left in ``control.ended`` (``"shutdown"`` when the coordinator
    ended the run, ``"coordinator lost"`` when it went away, ``"refused"``
    with the reason in ``control.refusal``, else the stop
    handle's or budget's reason). ``board`` is
    required when ``caps`` is a fixed-function rank's (and must implement
    the advertised stage); that rank's ``pipeline`` jobs then run on the
    board, whatever ``jobs`` says, since the board is the only stage it has.
    """
    control = control if control is not None else NodeControl()
    handlers = dict(jobs)
    if caps.fixed_function is not None:
        if board is None:
            raise ConfigError(
                f"rank {caps.rank} advertises stage [{caps.fixed_function.stage_id}] but no "
                f"board was given to run it")
        check_board(board, caps.fixed_function)
        handlers["pipeline"] = functools.partial(_serve_board_job, board)
    if send_handshake:
        send_caps(group, caps)
    reports: list[NodeReport | TrainReport] = []
    control.ended = None
    while not control.stopped:
        try:
            job = recv_job(group, control=control, timeout=job_timeout)
        except PeerLostError as exc:
            if _coordinator_gone(group, exc, ""):
                control.ended = LOST
                break
            raise
        if job is None:
            break
        kind = job["kind"]
        if kind == "shutdown":
            control.ended = "shutdown"
            break
        if kind == "refused":
            control.ended = "refused"
            control.refusal = str(job.get("message", ""))
            log.warning("rank %d: refused by the coordinator: %s", group.rank, control.refusal)
            break
        job_id = job.get("job")
        handler = handlers.get(kind)
        if handler is None:
            report_job_error(group, job_id, WireError(
                f"rank {group.rank} does not know job kind {kind!r}"))
            continue
        try:
            report = handler(group, caps, job, control)
        except PeerLostError as exc:
            if _coordinator_gone(group, exc, f" during job {job_id!r}"):
                control.ended = LOST
                break
            raise
        if report is None:
            if 0 in group.dead:
                control.ended = _after_loss(group)
                break
            continue
        reports.append(report)
        leaving = report.stopped in ("stop", "budget")
        try:
            send_up(group, {"kind": "left" if leaving else "report", "job": job_id,
                            "report": report.to_json()})
        except PeerLostError:
            control.ended = _after_loss(group)
            break
        if leaving or control.reason() is not None:
            break
    if control.ended is None:
        control.ended = control.reason() or (LOST if 0 in group.dead else "stop")
    return reports
