"""The messages between the coordinator and its nodes, and the tags they travel on.

Every message is a state (JSON values plus named numpy arrays). All tags are
in the kernel's reserved range (see :mod:`meshkit.transport`).

``TAG_CAPS`` (worker -> rank 0, once, before any work moves)
    ``{"caps": NodeCaps.to_json()}`` (:func:`~meshkit.node.send_caps`). The
    coordinator collects every worker's record with
    :func:`~meshkit.node.collect_caps`, fires the
    ``meshkit_node_joined(caps=...)`` hook for each, and places work only
    where :meth:`NodeCaps.accepts` holds.

``TAG_JOB`` (rank 0 -> worker): one job at a time, ``"kind"`` says which
(:func:`send_job`, :func:`recv_job`). :func:`~meshkit.node.serve_node` hands
each to the :data:`~meshkit.node.JobHandler` registered for its kind.
    * ``{"kind": "pipeline", "job": id, "stage": {...}, "param.<name>": array...}``:
      serve one pipeline stage (on a worker, ``meshkit.pipeline.serve_pipeline_job``;
      on a board rank, :func:`~meshkit.node.serve_fixed_function`). ``stage`` is
      ``meshkit.pipeline.Stage.to_message`` plus the route: ``prev`` (rank
      activations come from), ``next`` (rank results go to; 0 = back to the
      coordinator) and ``index`` (position in the pipeline).
    * ``{"kind": "train", "job": id, "spec": {...}}``: run
      ``meshkit.train.serve_trainer(group, spec, control)`` (its module
      documents ``spec``). A fixed-function rank answers with an ``error``
      (it cannot train: :meth:`NodeCaps.can_train` says why).
    * ``{"kind": "shutdown"}``: leave the mesh (:func:`shutdown_nodes`).
    * ``{"kind": "refused", "message": str}``: the coordinator will not place
      work on this node (say, it claims a placement tag its node key is not
      bound to); the node leaves and ``meshkit node`` exits 2 with the
      message (:func:`refuse_node`).

``TAG_ACT`` (stage to stage, and rank 0 -> first stage)
    ``{"act/<job>/<seq>": float32 array of shape (k, n)}``: ``k``
    activations (rows) numbered ``seq .. seq + k - 1``; and ``{"end": job}``
    after the last one: a stage forwards ``end`` to ``next`` and reports.
    Frames of another job are stale (left over from an aborted job) and are
    dropped. (One entry a frame and no JSON leaf: this is the hot path, and
    every entry costs an encode and a decode on every hop.) The older form
    ``{"act": [job, seq], "x": array}`` is still served, and answered in
    that form.

``TAG_UP`` (worker -> rank 0): replies, so the coordinator can take them with
one ``recv(ANY, TAG_UP)`` (:func:`send_up`)
    * ``{"kind": "ready", "job": id}``: the stage was accepted; activations
      may move;
    * ``{"result/<job>/<seq>": array}`` (or ``{"result": [job, seq], "x":
      array}``, answering the older form): the last stage's output rows;
    * ``{"kind": "error", "job": id, "error": ExceptionName, "message": str}``:
      the job failed on this rank (:func:`report_job_error`; the rank then
      drains the job until its ``end`` and reports, so the pipeline unwinds
      instead of hanging);
    * ``{"kind": "report", "job": id, "report": {...}}``: the job ended on this
      rank (a :class:`NodeReport` or :class:`TrainReport`, ``"type"`` says which);
    * ``{"kind": "left", "job": id, "report": {...}}``: this rank stopped
      (stop handle or step budget) and is leaving the mesh.

``TAG_ABORT`` (rank 0 -> worker)
    ``{"kind": "abort", "job": id}``: abandon the job (a stage before this
    one died or left, so its ``end`` cannot arrive). Checked only while the
    stage is idle, so activations already queued are still served.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from meshkit.errors import MeshError, PeerLostError, WireError
from meshkit.node._control import NodeControl, recv_polling
from meshkit.transport.tags import TAG_ABORT, TAG_ACT, TAG_JOB, TAG_UP

__all__ = [
    "TAG_JOB",
    "TAG_UP",
    "TAG_ACT",
    "TAG_ABORT",
    "send_job",
    "recv_job",
    "shutdown_nodes",
    "send_up",
    "refuse_node",
    "report_job_error",
]



def send_job(group: Any, rank: int, job: Mapping[str, Any]) -> None:
    """Coordinator: send a job message (see the module docstring) to ``rank``."""
    group.send(rank, TAG_JOB, job)


def recv_job(group: Any, *, control: NodeControl | None = None,
             timeout: float = float("inf")) -> dict[str, Any] | None:
    """Worker: wait for the next job from rank 0; None if ``control`` stopped us first."""
    payload = recv_polling(group, 0, TAG_JOB, control, timeout)
    if payload is None:
        return None
    if not isinstance(payload.get("kind"), str):
        raise WireError(f"job message from rank 0 has no 'kind': keys {sorted(payload)}")
    return dict(payload)


def shutdown_nodes(group: Any, ranks: Iterable[int] | None = None) -> None:
    """Coordinator: tell ``ranks`` (every live worker by default) to leave the mesh."""
    for rank in (group.live_ranks if ranks is None else ranks):
        try:
            send_job(group, rank, {"kind": "shutdown"})
        except PeerLostError:
            pass  # already gone: nothing left to shut down


def refuse_node(group: Any, rank: int, message: str) -> None:
    """Coordinator: tell ``rank`` it is refused, and why (it leaves; no-op if it is gone)."""
    try:
        send_job(group, rank, {"kind": "refused", "message": str(message)})
    except PeerLostError:
        pass


def send_up(group: Any, message: Mapping[str, Any]) -> None:
    """Worker: send a reply (ready, result, error, report, left) to rank 0."""
    group.send(0, TAG_UP, message)


def report_job_error(group: Any, job: Any, error: MeshError) -> None:
    """Worker: tell rank 0 that job ``job`` failed or was refused on this rank.

    Sends ``{"kind": "error", ...}`` naming ``error``'s class and message
    (``meshkit.pipeline.run_pipeline`` raises it again as the same class), so
    the message should say what was expected, what was found and what works
    instead. A job handler that refuses a job calls this and returns None,
    so the coordinator hears why instead of waiting out its timeout.
    """
    send_up(group, {"kind": "error", "job": job, "error": type(error).__name__,
                    "message": str(error)})
