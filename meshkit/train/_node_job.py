"""The node's ``"train"`` job: a worker rank serves one training spec.

:func:`serve_train_job` is the ``"train"`` :data:`~meshkit.node.JobHandler`
given to :func:`~meshkit.node.serve_node`. A rank that cannot train (a
fixed-function rank: :meth:`~meshkit.NodeCaps.why_not_train` says why)
refuses upstream; any other runs
:func:`meshkit.train.serve_trainer` on the job's ``spec``, with the device
its task runs on (:func:`meshkit.node.task_device`: the node's ``--device``,
else the run's required device, else ``auto``).
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from meshkit.errors import MeshError, PlacementError
from meshkit.node import NodeCaps, NodeControl, TrainReport, report_job_error, task_device
from meshkit.train._worker import serve_trainer

__all__ = ["serve_train_job"]


def serve_train_job(group: Any, caps: NodeCaps, job: Mapping[str, Any],
                    control: NodeControl) -> TrainReport | None:
    """Serve a ``train`` job; None when it was refused (rank 0 has been told why)."""
    job_id = job.get("job")
    why = caps.why_not_train()
    if why is not None:
        report_job_error(group, job_id, PlacementError(why))
        return None
    try:
        spec = job.get("spec") or {}
        device = task_device(caps.device, str(spec.get("device") or ""), caps.devices)
        report = serve_trainer(group, spec, control, device=device)
    except MeshError as exc:
        report_job_error(group, job_id, exc)
        return None
    if report.job is None and job_id is not None:
        report = attrs.evolve(report, job=job_id)
    return report
