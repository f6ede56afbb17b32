"""The node's ``"train"`` job: a worker rank serves one training spec.

Rule: where a node's data comes from is decided here, and only here. Its
own files: the node's ``--task-option`` values (``train_csv=...``,
``data=DIR``) replace the coordinator's ``[task]`` values in the spec
(:func:`with_node_options`), and the task built from them reads the files
the first time a method needs them. A ``--pull-data`` node: the set the
coordinator sent with the job becomes the spec's ``data``
(:func:`node_data`), which the trainer uses instead of the task's. The
trainer (:mod:`meshkit.train._worker.trainer`) only builds what the spec says.

:func:`serve_train_job` is the ``"train"`` :data:`~meshkit.node.JobHandler`
given to :func:`~meshkit.node.serve_node`. A rank that cannot train (a
fixed-function rank: :meth:`~meshkit.NodeCaps.why_not_train` says why)
refuses upstream; any other runs
:func:`meshkit.train.serve_trainer` on the job's ``spec``, with the device
its task runs on (:func:`meshkit.node.task_device`: the node's ``--device``,
else the run's required device, else ``auto``). The node's own task options
(``meshkit node --task-option KEY=VALUE``) override the coordinator's
``[task]`` values here, on this node only (:func:`with_node_options`), typed
and validated against the task's options class once the job says which task
it is. A node started with ``--attack NAME`` (``--attack-option
KEY=VALUE``) poisons its own fits (:func:`node_attack` validates the
attack when the node starts; the trainer applies it and says so in each
reply, so the coordinator records it in ``attacked``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs

from meshkit import plugins
from meshkit.attack import is_omniscient
from meshkit.errors import ConfigError, MeshError, PlacementError, RefusedError
from meshkit.node import NodeCaps, NodeControl, TrainReport, report_job_error, task_device
from meshkit.options import parse_options, structure_options
from meshkit.task import resolve_task_component
from meshkit.train._worker.trainer import serve_trainer

__all__ = ["serve_train_job", "with_node_options", "node_data", "node_attack"]


def node_attack(name: str, pairs: Sequence[str]) -> dict[str, Any]:
    """``meshkit node --attack NAME --attack-option K=V``: the attack spec, checked now.

    The attack is built once here (an unknown name or option is refused
    before the node joins). An omniscient attack is refused: on a real node
    it would need the other clients' contributions, which only a
    simulating coordinator holds.
    """
    pset = plugins.default()
    component = pset.registry.get("attack", name)
    options = parse_options(pairs, component.options, flag="--attack-option",
                            table="--attack-option")
    attack = pset.create("attack", name, options)
    if is_omniscient(attack):
        raise RefusedError(
            f"--attack {name}: {name} is omniscient (it reads the round's honest "
            f"contributions), which a node cannot see; only a simulation's coordinator holds "
            f"them. Use [attack] name = \"{name}\" in the run's config, or a node attack that "
            f"needs only its own update (sign-flip, scale, gaussian, same-value, label-flip)")
    return {"name": name, "options": options}


def node_data(job: Mapping[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with the training set the coordinator sent a ``--pull-data`` node (the
    job's ``data.x``/``data.y``) as its ``data``; unchanged for a node with its own."""
    if "data.x" in job:
        spec["data"] = {"x": job["data.x"], "y": job["data.y"]}
    return spec


def with_node_options(spec: Mapping[str, Any], pairs: Sequence[str]) -> dict[str, Any]:
    """``spec`` with this node's ``KEY=VALUE`` task options over the coordinator's ``[task]``.

    Each value is typed by the task's options class and each key checked
    against it, so a misspelt key is refused naming ``--task-option`` (with
    the closest known key) rather than the coordinator's ``[task]`` table.
    """
    spec = dict(spec)
    if not pairs:
        return spec
    component = resolve_task_component(str(spec["task"]))
    if component.options is None:
        raise ConfigError(f"--task-option: task {spec['task']!r} takes no options")
    typed = parse_options(pairs, component.options, flag="--task-option",
                          table="--task-option")
    structure_options(component, typed, where="--task-option")  # unknown key, bad value
    spec["task_options"] = {**dict(spec.get("task_options") or {}), **typed}
    return spec


def serve_train_job(group: Any, caps: NodeCaps, job: Mapping[str, Any],
                    control: NodeControl, *, task_options: Sequence[str] = (),
                    attack: Mapping[str, Any] | None = None,
                    signing: Any = None) -> TrainReport | None:
    """Serve a ``train`` job; None when it was refused (rank 0 has been told why).

    ``task_options`` are this node's ``--task-option KEY=VALUE`` strings; one
    the task does not accept is told to rank 0 and raised (the node exits 2).
    ``attack`` is :func:`node_attack`'s spec (``--attack``), or None.
    ``signing`` is this node's part in signed secure rounds
    (:class:`~meshkit.train._worker.secure.Signing`: ``--key``, ``--roster``), or None.
    """
    job_id = job.get("job")
    why = caps.why_not_train()
    if why is not None:
        report_job_error(group, job_id, PlacementError(why))
        return None
    try:
        spec = node_data(job, with_node_options(job.get("spec") or {}, task_options))
        if attack is not None:  # --attack: this node poisons its own fits
            spec["node_attack"] = dict(attack)
    except ConfigError as exc:
        report_job_error(group, job_id, ConfigError(f"rank {group.rank}: {exc}"))
        raise
    try:
        device = task_device(caps.device, str(spec.get("device") or ""), caps.devices)
        report = serve_trainer(group, spec, control, device=device, signing=signing)
    except MeshError as exc:
        report_job_error(group, job_id, exc)
        return None
    if report.job is None and job_id is not None:
        report = attrs.evolve(report, job=job_id)
    return report
