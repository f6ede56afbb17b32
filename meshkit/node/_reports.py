"""What a node did, returned instead of printed: :class:`NodeReport`, :class:`TrainReport`.

An error a node reports travels to the coordinator as :func:`sendable`
words it: a meshkit error as written, any other exception with the
literals it quotes (a library's echo of the data it choked on) removed.

A node embedded in an app or a board's host shim has no stdout anyone
reads, so every serving loop returns a report, and sends it to the
coordinator as JSON (``"type"`` says which kind; :func:`report_from_json`
reads either back).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import attrs

from meshkit.errors import MeshError, WireError
from meshkit.node._caps import NodeRole, platform_tag

__all__ = ["NodeReport", "TrainReport", "report_from_json", "sendable"]


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


#: A quoted literal in an exception's message (what a library quotes is data).
_QUOTED = re.compile(r"'[^'\n]*'|\"[^\"\n]*\"")

#: The longest error message a node sends (its own log has all of it).
MAX_ERROR_CHARS = 2000


def sendable(exc: BaseException) -> str:
    """``exc``'s message as it may cross the wire: a MeshError's whole; another's redacted.

    A meshkit error names the problem (file, row, column, what was expected),
    never data, so it goes as written. Any other exception's quoted literals
    become ``'…'`` and its length is capped: that is where a library echoes
    the value it could not use.
    """
    plain_key = isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str)
    text = exc.args[0] if plain_key else str(exc)  # str(KeyError) quotes its whole message
    if not isinstance(exc, MeshError):
        text = _QUOTED.sub("'…'", text)
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + " […]"
