"""``meshkit run`` and ``meshkit coordinator``: a whole training job from one config.

What a person sees of a run is decided here: :func:`_render` turns the
runner's events into lines, and the exit status follows the outcome (130
after Ctrl-C). :mod:`meshkit.cli` loads this module only when one of its
commands runs.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

from meshkit.train import Runner

__all__ = ["run", "coordinator"]


def _fmt_metrics(metrics: Any) -> str:
    parts = []
    for key in ("train_loss", "loss", "accuracy"):
        if key in metrics:
            parts.append(f"{key} {metrics[key]:.4f}")
    parts += [f"{k} {v:.4g}" for k, v in metrics.items()
              if k not in ("train_loss", "loss", "accuracy") and isinstance(v, (int, float))]
    return "  ".join(parts)


def _render(event: Any) -> None:
    if event.kind == "round":
        r = event.report
        answered = len(r.answered)
        asked = answered + len(r.dropped)
        line = (f"round {r.round:>3}/{r.rounds}  workers {answered}/{asked}  "
                f"{_fmt_metrics(r.metrics)}  {r.seconds:.2f}s")
        if r.dropped:
            line += f"  (dropped rank {', '.join(map(str, r.dropped))})"
        click.echo(line)
    else:
        click.echo(event.message, err=event.kind not in ("listening", "discovery"))


def _execute(config: str, resume: bool, launch: str | None, verbose: int,
             discovery: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    runner = Runner(config, resume=resume, progress=_render, launch=launch, discovery=discovery)
    try:
        report = runner.run()
    except KeyboardInterrupt:
        click.echo("meshkit: interrupted; workers stopped, the last checkpoint is intact "
                   "(continue with --resume)", err=True)
        sys.exit(130)
    start = f" (resumed after round {report.resumed_from})" if report.resumed_from else ""
    click.echo(f"done: {report.strategy}, {report.rounds_completed} round(s){start} in "
               f"{report.seconds:.1f}s; {_fmt_metrics(report.metrics)}")
    if report.dropped:
        click.echo("dropped: " + "; ".join(f"rank {r}: {why}"
                                           for r, why in sorted(report.dropped.items())))
    click.echo(f"results: {report.out}/metrics.jsonl, {report.out}/checkpoint.npz")


@click.command("run", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--resume", is_flag=True,
              help="Continue from OUT/checkpoint.npz instead of starting afresh.")
@click.option("-v", "--verbose", count=True, help="Log more (-v info, -vv debug) to stderr.")
def run(config: str, resume: bool, verbose: int) -> None:
    """Run the training job CONFIG.

    Resolves every component first (a missing plugin fails before anything
    starts). With [mesh] launch = "local" the workers are spawned here on
    loopback with a fresh secret; with "external" the coordinator waits for
    nodes started with `meshkit node`. Appends OUT/metrics.jsonl and rewrites
    OUT/checkpoint.npz (atomically) every round.
    """
    _execute(config, resume, None, verbose)


@click.command("coordinator", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--resume", is_flag=True,
              help="Continue from OUT/checkpoint.npz instead of starting afresh.")
@click.option("--discovery", is_flag=True,
              help="Start the UDP discovery responder ([mesh] discovery = true), so nodes "
                   "can join with `meshkit node --discover [--via HOST]`.")
@click.option("-v", "--verbose", count=True, help="Log more (-v info, -vv debug) to stderr.")
def coordinator(config: str, resume: bool, discovery: bool, verbose: int) -> None:
    """Run only the coordinator of CONFIG, for nodes started elsewhere.

    Like `meshkit run` with launch = "external": binds [mesh] bind, waits for
    [mesh] workers nodes (`meshkit node --peers HOST:PORT --secret-file F
    --rank i --world N`) and drives the job. Needs a shared secret
    (secret_file or MESHKIT_SECRET). With --discovery (or [mesh] discovery
    = true) nodes can instead join with `meshkit node --discover` (broadcast)
    or `--discover --via THIS_HOST`; the UDP port is [mesh] discovery_port.
    """
    _execute(config, resume, "external", verbose, discovery)
