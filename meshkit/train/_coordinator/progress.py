"""How a run's progress reads: one line per event, the same from the CLI and from Python.

``meshkit run`` prints these lines; ``meshkit.run(config, progress=print)``
prints the very same ones, because :class:`meshkit.train.RunEvent` and
:class:`meshkit.train.RunReport` turn into them with ``str()``
(:func:`format_event`, :func:`format_result`), and so does the torchrun
launcher (``meshkit_torchdist``).
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["format_metrics", "format_round", "format_event", "format_result"]

#: The metrics shown first, with four decimals, in this order.
_FIRST = ("train_loss", "loss", "accuracy")


def format_metrics(metrics: Mapping[str, Any]) -> str:
    """``train_loss 0.5000  loss 0.4000  accuracy 0.9000  other 1.23``."""
    parts = [f"{key} {metrics[key]:.4f}" for key in _FIRST if key in metrics]
    parts += [f"{k} {v:.4g}" for k, v in metrics.items()
              if k not in _FIRST and isinstance(v, (int, float))]
    return "  ".join(parts)


def format_round(r: Any) -> str:
    """One round's progress line (a :class:`meshkit.train.RoundReport`)."""
    if r.round == 0:
        return f"round   0 (evaluation only)  {format_metrics(r.metrics)}  {r.seconds:.2f}s"
    answered = len(r.answered)
    asked = answered + len(r.dropped)
    line = (f"round {r.round:>3}/{r.rounds}  workers {answered}/{asked}  "
            f"{format_metrics(r.metrics)}  {r.seconds:.2f}s")
    if r.dropped:
        line += f"  (dropped rank {', '.join(map(str, r.dropped))})"
    if r.not_served:
        late = f", {len(r.late)} late" if r.late else ""
        line += (f"  ({len(r.not_served)} of {len(r.clients) + len(r.not_served)} client(s) "
                 f"not served{late}; see metrics.jsonl)")
    if r.joined:
        line += f"  (joined rank {', '.join(map(str, r.joined))})"
    if getattr(r, "partial_means", ""):
        line += f"  ({r.partial_means})"
    if getattr(r, "skipped", ""):
        line += f"  (skipped: {r.skipped})"
    if getattr(r, "staleness", None):  # an asynchronous server step (fedbuff)
        clock = (f", simulated {r.simulated_time:.1f}s" if r.simulated_time is not None
                 else "")
        line += f"  (staleness up to {max(r.staleness)}{clock})"
    return line


def format_event(event: Any) -> str:
    """A :class:`meshkit.train.RunEvent` as the CLI prints it."""
    if event.kind == "round" and event.report is not None:
        return format_round(event.report)
    return str(event.message)


def format_result(report: Any) -> str:
    """The final line of a run (a :class:`meshkit.train.RunReport`)."""
    if report.error is not None:
        return f"failed: {report.strategy} after {report.rounds_completed} round(s): {report.error}"
    if report.already_complete:
        return (f"complete: {report.out} already holds {report.rounds_completed} of "
                f"{report.rounds} round(s) ({format_metrics(report.metrics)}); nothing was "
                f"started. Raise [strategy] rounds to train on, or --overwrite to start afresh")
    if report.rounds == 0:
        return (f"done: {report.strategy}, evaluation only in {report.seconds:.1f}s; "
                f"{format_metrics(report.metrics)}")
    start = f" (resumed after round {report.resumed_from})" if report.resumed_from else ""
    stopped = f"; stopped early: {report.stopped}" if getattr(report, "stopped", "") else ""
    return (f"done: {report.strategy}, {report.rounds_completed} round(s){start} in "
            f"{report.seconds:.1f}s; {format_metrics(report.metrics)}{stopped}")
