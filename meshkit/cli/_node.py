"""``meshkit node``: join a mesh as a worker or, with ``--board``, a fixed-function rank.

Flags win over the environment NodeConfig reads; every flag combination
that cannot work is refused here, before the node connects.
:mod:`meshkit.cli` loads this module only when the command runs.
"""

from __future__ import annotations

import functools
import json
import logging
import signal
import sys
import threading
import types
from typing import Any

import attrs
import click

from meshkit import __version__, plugins, wire
from meshkit.cli._options import parse_board_options, parse_options, read_secret
from meshkit.errors import ConfigError, MeshError, PeerLostError, RefusedError
from meshkit.node import NodeControl, caps_for, serve_node
from meshkit.node.board import DeadlineBoard
from meshkit.node.config import NodeConfig
from meshkit.pipeline import serve_pipeline_job
from meshkit.secure_aggregation import Roster
from meshkit.service import Assign, Done, serve_service
from meshkit.train import Signing, node_attack, serve_train_job

__all__ = ["node"]

log = logging.getLogger(__name__)


class _Stopped(BaseException):
    """SIGTERM or SIGINT arrived while the node was still joining."""


@click.command("node", context_settings={"help_option_names": ["-h", "--help"],
                                         "show_default": True})
@click.option("--rank", type=int, default=None, help="This node's rank (1..world-1). Env: RANK.")
@click.option("--world", type=int, default=None,
              help="Ranks in the mesh, coordinator included. Env: WORLD.")
@click.option("--peers", default=None,
              help="Comma list: the coordinator's host:port (star), or one address per "
                   "rank (mesh). Env: PEERS.")
@click.option("--discover/--no-discover", default=None,
              help="Find peers by UDP discovery instead of --peers. Env: DISCOVER.")
@click.option("--disc-port", type=int, default=None, help="UDP discovery port. Env: DISC_PORT "
              "(default 29600).")
@click.option("--data-port", type=int, default=None,
              help="Base data port (rank r listens on base + r). Env: DATA_PORT (default 29500).")
@click.option("--via", default=None,
              help="Unicast discovery to this rendezvous host (no broadcast). Env: DISCOVER_HOST.")
@click.option("--topology", type=click.Choice(["star", "mesh"]), default=None,
              help="star: dial out to the coordinator only. Env: TOPOLOGY / DIAL_OUT=1.")
@click.option("--device", default=None,
              help="'auto', 'cpu', 'cuda', 'cuda:N' or 'mps': the device this node's task "
                   "runs on (a non-cpu one is checked through torch). Env: DEVICE.")
@click.option("--heap-mb", type=int, default=None, help="Memory budget in MiB. Env: HEAP_MB.")
@click.option("--transport", default=None, help="Transport component name (default tcp).")
@click.option("--timeout", type=float, default=None,
              help="Read/write timeout in seconds for the transport.")
@click.option("--transport-option", "transport_options", multiple=True, metavar="KEY=VALUE",
              help="A transport option (repeatable), e.g. max_frame_bytes=1048576; the [transport] table.")
@click.option("--segment-bytes", type=int, default=None,
              help="The most one frame of a model-sized message carries ([mesh] "
                   "segment_bytes; a multiple of 65536, default 4 MiB); each link cuts at the "
                   "smaller of its two ends' values.")
@click.option("--resume-seconds", type=float, default=None,
              help="Seconds this worker redials a coordinator whose link was cut, its cut "
                   "transfers resuming ([mesh] resume_seconds; 0: off, the default).")
@click.option("--resume-bytes", type=int, default=None,
              help="Bytes of cut transfers kept per peer to resume ([mesh] resume_bytes).")
@click.option("--board", "board_name", default=None,
              help="Join as a fixed-function rank driving this board component.")
@click.option("--board-option", "board_options", multiple=True, metavar="KEY=VALUE",
              help="A board option (repeatable), e.g. stage_id=enc0.")
@click.option("--task-option", "task_options", multiple=True, metavar="KEY=VALUE",
              help="A task option on this node only (repeatable), over the coordinator's "
                   "[task], e.g. train_csv=/data/mine.csv; checked against the task's options "
                   "when the job arrives.")
@click.option("--attack", "attack_name", default=None, metavar="NAME",
              help="Poison this node's contributions with attack NAME (sign-flip, scale, "
                   "gaussian, same-value, label-flip), to test a defence; the coordinator "
                   "records it in metrics.jsonl (attacked).")
@click.option("--attack-option", "attack_options", multiple=True, metavar="KEY=VALUE",
              help="An option of the --attack (e.g. factor=10 for scale); repeatable.")
