"""What a node did, returned instead of printed: :class:`NodeReport`, :class:`TrainReport`.

A node embedded in an app or a board's host shim has no stdout anyone
reads, so every serving loop returns a report, and sends it to the
coordinator as JSON (``"type"`` says which kind; :func:`report_from_json`
reads either back).
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from meshkit.errors import WireError
from meshkit.node._caps import NodeRole, platform_tag

__all__ = ["NodeReport", "TrainReport", "report_from_json"]


@attrs.frozen
class NodeReport:
    """What a node did serving one pipeline job, returned instead of printed.

    ``stopped`` is None when the job ended normally (its ``end`` arrived),
    ``"stop"`` or ``"budget"`` when :class:`NodeControl` ended it, and
    ``"error"`` when the stage failed (``error`` holds the message).
    """

    rank: int
    role: str = NodeRole.WORKER
    stage_id: str | None = None
    job: int | None = None
    activations: int = 0
    stopped: str | None = None
    error: str | None = None
    platform: str = attrs.field(factory=platform_tag)
    device: str = "cpu"
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"type": "node", **attrs.asdict(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NodeReport:
        return _report_from_json(cls, data)


@attrs.frozen
class TrainReport:
    """What a node did in a training job (built by ``meshkit.train.serve_trainer``).

    ``steps`` counts optimizer steps (or local epochs in a federated round),
    ``rounds`` the reduce rounds it took part in, ``examples`` the examples it
    trained on; ``metrics`` is the task's last metrics (JSON numbers);
    ``stopped`` is None on a normal end, else why the node left early.
    """

    rank: int
    steps: int = 0
    rounds: int = 0
    examples: int = 0
    metrics: dict[str, Any] = attrs.field(factory=dict)
    stopped: str | None = None
    error: str | None = None
    job: int | None = None
    platform: str = attrs.field(factory=platform_tag)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"type": "train", **attrs.asdict(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TrainReport:
        return _report_from_json(cls, data)


def _report_from_json(cls: type, data: Mapping[str, Any]) -> Any:
    if not isinstance(data, Mapping):
        raise WireError(f"a {cls.__name__} must be a JSON object, got {data!r}")
    names = {f.name for f in attrs.fields(cls)}
    try:
        return cls(**{k: v for k, v in data.items() if k in names})
    except TypeError as exc:
        raise WireError(f"malformed {cls.__name__}: {exc}") from None


def report_from_json(data: Mapping[str, Any]) -> NodeReport | TrainReport:
    """A report from its JSON form (``"type"`` selects node or train)."""
    kind = data.get("type") if isinstance(data, Mapping) else None
    if kind == "train":
        return TrainReport.from_json(data)
    return NodeReport.from_json(data)
