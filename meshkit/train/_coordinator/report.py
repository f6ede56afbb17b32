"""What a run reports: how it ended (:class:`RunReport`), what the CLI may show on the way
(:class:`RunEvent`), and the signal that stopped it (:class:`Interrupted`).

The records :class:`~meshkit.train._coordinator.runner.Runner` hands to its caller, the
CLI and ``meshkit_run_finished``; they hold data and render themselves
(:mod:`meshkit.train._coordinator.progress`), nothing more.
"""

from __future__ import annotations

import math
import signal
from typing import Any, Mapping

import attrs

from meshkit.train._coordinator.progress import format_event, format_result

__all__ = ["Interrupted", "RunEvent", "RunReport"]


class Interrupted(KeyboardInterrupt):
    """The run was interrupted by a signal (``meshkit run`` raises it for SIGTERM/SIGINT).

    A KeyboardInterrupt, so code that handles Ctrl-C handles SIGTERM the same
    way; ``signum`` says which signal, so the exit status can be 128 + it.
    """

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signum)
        self.signum = int(signum)

    @property
    def signal_name(self) -> str:
        name = signal.Signals(self.signum).name
        return "Ctrl-C" if name == "SIGINT" else name


@attrs.frozen
class RunReport:
    """How a run ended (what ``meshkit_run_finished`` receives)."""

    ok: bool
    out: str
    strategy: str
    rounds: int
    rounds_completed: int
    resumed_from: int = 0
    metrics: Mapping[str, float] = attrs.Factory(dict)
    dropped: Mapping[int, str] = attrs.Factory(dict)
    error: str | None = None
    seconds: float = 0.0
    #: Where the coordinator listened (so a user can point nodes at it).
    address: str = ""
    #: ``--resume`` found every round done already: nothing was started.
    already_complete: bool = False
    #: Why the run stopped cleanly before its last round ("": it did not).
    stopped: str = ""
    #: The final global state (not in the JSON form).
    state: Mapping[str, Any] | None = attrs.field(default=None, repr=False)
    #: Every round this run played, in order (the rounds' ``metrics.jsonl`` lines
    #: as :class:`RoundReport` records); a resumed run's earlier rounds are in
    #: ``metrics.jsonl`` (:func:`read_metrics`).
    history: tuple[Any, ...] = attrs.field(default=(), repr=False)

    def __str__(self) -> str:
        """The final line ``meshkit run`` prints."""
        return format_result(self)

    def to_json(self) -> dict[str, Any]:
        data = attrs.asdict(self, recurse=False)
        data.pop("state")
        data.pop("history")
        data["dropped"] = {str(k): v for k, v in self.dropped.items()}
        # A task may report numpy scalars (np.float32 is not JSON); this runs
        # in run()'s finally, where an error would mask the real outcome.
        data["metrics"] = {k: _number(v) for k, v in self.metrics.items()}
        if "epsilon" in self.metrics:  # a private run's final ε, at its [privacy] delta
            data["epsilon"] = _number(self.metrics["epsilon"])
        # Each rank a round dropped for its own failure (accept_failures), and why.
        failed: dict[str, list[str]] = {}
        for report in self.history:
            for rank, why in sorted(getattr(report, "failed", {}).items()):
                failed.setdefault(str(rank), []).append(f"round {report.round}: {why}")
        data["failed"] = failed
        return data


def _number(value: Any) -> Any:
    """A metric as strict JSON has it: a finite float, else null (JSON has no NaN)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    return number if math.isfinite(number) else None


@attrs.frozen
class RunEvent:
    """Something the CLI may show.

    ``kind`` is "listening", "joined", "refused", "round" (``report`` is the round's
    :class:`RoundReport`) or "alive" (a long round is still running;
    ``message`` says which and for how long).
    """

    kind: str
    message: str = ""
    report: Any = None

    def __str__(self) -> str:
        """The line ``meshkit run`` prints for it (``progress=print`` shows the same)."""
        return format_event(self)
