"""``meshkit serve`` and the commands that talk to it: submit, ls, status, logs, stop.

``serve`` runs in the foreground until SIGTERM or Ctrl-C (exit 143 / 130;
runs in flight stay unfinished in the database and resume from their
checkpoints at the next start, exactly as after a crash). The others are
clients of its control API (:mod:`meshkit.service._client`): each takes
``--service`` (the control address, or the service's state directory on its
own host) and ``--token-file``, and ``--json`` for a machine-readable answer
on stdout. :mod:`meshkit.cli` loads this module only when one of them runs.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
import tomllib
import types
from pathlib import Path
from typing import Any, Callable

import click

import meshkit.service
from meshkit.errors import ConfigError, RefusedError
from meshkit.service import Service, ServiceClient, load_serve_config, locate_service

__all__ = ["serve", "submit", "ls", "status", "logs", "stop"]

_CONTEXT = {"help_option_names": ["-h", "--help"]}


def _client_options(command: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed([
        click.option("--service", default=None, metavar="ADDRESS",
                     help="The service's control address (HOST:PORT or URL), or its state "
                          "directory on this host. Env: MESHKIT_SERVICE."),
        click.option("--token-file", default=None, type=click.Path(dir_okay=False),
                     help="The control token (mode 0600); default: the state directory's. "
                          "Env: MESHKIT_SERVICE_TOKEN_FILE."),
        click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout."),
    ]):
        command = option(command)
    return command


def _client(service: str | None, token_file: str | None) -> ServiceClient:
    return locate_service(service, token_file)


def _when(stamp: float | None) -> str:
    return "-" if stamp is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))


@click.command("serve", context_settings=_CONTEXT)
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("-v", "--verbose", count=True, help="Log more (-v info, -vv debug) to stderr.")
def serve(config: str, verbose: int) -> None:
    """Run the service CONFIG ([serve] table): nodes join once, runs come and go.

    Prints one JSON line {"event": "serving", "nodes": ..., "control": ...}
    once both addresses listen (also in STATE_DIR/service.json). Unfinished
    runs of an earlier start (a crash included) continue from their
    checkpoints. Stops on SIGTERM / Ctrl-C (exit 143 / 130).
    """
    logging.basicConfig(
        level=logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s meshkit serve %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr)
    settings = load_serve_config(config)
    try:
        control_server = meshkit.service.ControlServer
    except ImportError as exc:
        raise RefusedError(f"meshkit serve needs Starlette and uvicorn for its control API and "
                           f"status page ({exc}); install them with pip install "
                           f"'meshkit[serve]'") from None
    service = Service(settings)
    done = threading.Event()
    signalled: list[int] = []

    def _stop(signum: int, frame: types.FrameType | None) -> None:
        signalled.append(signum)
        done.set()

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    control = None
    try:
        service.start()
        assert service.control_socket is not None
        control = control_server(service, service.control_socket)
        control.start()
        click.echo(json.dumps({"event": "serving", "nodes": service.node_address,
                               "control": service.control_address,
                               "state_dir": str(settings.state)}))
        sys.stdout.flush()
        done.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if control is not None:
            control.close()
        service.close()
    if signalled:
        click.echo("meshkit serve: stopped; unfinished runs continue at the next start", err=True)
        sys.exit(128 + signalled[0])


def _authorized_text(path: Path, text: str) -> str | None:
    """The run's ``[mesh] authorized_nodes`` file's content (the service keeps a copy)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    mesh = data.get("mesh")
    name = mesh.get("authorized_nodes") if isinstance(mesh, dict) else None
    if not name:
        return None
    if not isinstance(name, str):
        raise ConfigError(f"{path}: [mesh] authorized_nodes: expected a file name, got {name!r}")
    file = path.parent / name
    try:
        return file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: [mesh] authorized_nodes: cannot read {str(file)!r}: "
                          f"{exc}") from None


