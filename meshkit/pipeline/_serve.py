"""A worker's side of a pipeline job: run the shipped :class:`Stage` on the relay.

:func:`serve_pipeline_job` is the ``"pipeline"`` :data:`~meshkit.node.JobHandler`
a worker's :func:`~meshkit.node.serve_node` is given: it rebuilds the stage
from the job message (refusing one it cannot parse, or a board stage that
reached a worker) and serves it with :func:`~meshkit.node.serve_stage`.
A fixed-function rank serves its pipeline jobs on its board instead
(:func:`~meshkit.node.serve_fixed_function`).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from meshkit.errors import PlacementError, WireError
from meshkit.node import (
    NodeCaps,
    NodeControl,
    NodeReport,
    NodeRole,
    StageRoute,
    parse_job,
    recv_job,
    report_job_error,
    serve_stage,
)
from meshkit.pipeline._stages import Stage

__all__ = ["serve_worker", "serve_pipeline_job"]

log = logging.getLogger(__name__)


def _stage_and_route(job: Mapping[str, Any]) -> tuple[Stage, StageRoute]:
    route = StageRoute.from_job(job)
    return Stage.from_message(job), route


def serve_worker(group: Any, job: Mapping[str, Any] | None = None, *,
                 control: NodeControl | None = None, device: str = "cpu",
                 timeout: float = float("inf")) -> NodeReport:
    """Serve one pipeline stage as a general worker; returns a :class:`NodeReport`.

    ``job`` is the pipeline job message (received from rank 0 when None).
    Activations come from ``stage.prev`` and go to ``stage.next`` until the
    job's ``end``, the stop handle, or the step budget. A stage that fails
    reports an ``error`` to rank 0 instead of hanging the pipeline; a job
    this worker refuses is reported to rank 0 and raised
    (:class:`WireError` or :class:`PlacementError`).
    """
    control = control if control is not None else NodeControl()
    if job is None:
        job = recv_job(group, control=control)
        if job is None:
            return NodeReport(rank=group.rank, stopped=control.reason(), device=device)
    stage, route = parse_job(group, job, _stage_and_route)
    if stage.op is None:
        # A board-only stage reached a worker: placement was bypassed.
        refusal = PlacementError(
            f"rank {group.rank} is a worker and stage [{stage.stage_id}] runs only on "
            f"fixed-function hardware implementing it")
        report_job_error(group, route.job, refusal)
        raise refusal
    return serve_stage(group, route, stage.run, control=control, timeout=timeout,
                       role=NodeRole.WORKER, device=device)


def serve_pipeline_job(group: Any, caps: NodeCaps, job: Mapping[str, Any],
                       control: NodeControl) -> NodeReport | None:
    """The ``"pipeline"`` job handler of a worker: :func:`serve_worker` on ``caps.device``.

    Returns None when the job was refused (rank 0 has been told why), so
    the node serves the next job.
    """
    try:
        return serve_worker(group, job, control=control, device=caps.device)
    except (PlacementError, WireError) as exc:
        log.warning("rank %d: job %r refused: %s", group.rank, job.get("job"), exc)
        return None
