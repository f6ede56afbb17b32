"""The node driver: what a node is, how it is bounded, and how it serves jobs.

A node joins a mesh with :meth:`meshkit.NodeConfig.connect`, announces what
it is (:class:`NodeCaps`) to the coordinator, then serves the jobs rank 0
sends it until told to shut down (:func:`serve_node`, one
:data:`JobHandler` per job kind). Nothing here prints: every loop returns a
report (:class:`NodeReport`, :class:`TrainReport`), because a node embedded
in an app or a board's host shim has no stdout anyone reads.

Where each idea lives:

* ``config.py`` — :class:`NodeConfig`, how a node joins (with environment parity);
* ``_caps.py`` — :class:`NodeCaps`, :func:`local_caps` and the capability handshake;
* ``_control.py`` — :class:`NodeControl`: the step budget and the stop handle;
* ``_devices.py`` — which devices a node has (torch asked only when wanted);
* ``_reports.py`` — :class:`NodeReport`, :class:`TrainReport`;
* ``_jobs.py`` — the messages between coordinator and node, and their tags
  (the protocol is documented there);
* ``_serve.py`` — :func:`serve_node`, the job loop, and a board's pipeline job;
* ``_activations.py`` — :func:`serve_stage`, the activation loop of one stage (the hot path);
* ``_activation.py`` — what counts as an activation;
* ``board.py`` — boards: :class:`FixedFunction`, the driver deadline, and
  where a board's input and output lengths are checked.
"""

from __future__ import annotations

from meshkit.node._activation import as_activation
from meshkit.node._caps import (
    NodeCaps,
    NodeRole,
    collect_caps,
    local_caps,
    platform_tag,
    receive_caps,
    send_caps,
)
from meshkit.node._control import NodeControl
from meshkit.node._devices import check_device, device_matches, present_devices, task_device
from meshkit.node._jobs import (
    TAG_ABORT,
    TAG_ACT,
    TAG_JOB,
    TAG_UP,
    recv_job,
    report_job_error,
    send_job,
    send_up,
    refuse_node,
    shutdown_nodes,
)
from meshkit.node._activations import StageRoute, parse_job, serve_stage
from meshkit.node._reports import NodeReport, TrainReport, report_from_json, sendable
from meshkit.node._serve import JobHandler, serve_fixed_function, serve_node
from meshkit.node.board import (
    Board,
    DeadlineBoard,
    FixedFunction,
    check_board,
    execute_checked,
    open_board,
)
from meshkit.node.config import NodeConfig, caps_for
from meshkit.transport import TAG_CAPS

__all__ = [
    "present_devices",
    "check_device",
    "device_matches",
    "task_device",
    "TAG_CAPS",
    "TAG_JOB",
    "TAG_UP",
    "TAG_ACT",
    "TAG_ABORT",
    "NodeConfig",
    "NodeRole",
    "NodeCaps",
    "NodeControl",
    "NodeReport",
    "TrainReport",
    "FixedFunction",
    "Board",
    "DeadlineBoard",
    "JobHandler",
    "StageRoute",
    "platform_tag",
    "local_caps",
    "caps_for",
    "send_caps",
    "collect_caps",
    "receive_caps",
    "send_job",
    "recv_job",
    "send_up",
    "report_job_error",
    "report_from_json",
    "refuse_node",
    "shutdown_nodes",
    "parse_job",
    "serve_stage",
    "serve_fixed_function",
    "serve_node",
    "as_activation",
    "check_board",
    "execute_checked",
    "open_board",
    "sendable",
]