@click.command("submit", context_settings=_CONTEXT)
@click.argument("config", type=click.Path(dir_okay=False))
@_client_options
def submit(config: str, service: str | None, token_file: str | None, as_json: bool) -> None:
    """Submit the run CONFIG to a service; prints its run id.

    The service checks CONFIG as `meshkit run` would (a mistake is refused
    now, exit 2), decides its out directory, coordinator address and secret,
    and starts it once enough of the nodes its [mesh] authorized_nodes
    admits are free.
    """
    path = Path(config)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{config}: no such config file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{config}: cannot read config file: {exc}") from None
    authorized = _authorized_text(path, text)
    record = _client(service, token_file).submit(path.name, text, authorized)
    if as_json:
        click.echo(json.dumps(record, indent=2))
    else:
        click.echo(f"submitted {record['id']} ({record['name']}): {record['state']}")


@click.command("ls", context_settings=_CONTEXT)
@_client_options
def ls(service: str | None, token_file: str | None, as_json: bool) -> None:
    """List the service's runs, oldest first."""
    runs = _client(service, token_file).runs()
    if as_json:
        click.echo(json.dumps({"runs": runs}, indent=2))
        return
    click.echo(f"{'RUN':<6} {'STATE':<9} {'ROUNDS':>9}  {'SUBMITTED':<19}  CONFIG")
    for run in runs:
        rounds = f"{run['rounds_completed']}/{run['rounds']}"
        click.echo(f"{run['id']:<6} {run['state']:<9} {rounds:>9}  {_when(run['submitted'])}  "
                   f"{run['name']}")


@click.command("status", context_settings=_CONTEXT)
@click.argument("run")
@_client_options
def status(run: str, service: str | None, token_file: str | None, as_json: bool) -> None:
    """Show RUN: its state, rounds and latest metrics."""
    found = _client(service, token_file).status(run)
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    record, latest = found["run"], found.get("latest")
    click.echo(f"{record['id']} ({record['name']}): {record['state']}, round "
               f"{record['rounds_completed']} of {record['rounds']}, {record['workers']} node(s)")
    click.echo(f"submitted {_when(record['submitted'])}, started {_when(record['started'])}, "
               f"finished {_when(record['finished'])}")
    if latest:
        metrics = ", ".join(f"{k} {v:.4g}" if isinstance(v, (int, float)) else f"{k} {v}"
                            for k, v in (latest.get("metrics") or {}).items())
        click.echo(f"latest round {latest.get('round')}: {metrics}")
    if record.get("error"):
        click.echo(f"error: {record['error']}")


def _event_line(event: dict[str, Any]) -> str:
    return f"{_when(event['at'])} {event['kind']}: {event['message']}"


@click.command("logs", context_settings=_CONTEXT)
@click.argument("run")
@click.option("-f", "--follow", is_flag=True, help="Keep printing events until RUN ends.")
@_client_options
def logs(run: str, follow: bool, service: str | None, token_file: str | None,
         as_json: bool) -> None:
    """Print RUN's events (rounds, nodes, the end); with --follow, as they happen.

    With --json, one JSON object per line.
    """
    client = _client(service, token_file)
    after = 0
    while True:
        page = client.events(run, after=after, wait=10.0 if follow else 0.0)
        for event in page["events"]:
            after = max(after, int(event["seq"]))
            click.echo(json.dumps(event) if as_json else _event_line(event))
        sys.stdout.flush()
        if not follow or (page["finished"] and not page["events"]):
            return


@click.command("stop", context_settings=_CONTEXT)
@click.argument("run")
@_client_options
def stop(run: str, service: str | None, token_file: str | None, as_json: bool) -> None:
    """Stop RUN: a queued run never starts; a running one ends after its round, checkpoint kept."""
    record = _client(service, token_file).stop(run)
    if as_json:
        click.echo(json.dumps(record, indent=2))
    else:
        click.echo(f"{record['id']}: {record['state']}")
