"""A node's side of the service: join once, serve run after run, rejoin by itself.

:func:`serve_service` dials the service, proves the shared secret (and the
node key, if any) in the handshake, says HELLO and then serves each ASSIGN
by calling ``serve_run`` (which joins that run's mesh exactly as
``meshkit node --peers`` would, with the rank, world and secret the service
chose) and answering DONE. When the service goes away (a restart, a crash,
a network cut) the node dials again, with a growing pause of at most
:data:`MAX_PAUSE`, until ``rejoin_timeout`` seconds have passed without a
service; a service that refuses the node (its key is not admitted) ends it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, Callable

from meshkit import wire
from meshkit.errors import AuthenticationError, PeerLostError, RefusedError, WireError
from meshkit.service._protocol import (ASSIGN, REFUSED, SESSION, Assign, Done, Hello, Refused,
                                       parse, send)

__all__ = ["serve_service", "dial_service", "split_address", "MAX_PAUSE", "MAX_FRAME"]

log = logging.getLogger(__name__)

#: The longest pause between two attempts to reach the service.
MAX_PAUSE = 2.0
#: A service frame carries a few hundred bytes of JSON; nothing near this.
MAX_FRAME = 1 << 20


def split_address(address: str, what: str = "--service") -> tuple[str, int]:
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RefusedError(f"{what} {address!r}: expected HOST:PORT, the service's node "
                           f"address (`meshkit serve` prints it, and writes it to "
                           f"STATE_DIR/service.json)")
    return host.strip("[]"), int(port)


def dial_service(address: str, *, secret: bytes, node_key: Any, encrypt: bool,
                 timeout: float) -> wire.Channel:
    """An authenticated channel to the service (PeerLostError when it cannot be reached)."""
    host, port = split_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise PeerLostError(f"cannot reach the service at {address}: {exc}") from None
    return wire.handshake(sock, secret, rank=1, world=2, session=SESSION, timeout=timeout,
                          max_frame=MAX_FRAME, encrypt=encrypt, node_key=node_key)


def serve_service(address: str, *, secret: bytes, node_key: Any, caps: dict[str, Any],
                  serve_run: Callable[[Assign], Done], stop: threading.Event,
                  encrypt: bool = True, timeout: float = 30.0, rejoin_timeout: float = 300.0,
                  version: str = "", on_joined: Callable[[], None] | None = None) -> int:
    """Serve the service's runs until ``stop`` is set; returns how many runs were served.

    Raises :class:`RefusedError` when the service refuses this node, and
    :class:`PeerLostError` when no service answered for ``rejoin_timeout``
    seconds.
    """
    served = 0
    lost_since: float | None = None
    pause = 0.05
    while not stop.is_set():
        try:
            channel = dial_service(address, secret=secret, node_key=node_key, encrypt=encrypt,
                                   timeout=timeout)
        except AuthenticationError:
            raise  # a wrong secret or key does not get better by retrying
        except (PeerLostError, WireError) as exc:
            now = time.monotonic()
            lost_since = now if lost_since is None else lost_since
            if now - lost_since > rejoin_timeout:
                raise PeerLostError(f"no service at {address} for {rejoin_timeout:g} s "
                                    f"(last: {exc}); start the node again once it is up") from None
            log.info("service not reachable (%s); trying again in %.2f s", exc, pause)
            stop.wait(pause)
            pause = min(pause * 2, MAX_PAUSE)
            continue
        lost_since, pause = None, 0.05
        try:
            send(channel, Hello(caps=caps, version=version))
            if on_joined is not None:
                on_joined()
            while not stop.is_set():
                try:
                    frame = channel.recv(timeout=0.5)
                except wire.RecvTimeout:
                    continue
                message = parse(frame, "the service")
                if isinstance(message, Refused) or frame.tag == REFUSED:
                    raise RefusedError(f"the service refused this node: {message.detail}")
                if frame.tag == ASSIGN:
                    log.info("serving run %s as rank %d of %d", message.run, message.rank,
                             message.world)
                    done = serve_run(message)
                    served += 1
                    send(channel, done)
        except (PeerLostError, WireError) as exc:
            if isinstance(exc, AuthenticationError):
                raise
            log.info("lost the service (%s); rejoining", exc)
        finally:
            channel.close()
    return served
