"""What a run leaves in its ``out`` directory, besides the checkpoint.

* ``metrics.jsonl`` — one line per finished round (:meth:`RoundReport.to_json`),
  appended and flushed as the round completes; a resumed run first keeps
  only the lines its checkpoint covers (:func:`truncate_metrics`);
* ``clients.jsonl`` — with ``[run] client_metrics = "file"``, each round's
  per-client figures, one line per client (:func:`split_clients`), streamed
  instead of inline in the round's line;
* ``summary.json`` — how the run ended (:meth:`RunReport.to_json`);
* ``report.png`` — the metrics drawn round by round, when matplotlib is
  installed.

A fresh run owns its directory's results (:func:`clear_results`): stale
rounds from an earlier run would be read as this one's.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping

from meshkit._atomic import atomic_file
from meshkit.checkpoint import CHECKPOINT_NAME
from meshkit.errors import ConfigError
from meshkit.train._strategy import REPORT_FIELDS

__all__ = [
    "METRICS_NAME",
    "REPORT_NAME",
    "SUMMARY_NAME",
    "clear_results",
    "append_metrics",
    "read_metrics",
    "truncate_metrics",
    "split_clients",
    "append_clients",
    "CLIENTS_NAME",
    "write_summary",
    "plot",
    "figure",
]

log = logging.getLogger(__name__)

METRICS_NAME = "metrics.jsonl"
#: Per-client figures with ``[run] client_metrics = "file"``: one line per client and round.
CLIENTS_NAME = "clients.jsonl"
#: The fields of a round's metrics line that hold one entry per client of the round.
PER_CLIENT_FIELDS = ("served", "client_examples", "client_metrics")
REPORT_NAME = "report.png"
SUMMARY_NAME = "summary.json"


def clear_results(out: Path) -> None:
    """Start ``out`` afresh: an empty metrics file, no checkpoint, plot or summary."""
    (out / METRICS_NAME).write_text("")
    for stale in (CHECKPOINT_NAME, REPORT_NAME, SUMMARY_NAME, CLIENTS_NAME):
        (out / stale).unlink(missing_ok=True)


def append_metrics(out: Path, line: Mapping[str, Any]) -> None:
    """Append one round's line, on disk before this returns."""
    with open(out / METRICS_NAME, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(line, allow_nan=False) + "\n")  # strict JSON: null for NaN
        fh.flush()
        os.fsync(fh.fileno())