@click.option("--pull-data", is_flag=True, default=False,
              help="This node has no data of its own: the coordinator sends it the training "
                   "set with the job.")
@click.option("--secret-file", type=click.Path(dir_okay=False), default=None,
              help="File holding the shared secret. Env: MESHKIT_SECRET.")
@click.option("--key", "key_file", type=click.Path(dir_okay=False), default=None,
              help="This node's private key (from `meshkit keygen`), proven in the handshake; "
                   "needed when the coordinator has [mesh] authorized_nodes.")
@click.option("--roster", "roster_file", type=click.Path(dir_okay=False), default=None,
              help="Signed secure rounds: the node keys ([mesh] authorized_nodes format) whose "
                   "signed adverts and survivor confirmations this worker's clients accept; "
                   "a round that relays anything else is refused before a secret is shared "
                   "or a share revealed (docs/secure-aggregation.md). Needs --key.")
@click.option("--min-noise-multiplier", "min_noise_multiplier", type=float, default=None,
              metavar="Z",
              help="Distributed DP ([privacy] placement = \"distributed\"): the least noise "
                   "multiplier this worker's clients add their updates under; a round whose "
                   "Skellam variance would give the sum of its clients less is refused "
                   "before any client trains (docs/secure-aggregation.md, \"Threat model\").")
@click.option("--encrypt/--no-encrypt", default=True,
              help="Encrypt frame bodies; --no-encrypt matches a coordinator with "
                   "[mesh] encrypt = false.")
@click.option("--trust-network", is_flag=True, default=False,
              help="The network between the nodes is trusted ([mesh] trust_network): only "
                   "then may a transport that authenticates nothing (torchdist) use a "
                   "non-loopback address.")
@click.option("--service", "service", default=None, metavar="HOST:PORT",
              help="Join a `meshkit serve` service at its node address instead of one run's "
                   "coordinator: serve run after run (the service assigns rank, world and a "
                   "per-run secret) and rejoin by itself after the service restarts.")
@click.option("--rejoin-timeout", type=float, default=300.0,
              help="With --service: give up (exit 2) after this many seconds without a "
                   "service to rejoin.")
@click.option("--steps", type=int, default=None,
              help="Step budget: serve at most this many activations, then leave.")
