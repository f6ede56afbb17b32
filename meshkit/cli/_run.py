"""``meshkit run`` and ``meshkit coordinator``: a whole training job from one config.

What a person sees of a run is decided here: :func:`_render` turns the
runner's events into lines (with ``-q`` only the final line is printed, with
``--json`` the result is one JSON document on stdout and progress goes to
stderr), and the exit status follows the outcome:

* 0 — the run finished (or ``--resume`` found it complete already);
* 2 — a user's mistake or a refusal (:class:`meshkit.MeshError`), one
  paragraph on stderr;
* 130 / 143 — interrupted by Ctrl-C / SIGTERM: the workers are stopped, the
  last checkpoint is intact and one line says how to resume.

:mod:`meshkit.cli` loads this module only when one of its commands runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
import types
from typing import Any, Iterator

import click

from meshkit.errors import MeshError
from meshkit.train import Interrupted, Runner, RunReport, format_event, format_result

__all__ = ["run", "coordinator"]

#: Seconds a round may run before the terminal is told it is still alive.
HEARTBEAT = 10.0


def _progress(*, quiet: bool, to_stderr: bool) -> Any:
    """Renders runner events: round lines on stdout (stderr with --json), the rest on stderr."""

    def render(event: Any) -> None:
        if quiet:
            return
        click.echo(format_event(event),
                   err=to_stderr or event.kind not in ("round", "listening", "discovery"))

    return render


@contextlib.contextmanager
def _interrupts(runner: Runner) -> Iterator[None]:
    """SIGTERM and SIGINT raise :class:`Interrupted` in the run, once.

    While the runner is finishing (stopping workers, writing results) a
    signal is ignored: raising then would leave workers behind, and the run
    is about to end anyway.
    """
    fired: list[int] = []

    def handler(signum: int, frame: types.FrameType | None) -> None:
        if runner.finishing or fired:
            return
        fired.append(signum)
        raise Interrupted(signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread (CliRunner in a thread): leave them be
            pass
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _execute(config: str, *, resume: bool, overwrite: bool, quiet: bool, as_json: bool,
             launch: str | None, verbose: int, command: str,
             discovery: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    runner = Runner(config, resume=resume, overwrite=overwrite,
                    progress=_progress(quiet=quiet, to_stderr=as_json),
                    launch=launch, heartbeat=None if quiet else HEARTBEAT,
                    discovery=discovery)
    try:
        with _interrupts(runner):
            report = runner.run()
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else int(signal.SIGINT)
        how = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        ended = runner.report
        if as_json:
            click.echo(json.dumps(ended.to_json() if ended is not None else
                                  {"ok": False, "error": f"interrupted ({how})"}, indent=2))
        after = f" after round {ended.rounds_completed}" if ended is not None else ""
        click.echo(f"meshkit: interrupted by {how}{after}; workers stopped, the last "
                   f"checkpoint is intact. Continue with: meshkit {command} {config} "
                   f"--resume", err=True)
        sys.exit(128 + signum)
    except MeshError as exc:
        if as_json:
            click.echo(json.dumps({"ok": False, "error": str(exc)}))
        raise
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
        return
    click.echo(format_result(report))
    if quiet or report.already_complete:
        return
    if report.dropped:
        click.echo("dropped: " + "; ".join(f"rank {r}: {why}"
                                           for r, why in sorted(report.dropped.items())))
    saved = "" if report.rounds == 0 else f", {report.out}/checkpoint.npz"
    click.echo(f"results: {report.out}/metrics.jsonl{saved}")


def _run_options(command: Any) -> Any:
    for option in reversed([
        click.option("--resume", is_flag=True,
                     help="Continue from OUT/checkpoint.npz instead of starting afresh."),
        click.option("--overwrite", is_flag=True,
                     help="Replace the checkpoint and results another run left in OUT "
                          "(without it, a fresh run refuses to)."),
        click.option("-q", "--quiet", is_flag=True, help="Print only the final line."),
        click.option("--json", "as_json", is_flag=True,
                     help="Print the run's result (summary.json's content) as JSON on stdout; "
                          "progress goes to stderr."),
        click.option("-v", "--verbose", count=True,
                     help="Log more (-v info, -vv debug) to stderr."),
    ]):
        command = option(command)
    return command


def _exclusive(resume: bool, overwrite: bool) -> None:
    if resume and overwrite:
        raise click.UsageError("--resume continues OUT's checkpoint and --overwrite replaces "
                               "it: give one of them")


@click.command("run", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("config", type=click.Path(dir_okay=False))
@_run_options
def run(config: str, resume: bool, overwrite: bool, quiet: bool, as_json: bool,
        verbose: int) -> None:
    """Run the training job CONFIG.

    Resolves every component and runs every start-up check first (a missing
    plugin fails before anything starts). With [mesh] launch = "local" the
    workers are spawned here on loopback with a fresh secret; with "external"
    the coordinator waits for nodes started with `meshkit node`. Appends
    OUT/metrics.jsonl and rewrites OUT/checkpoint.npz (atomically) every
    round. A fresh run refuses an OUT holding another run's checkpoint:
    --resume continues it, --overwrite replaces it.

    Exit status: 0 done, 2 a mistake or refusal, 130/143 interrupted
    (Ctrl-C/SIGTERM; --resume continues), 1 a bug.
    """
    _exclusive(resume, overwrite)
    _execute(config, resume=resume, overwrite=overwrite, quiet=quiet, as_json=as_json,
             launch=None, verbose=verbose, command="run")


@click.command("coordinator", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("config", type=click.Path(dir_okay=False))
@_run_options
@click.option("--discovery", is_flag=True,
              help="Start the UDP discovery responder ([mesh] discovery = true), so nodes "
                   "can join with `meshkit node --discover [--via HOST]`.")
def coordinator(config: str, resume: bool, overwrite: bool, quiet: bool, as_json: bool,
                verbose: int, discovery: bool) -> None:
    """Run only the coordinator of CONFIG, for nodes started elsewhere.

    Like `meshkit run` with launch = "external": binds [mesh] bind, waits for
    [mesh] workers nodes (`meshkit node --peers HOST:PORT --secret-file F
    --rank i --world N`) and drives the job. Needs a shared secret
    (secret_file or MESHKIT_SECRET). With --discovery (or [mesh] discovery
    = true) nodes can instead join with `meshkit node --discover` (broadcast)
    or `--discover --via THIS_HOST`; the UDP port is [mesh] discovery_port.
    """
    _exclusive(resume, overwrite)
    _execute(config, resume=resume, overwrite=overwrite, quiet=quiet, as_json=as_json,
             launch="external", verbose=verbose, command="coordinator", discovery=discovery)