def split_clients(line: Mapping[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A round's metrics line without its per-client fields, and those as one line per client.

    Each client line is ``{"round", "client", "rank", "examples", <its metrics>...}``
    (``rank`` and ``examples`` absent when the round did not record them).
    """
    slim = {k: v for k, v in line.items() if k not in PER_CLIENT_FIELDS}
    served = line.get("served", {})
    examples = line.get("client_examples", {})
    metrics = line.get("client_metrics", {})
    rows = []
    for client in sorted({*served, *examples, *metrics}, key=int):
        row: dict[str, Any] = {"round": line.get("round"), "client": int(client)}
        if client in served:
            row["rank"] = served[client]
        if client in examples:
            row["examples"] = examples[client]
        row.update(metrics.get(client, {}))
        rows.append(row)
    return slim, rows


def append_clients(out: Path, rows: list[dict[str, Any]]) -> None:
    """Append a round's per-client lines to ``OUT/clients.jsonl`` (streamed: nothing is kept)."""
    with open(out / CLIENTS_NAME, "a", encoding="utf-8") as fh:
        fh.writelines(json.dumps(row, allow_nan=False) + "\n" for row in rows)
        fh.flush()
        os.fsync(fh.fileno())


def read_metrics(out: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rounds recorded in ``OUT/metrics.jsonl``."""
    path = Path(out) / METRICS_NAME
    if not path.exists():
        return []
    return [json.loads(line) for line in _lines(path) if line]


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{str(path)!r} is not UTF-8 text (byte {exc.start} is not: {exc.reason}), so it "
            f"is not a metrics file meshkit wrote. Fix or remove it, or start afresh with "
            f"--overwrite") from None


def _round_of(path: Path, number: int, row: Any) -> int:
    """The round a kept metrics line records, or a ConfigError naming the line."""
    rnd = row.get("round") if isinstance(row, dict) else None
    if isinstance(rnd, bool) or not isinstance(rnd, int):
        what = f"its round is {rnd!r}" if isinstance(row, dict) else (
            f"it is {type(row).__name__}, not a JSON object")
        raise ConfigError(
            f"{str(path)!r} line {number}: {what}, not a round number; a resumed run cannot "
            f"tell which rounds it records. Fix or remove the line, or start afresh with "
            f"--overwrite")
    return rnd


def truncate_metrics(out: Path, last_round: int,
                     last_report: Mapping[str, Any] | None = None) -> None:
    """Keep only the lines of rounds the checkpoint covers (a crash may leave one more).

    The checkpoint is written before its round's line, so a crash between
    the two leaves the line missing: ``last_report`` (the line the
    checkpoint carries) fills that gap. A line that is not JSON is a torn
    last line from a crash and is dropped; a JSON line that does not record
    a round is refused (something other than meshkit wrote it).
    """
    path = out / METRICS_NAME
    kept = []
    recorded = 0
    if path.exists():
        for number, line in enumerate(_lines(path), 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line from a crash
            rnd = _round_of(path, number, row)
            if rnd <= last_round:
                kept.append(line)
                recorded = max(recorded, rnd)
    if last_report and recorded < last_round == last_report.get("round"):
        kept.append(json.dumps(dict(last_report)))
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    _truncate_clients(out / CLIENTS_NAME, last_round)


def _truncate_clients(path: Path, last_round: int) -> None:
    """Keep the per-client lines of rounds the checkpoint covers, line by line (streamed).

    A crash between the checkpoint and these lines loses that round's
    per-client lines; its metrics line (from the checkpoint) still counts them.
    """
    if not path.exists():
        return
    partial = path.with_name(path.name + ".part")
    with open(path, encoding="utf-8") as src, open(partial, "w", encoding="utf-8") as dst:
        for line in src:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line from a crash
            if isinstance(row, dict) and isinstance(row.get("round"), int) \
                    and row["round"] <= last_round:
                dst.write(line if line.endswith("\n") else line + "\n")
    os.replace(partial, path)


def write_summary(out: Path, summary: Mapping[str, Any]) -> None:
    """Write ``summary.json``; a failure is logged, never raised (the run's outcome wins)."""
    try:
        with atomic_file(out / SUMMARY_NAME) as fh:  # a reader never sees half a summary
            fh.write((json.dumps(summary, indent=2, allow_nan=False) + "\n").encode("utf-8"))
    except OSError:
        log.warning("could not write %s", out / SUMMARY_NAME, exc_info=True)


def plot(out: Path) -> Path | None:
    """Draw ``OUT/report.png`` from metrics.jsonl when matplotlib is installed.

    Called whatever the run's outcome, so a failure is logged, never raised:
    the run's own error (or success) is what the user must see.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    try:
        fig = figure(read_metrics(out), title=str(out))
        if fig is None:
            return None
        path = out / REPORT_NAME
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
    except Exception:
        log.warning("could not draw %s", out / REPORT_NAME, exc_info=True)
        return None


def figure(rows: list[dict[str, Any]], title: str = "") -> Any:
    """The metrics of ``rows`` drawn round by round (a matplotlib figure), or None.

    Rounds are whole numbers, so the round axis has integer ticks only; a
    single round (a model-parallel pass, an evaluation-only run) is one
    labelled point centred on its own tick rather than a dot on a
    fractional axis.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    keys = sorted({k for row in rows for k, v in row.items()
                   if k not in REPORT_FIELDS and isinstance(v, (int, float))
                   and not isinstance(v, bool)})
    if not keys:
        return None
    rounds = sorted({r["round"] for r in rows})
    fig, axes = plt.subplots(len(keys), 1, figsize=(6, 2.2 * len(keys)), sharex=True,
                             squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        pts = [(r["round"], r[key]) for r in rows if key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
        if len(pts) == 1:
            ax.annotate(f"{pts[0][1]:.4g}", pts[0], textcoords="offset points",
                        xytext=(8, 0), va="center")
        ax.set_ylabel(key)
        ax.grid(True, alpha=0.3)
    bottom = axes[-1, 0]
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(rounds) == 1:
        bottom.set_xticks(rounds)
        bottom.set_xlim(rounds[0] - 1, rounds[0] + 1)
    bottom.set_xlabel("round")
    fig.suptitle(f"{rows[-1].get('strategy', '')}: {title}")
    fig.tight_layout()
    return fig