@click.option("-v", "--verbose", count=True, help="Log more (-v info, -vv debug) to stderr.")
def node(rank: int | None, world: int | None, peers: str | None, discover: bool | None,
         disc_port: int | None, data_port: int | None, via: str | None,
         topology: str | None, device: str | None, heap_mb: int | None,
         transport: str | None, timeout: float | None,
         transport_options: tuple[str, ...], segment_bytes: int | None,
         resume_seconds: float | None, resume_bytes: int | None, board_name: str | None,
         board_options: tuple[str, ...], task_options: tuple[str, ...],
         attack_name: str | None, attack_options: tuple[str, ...], pull_data: bool,
         secret_file: str | None, key_file: str | None, roster_file: str | None,
         min_noise_multiplier: float | None, encrypt: bool, trust_network: bool, service: str | None, rejoin_timeout: float,
         steps: int | None, verbose: int) -> None:
    """Join a mesh as a worker, or with --board as a fixed-function rank.

    Flags mirror meshkit.NodeConfig and win over the environment variables
    NodeConfig.from_env reads (RANK, WORLD, PEERS, DISCOVER, DISC_PORT,
    DATA_PORT, DISCOVER_HOST, TOPOLOGY, DIAL_OUT, HEAP_MB, DEVICE). The
    shared secret comes from --secret-file or MESHKIT_SECRET; without one the
    node refuses to start.

    Prints one JSON line {"event": "caps", ...} once it has joined and one
    {"event": "report", ...} per job it served; logs go to stderr. Serves
    job after job until the coordinator ends the run (exit 0); a refusal or
    a lost coordinator exits 2.
    """
    logging.basicConfig(
        level=logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s meshkit node %(levelname)s %(message)s", stream=sys.stderr)
    if attack_options and not attack_name:
        raise ConfigError("--attack-option needs --attack NAME (the attack to run)")
    if attack_name and board_name:
        raise ConfigError("--attack is for a worker that trains; a --board rank runs only its "
                          "board's stage")
    attack = node_attack(attack_name, attack_options) if attack_name else None
    secret = read_secret(secret_file)
    node_key = wire.load_node_key(key_file, "--key") if key_file else None
    if roster_file and node_key is None:
        raise ConfigError("--roster needs --key FILE: a worker that checks its neighbours' "
                          "signatures signs its own clients' adverts (make a key with "
                          "`meshkit keygen`)")
    if min_noise_multiplier is not None and not min_noise_multiplier > 0:
        raise ConfigError(f"--min-noise-multiplier must be positive, got "
                          f"{min_noise_multiplier}")
    signing = Signing(node_key, Roster.from_authorized(wire.load_authorized_nodes(
        roster_file, "--roster")) if roster_file else None,
        min_noise_multiplier or 0.0) if node_key is not None or min_noise_multiplier else None
    for pair in task_options:
        if "=" not in pair or not pair.partition("=")[0].strip():
            raise ConfigError(f"--task-option {pair!r}: expected KEY=VALUE")
    if (task_options or pull_data) and board_name:
        raise ConfigError("--task-option/--pull-data are for a worker that trains; a --board "
                          "rank runs only its board's stage")
    if board_options and not board_name:
        raise ConfigError("--board-option needs --board NAME (the board component to drive)")
    if disc_port is not None or data_port is not None or via is not None:
        if discover is False:
            raise ConfigError("--disc-port/--data-port/--via configure discovery; drop "
                              "--no-discover or those flags")
    board = None
    fixed_function = None
    if board_name:
        pset = plugins.default()
        component = pset.registry.get("board", board_name)
        table = parse_board_options(board_options, component.options)
        driver = pset.create("board", board_name, table)
        board = DeadlineBoard(driver)
        fixed_function = board.descriptor

    if transport_options:
        transport_component = plugins.default().registry.get("transport", transport or "tcp")
        transport_table = parse_options(transport_options, transport_component.options,
                                            flag="--transport-option", table="[transport]")
    else:
        transport_table = None
    overrides: dict[str, Any] = {
        "transport_options": transport_table,
        "rank": rank, "world": world, "topology": topology, "device": device,
        "transport": transport, "timeout": timeout, "fixed_function": fixed_function,
        "secret": secret, "encrypt": encrypt, "node_key": node_key,
        "trust_network": trust_network,
    }
    if segment_bytes is not None:
        overrides["segment_bytes"] = segment_bytes
    if resume_seconds is not None:
        overrides["resume_seconds"] = resume_seconds
    if resume_bytes is not None:
        overrides["resume_bytes"] = resume_bytes
    if heap_mb is not None:
        if heap_mb <= 0:
            raise ConfigError(f"--heap-mb must be positive, got {heap_mb}")
        overrides["heap_bytes"] = heap_mb << 20
    if service is not None:
        given = [flag for flag, value in (("--rank", rank), ("--world", world),
                                          ("--peers", peers), ("--discover", discover),
                                          ("--board", board_name), ("--via", via))
                 if value not in (None, False)]
        if given:
            raise ConfigError(f"--service: the service assigns each run's rank, world and "
                              f"coordinator; drop {', '.join(given)}")
        if not rejoin_timeout > 0:
            raise ConfigError(f"--rejoin-timeout must be positive, got {rejoin_timeout}")
        # A placeholder star of two; each run's assignment replaces all three.
        overrides.update(rank=1, world=2, peers=service, discover=False)
    elif discover or disc_port is not None or data_port is not None or via is not None:
        overrides.update(discover=True, disc_port=disc_port, data_base=data_port, via=via)
        overrides["peers"] = ()
    elif peers is not None:
        overrides["peers"] = peers
    elif discover is False:
        overrides["discover"] = False
    try:
        config = NodeConfig.from_env(**overrides)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"node configuration: {exc}") from None
    if config.rank == 0:
        raise ConfigError(
            "rank 0 is the coordinator: start it with `meshkit coordinator CONFIG` (or "
            "`meshkit run`), and give each `meshkit node` a rank in 1..world-1")
    if not config.peers and not config.discover:
        raise ConfigError(
            "no peers: pass --peers HOST:PORT (the coordinator, for a star; or one address "
            "per rank, for a mesh), or --discover (env PEERS / DISCOVER=1)")

    if service is not None:
        _join_service(service, config, pull_data=pull_data, steps=steps,
                      rejoin_timeout=rejoin_timeout,
                      jobs={"pipeline": serve_pipeline_job,
                            "train": functools.partial(serve_train_job, task_options=task_options,
                                                       attack=attack, signing=signing)})
        return
    control = NodeControl(steps=steps)
    joined = False
    signalled: list[int] = []

    def _stop(signum: int, frame: types.FrameType | None) -> None:
        if not joined:
            # Still joining (discovery, dialing): nothing to finish, stop now.
            raise _Stopped(signal.Signals(signum).name)
        # Leave after the current activation rather than dying mid-frame.
        signalled.append(signum)
        control.stop()

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            previous[sig] = signal.signal(sig, _stop)
        except (ValueError, OSError):  # not the main thread (embedded use)
            pass
    try:
        caps = caps_for(config)
        if pull_data:
            caps = attrs.evolve(caps, pull_data=True)
        try:
            group = config.connect()
        except _Stopped as stopped:
            click.echo(f"meshkit node: stopped by {stopped} while joining the mesh", err=True)
            sys.exit(143 if str(stopped) == "SIGTERM" else 130)
        joined = True
        try:
            click.echo(json.dumps({"event": "caps", "caps": caps.to_json()}), nl=True)
            sys.stdout.flush()
            reports = serve_node(group, caps, board=board, control=control,
                                 jobs={"pipeline": serve_pipeline_job,
                                       "train": functools.partial(serve_train_job,
                                                                  task_options=task_options,
                                                                  attack=attack, signing=signing)})
            for report in reports:
                click.echo(json.dumps({"event": "report", "report": report.to_json()}))
        finally:
            group.close()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if board is not None:
            board.close()
    if signalled:
        # The same statuses as an interrupted `meshkit run`: 130 / 143.
        name = signal.Signals(signalled[0]).name
        click.echo(f"meshkit node: stopped by {'Ctrl-C' if name == 'SIGINT' else name}",
                   err=True)
        sys.exit(128 + signalled[0])
    if control.ended == "refused":
        raise RefusedError(f"refused by the coordinator: {control.refusal}")
    if control.ended == "coordinator lost":
        # Not 0: a supervisor (systemd, a job array) must see that the run
        # did not finish here and restart the node, which then rejoins.
        raise PeerLostError(
            "lost the coordinator before it ended the run; start the node again (same "
            "rank and credentials) to rejoin at the next round")


