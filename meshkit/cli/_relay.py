"""``meshkit relay``: a host relay for the local ranks of one host (docs/scaling-out.md).

The relay dials the coordinator (``--coordinator``), announces the ranks it
carries (``--ranks``) and listens for them (``--bind``); each of those ranks
is started with ``meshkit node --peers RELAY_ADDRESS``, exactly as it would
be pointed at the coordinator. The transport component provides the relay
(``start_relay``); :mod:`meshkit.cli` loads this module only when the
command runs.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import types
from pathlib import Path

import click

from meshkit import plugins, wire
from meshkit.cli._options import parse_options, read_secret
from meshkit.errors import ConfigError
from meshkit.transport import HostRelay, OffersHostRelays

__all__ = ["relay"]


def _ranks(text: str) -> tuple[int, ...]:
    """``"1,2"`` or ``"3-6"`` (or both, comma-separated) -> the ranks."""
    ranks: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        low, dash, high = part.partition("-")
        try:
            if dash:
                ranks.extend(range(int(low), int(high) + 1))
            else:
                ranks.append(int(part))
        except ValueError:
            raise ConfigError(f"--ranks {text!r}: {part!r} is not a rank or a range "
                              f"like 3-6") from None
    if not ranks:
        raise ConfigError("--ranks needs at least one rank (e.g. --ranks 1,2)")
    return tuple(ranks)


@click.command("relay", context_settings={"help_option_names": ["-h", "--help"],
                                          "show_default": True})
@click.option("--coordinator", required=True, metavar="HOST:PORT",
              help="The coordinator's address (its [mesh] bind).")
@click.option("--bind", default="127.0.0.1:0", metavar="HOST:PORT",
              help="Where this host's ranks dial the relay (port 0: any free port).")
@click.option("--world", type=int, required=True,
              help="Ranks in the mesh, coordinator included (as every node is given).")
@click.option("--ranks", "ranks_text", required=True, metavar="LIST",
              help="The ranks this relay carries, e.g. 1,2 or 3-6.")
@click.option("--name", default="", help="The relay's name in logs and errors "
              "(default relay-RANKS).")
@click.option("--transport", default="tcp", help="Transport component providing the relay.")
@click.option("--transport-option", "transport_options", multiple=True, metavar="KEY=VALUE",
              help="A transport option (repeatable), as the nodes are given.")
@click.option("--timeout", type=float, default=30.0,
              help="Read/write timeout in seconds, on both legs.")
@click.option("--segment-bytes", type=int, default=wire.DEFAULT_SEGMENT_BYTES,
              help="The most one frame of a model-sized message carries, on both legs "
                   "([mesh] segment_bytes; a multiple of 65536).")
@click.option("--secret-file", type=click.Path(dir_okay=False), default=None,
              help="File holding the run's shared secret. Env: MESHKIT_SECRET.")
@click.option("--key", "key_file", type=click.Path(dir_okay=False), default=None,
              help="This relay's private key, proven to the coordinator (authorized_nodes "
                   "must allow it for every rank it carries).")
@click.option("--authorized-nodes", "authorized_file", type=click.Path(dir_okay=False),
              default=None, help="Node public keys this relay admits for its ranks (the "
              "[mesh] authorized_nodes format); default: any node holding the secret.")
@click.option("--encrypt/--no-encrypt", default=True,
              help="Encrypt frame bodies on both legs; --no-encrypt matches "
                   "[mesh] encrypt = false.")
@click.option("-v", "--verbose", count=True, help="Log more (-v info, -vv debug) to stderr.")
def relay(coordinator: str, bind: str, world: int, ranks_text: str, name: str, transport: str,
          transport_options: tuple[str, ...], timeout: float, segment_bytes: int,
          secret_file: str | None,
          key_file: str | None, authorized_file: str | None, encrypt: bool,
          verbose: int) -> None:
    """A host relay: one connection to the coordinator for this host's ranks.

    It folds its ranks' contributions into one per round and fans the
    coordinator's state out to them, so the coordinator's traffic grows
    with the relays, not the ranks. It decrypts what passes through it:
    run it on the host whose ranks it carries.

    Prints one JSON line {"event": "relay", "address": ...} once it listens
    and {"event": "report", ...} when the run ends; exits 0 when the
    coordinator ended the run, 2 when it was refused or lost it.
    """
    logging.basicConfig(
        level=logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s meshkit relay %(levelname)s %(message)s", stream=sys.stderr)
    problem = wire.check_segment_bytes(segment_bytes, "--segment-bytes")
    if problem:
        raise ConfigError(problem)
    secret = read_secret(secret_file)
    node_key = wire.load_node_key(key_file, "--key") if key_file else None
    authorized = (wire.load_authorized_nodes(Path(authorized_file), "--authorized-nodes")
                  if authorized_file else None)
    pset = plugins.default()
    component = pset.registry.get("transport", transport)
    table = (parse_options(transport_options, component.options, flag="--transport-option",
                           table="[transport]") if transport_options else None)
    factory = pset.create("transport", transport, table)
    if not isinstance(factory, OffersHostRelays):
        raise ConfigError(f"transport {transport!r} offers no host relay; the built-in tcp "
                          f"transport does")
    host_relay: HostRelay = factory.start_relay(
        coordinator=coordinator, bind=bind, world=world, ranks=_ranks(ranks_text),
        secret=secret, name=name, timeout=timeout, encrypt=encrypt, node_key=node_key,
        authorized_nodes=authorized, segment_bytes=segment_bytes)

    def _stop(signum: int, frame: types.FrameType | None) -> None:
        host_relay.close(f"stopped by {signal.Signals(signum).name}")

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            signal.signal(sig, _stop)
        except (ValueError, OSError):  # not the main thread (embedded use)
            pass
    click.echo(json.dumps({"event": "relay", "name": host_relay.name,
                           "address": host_relay.address,
                           "ranks": sorted(host_relay.ranks)}))
    sys.stdout.flush()
    report = host_relay.serve()
    click.echo(json.dumps({"event": "report", "report": report.to_json()}))
    if report.stopped.startswith("coordinator lost"):
        click.echo(f"meshkit relay: {report.stopped}", err=True)
        sys.exit(2)