def _echo(event: dict[str, Any]) -> None:
    click.echo(json.dumps(event))
    sys.stdout.flush()


def _join_service(address: str, config: NodeConfig, *, pull_data: bool, steps: int | None,
                  rejoin_timeout: float, jobs: dict[str, Any]) -> None:
    """``meshkit node --service``: serve the service's runs, one at a time, until stopped.

    Each assignment is served exactly as ``meshkit node --peers`` would serve
    that run (the same job loop), on the rank, world, coordinator address and
    per-run secret the service sent; a node key (--key) is proven to the
    service and to each run's coordinator alike.
    """
    stop = threading.Event()
    signalled: list[int] = []
    current: list[NodeControl] = []

    def _stop(signum: int, frame: types.FrameType | None) -> None:
        # Leave after the current activation rather than dying mid-frame.
        signalled.append(signum)
        stop.set()
        for control in current:
            control.stop()

    def serve_run(assign: Assign) -> Done:
        run_config = attrs.evolve(config, rank=assign.rank, world=assign.world,
                                  peers=(assign.address,), secret=assign.secret.encode(),
                                  encrypt=assign.encrypt, timeout=assign.timeout)
        caps = caps_for(run_config)
        if pull_data:
            caps = attrs.evolve(caps, pull_data=True)
        control = NodeControl(steps=steps)
        current[:] = [control]
        if stop.is_set():
            control.stop()
        try:
            group = run_config.connect()
        except MeshError as exc:
            return Done(run=assign.run, ok=False, detail=f"could not join: {exc}"[:1000])
        try:
            _echo({"event": "run", "run": assign.run, "rank": assign.rank,
                   "world": assign.world})
            for report in serve_node(group, caps, control=control, jobs=jobs):
                _echo({"event": "report", "run": assign.run, "report": report.to_json()})
        except MeshError as exc:
            return Done(run=assign.run, ok=False, detail=str(exc)[:1000])
        finally:
            group.close()
        ended = control.ended or ""
        return Done(run=assign.run, ok=ended not in ("refused", "coordinator lost"),
                    detail=control.refusal if ended == "refused" else ended)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            previous[sig] = signal.signal(sig, _stop)
        except (ValueError, OSError):  # not the main thread (embedded use)
            pass
    try:
        serve_service(address, secret=config.secret or b"", node_key=config.node_key,
                      caps=caps_for(config).to_json(), serve_run=serve_run, stop=stop,
                      encrypt=config.encrypt, timeout=config.timeout,
                      rejoin_timeout=rejoin_timeout, version=__version__,
                      on_joined=lambda: _echo({"event": "joined", "service": address}))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if signalled:
        name = signal.Signals(signalled[0]).name
        click.echo(f"meshkit node: stopped by {'Ctrl-C' if name == 'SIGINT' else name}",
                   err=True)
        sys.exit(128 + signalled[0])
