"""The hello exchange: how a connected socket becomes an authenticated :class:`Channel`.

Both ends send an 80-byte hello at once (no dialer/listener asymmetry), read
the peer's magic and protocol version first (so two versions always tell each
other apart), derive the keys from the shared secret, the X25519 value of the
two ephemeral keys the hellos carry and both hellos, and prove they hold them
with a 32-byte confirmation MAC. Only then are the peer's claims (world size,
rank, job, encryption and MAC flags) trusted enough to be checked and
reported as facts. An end with a node key then signs the transcript (its
public key and a 64-byte Ed25519 signature), and the other checks the
signature; whether that key may join is the transport's decision. One
deadline bounds the whole exchange, and every failure closes the socket so
the peer never waits on it.
"""

from __future__ import annotations

import hmac
import logging
import socket
import struct
import time
from typing import Callable, Sequence

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import (
    X25519PrivateKey,
    X25519PublicKey,
)

from meshkit.errors import AuthenticationError, ConfigError, PeerLostError, WireError
from meshkit.wire._channel import DEFAULT_MAX_FRAME, DEFAULT_MAX_MESSAGE, Channel
from meshkit.wire._codec import (
    _HELLO,
    _HELLO_PREFIX,
    _KNOWN_HELLO_FLAGS,
    DEFAULT_SEGMENT_BYTES,
    HELLO_FLAG_NO_MAC,
    HELLO_FLAG_NODE_KEY,
    HELLO_FLAG_PLAINTEXT,
    HELLO_FLAG_RESUME,
    HELLO_MAGIC,
    HELLO_SIZE,
    MAC_SIZE,
    PROTOCOL_VERSION,
    SEGMENT_UNIT,
    SESSION_SIZE,
    Hello,
    check_segment_bytes,
)
from meshkit.wire._identity import (
    PUBLIC_KEY_SIZE,
    SIGNATURE_SIZE,
    NodeKey,
    verify_signature,
)
from meshkit.wire._keys import _check_secret, _derive_keys
from meshkit.wire._partials import PartialStore
from meshkit.wire._resume import Transfer, check_offers, exchange_offers
from meshkit.wire._sockets import _configure, _peer_address, _read_exact, close_socket

log = logging.getLogger(__name__)


def handshake(
    sock: socket.socket,
    secret: bytes | None,
    *,
    rank: int,
    world: int,
    role: int = 0,
    session: bytes = b"",
    timeout: float = 30.0,
    handshake_timeout: float | None = None,
    max_frame: int = DEFAULT_MAX_FRAME,
    encrypt: bool = True,
    node_key: NodeKey | None = None,
    benchmark_only_disable_mac: bool = False,
    segment: int = DEFAULT_SEGMENT_BYTES,
    max_message: int = DEFAULT_MAX_MESSAGE,
    offers: Sequence[Transfer] | Callable[[Channel], Sequence[Transfer]] = (),
    partials: PartialStore | None = None,
) -> Channel:
    """Authenticate a connected stream socket and return a :class:`Channel`.

    Both ends call this (there is no dialer/listener asymmetry). ``rank`` and
    ``world`` are what this end announces; the peer's claims are in
    ``channel.peer`` once this returns (the transport checks rank ranges and
    duplicates). ``role`` is an opaque 16-bit value for the transport.
    ``session`` (at most 16 bytes) identifies a job: two ends with different
    non-empty sessions refuse each other. ``timeout`` is the channel's
    read/write stall timeout; ``handshake_timeout`` (default ``timeout``)
    bounds the whole handshake.

    ``encrypt`` (the default) encrypts every frame body with AES-256-GCM;
    ``encrypt=False`` only authenticates them (``[mesh] encrypt = false``).
    Both ends must agree: a mismatch is a :class:`WireError` on both.
    ``node_key`` (a :class:`NodeKey`) is proven to the peer by signing this
    handshake's transcript; the peer's proven key, if it sent one, is
    ``channel.peer_key`` (32 raw bytes, or None).

    ``segment`` (a multiple of 64 KiB, ``[mesh] segment_bytes``) is the
    largest segment this end wants a big message cut into; it is announced
    in the hello, and both directions of the link cut at the smaller of the
    two ends' (``channel.segment_bytes``). ``max_message`` bounds a
    segmented message this end accepts, checked before its buffer exists.

    ``offers`` are this end's transfers a cut left part-way (those of them
    sent segmented and not to the end): the peer answers each with the
    segment to continue from (``channel.resume_answers``), and
    :meth:`Channel.send_resumable` continues there. ``offers`` may also be a
    function of the authenticated channel (its ``peer`` and ``peer_key``)
    returning them, for an end that learns who dialed it only from the
    hello: such an end always sends an offer, of no transfers if it has none
    for that peer. ``partials`` is where
    this end keeps the transfers cut while it received them, for their
    senders to offer; without one it answers every offer "start over".

    ``benchmark_only_disable_mac`` turns frame MACs off (the handshake is
    still authenticated) so benchmarks can measure the MAC's cost. Both ends
    must set it (it implies ``encrypt=False``); it is never read from
    configuration and a peer cannot ask for it.

    Raises :class:`AuthenticationError` (wrong secret, reflection),
    :class:`WireError` (not meshkit, version/world/session mismatch) or
    :class:`PeerLostError` (peer closed or stalled), and closes ``sock``.
    """
    try:
        secret = _check_secret(secret)
        if not 0 <= rank < world:
            raise ConfigError(f"rank {rank} is out of range for a world of {world}")
        if len(session) > SESSION_SIZE:
            raise ConfigError(f"session id must be at most {SESSION_SIZE} bytes, "
                              f"got {len(session)}")
        if not 0 < max_frame < 1 << 63:
            raise ConfigError(f"max_frame must be a positive byte count, got {max_frame}")
        problem = check_segment_bytes(segment, "segment")
        if problem:
            raise ConfigError(problem)
        if not 0 < max_message < 1 << 63:
            raise ConfigError(f"max_message must be a positive byte count, got {max_message}")
        offering = callable(offers)
        if not callable(offers):
            offers = check_offers(offers)
            offering = bool(offers)
    except ConfigError:
        close_socket(sock)  # as on every other error: the peer must not wait on it
        raise
    deadline_budget = timeout if handshake_timeout is None else handshake_timeout
    deadline = time.monotonic() + deadline_budget
    address = _peer_address(sock)
    where = f"peer at {address}" if address else "peer"
    encrypt = encrypt and not benchmark_only_disable_mac
    flags = ((HELLO_FLAG_NO_MAC if benchmark_only_disable_mac else 0)
             | (0 if encrypt else HELLO_FLAG_PLAINTEXT)
             | (HELLO_FLAG_NODE_KEY if node_key is not None else 0)
             | (HELLO_FLAG_RESUME if offering else 0))
    # The nonce field is a fresh X25519 public key: random to anyone else,
    # and the key exchange that keeps the session keys out of reach of
    # anyone who only knows the shared secret.
    ephemeral = X25519PrivateKey.generate()
    nonce = ephemeral.public_key().public_bytes(serialization.Encoding.Raw,
                                                serialization.PublicFormat.Raw)
    mine = _HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, flags, role, segment // SEGMENT_UNIT,
                       rank, world, max_frame,
                       session.ljust(SESSION_SIZE, b"\x00"), nonce)
    try:
        _configure(sock)
        sock.settimeout(deadline_budget)
        try:
            sock.sendall(mine)
        except socket.timeout:
            raise PeerLostError(f"{where} did not take our handshake within "
                                f"{deadline_budget} s; dropped") from None
        except OSError as exc:
            raise PeerLostError(f"{where} failed during the handshake: {exc}") from None
        prefix = _read_exact(sock, _HELLO_PREFIX, "handshake", where, deadline)
        magic, version = struct.unpack("<8sH", prefix)
        if magic != HELLO_MAGIC:
            raise WireError(f"{where} is not a meshkit node: its first bytes are {prefix[:8]!r}, "
                            f"expected {HELLO_MAGIC!r}; check the address and port")
        if version != PROTOCOL_VERSION:
            raise WireError(f"{where} speaks meshkit wire protocol version {version}, this node "
                            f"speaks version {PROTOCOL_VERSION}; run the same meshkit release "
                            "on every node")
        theirs = prefix + _read_exact(sock, HELLO_SIZE - _HELLO_PREFIX, "handshake", where,
                                      deadline)
        fields = _HELLO.unpack(theirs)
        peer = Hello(version=fields[1], flags=fields[2], role=fields[3], rank=fields[5],
                     world=fields[6], max_frame=fields[7], session=fields[8].rstrip(b"\x00"),
                     nonce=fields[9], address=address, segment=fields[4] * SEGMENT_UNIT)
        if peer.nonce == nonce:
            raise AuthenticationError(f"{where} echoed our own handshake back (a reflection); "
                                      "refused")
        try:
            shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(peer.nonce))
        except ValueError:  # a low-order point: the shared value would be all zeros
            raise AuthenticationError(f"{where} sent an invalid key-exchange value in its "
                                      "hello; refused") from None
        keys = _derive_keys(secret, mine, theirs, shared)
        try:
            sock.sendall(keys.confirm_mine)
        except (socket.timeout, OSError) as exc:
            raise PeerLostError(f"{peer.describe()} failed during the handshake: {exc}") from None
        confirm = _read_exact(sock, MAC_SIZE, "key confirmation", peer.describe(), deadline)
        if not hmac.compare_digest(confirm, keys.confirm_theirs):
            raise AuthenticationError(
                f"{peer.describe()} failed authentication: its key confirmation does not match "
                "ours (wrong secret? every node must use the same shared secret)")
        # From here on the peer's hello is authenticated, so its claims are
        # worth reporting as facts.
        if peer.world != world:
            raise WireError(f"{peer.describe()} is in a world of {peer.world}, this node "
                            f"(rank {rank}) is in a world of {world}; every node must be "
                            "started with the same world size")
        if not 0 <= peer.rank < peer.world:
            raise WireError(f"{peer.describe()}: rank {peer.rank} is out of range 0..{world - 1}")
        if peer.session and session and peer.session != session.rstrip(b"\x00"):
            raise WireError(f"{peer.describe()} belongs to job {peer.session.hex()}, this node to "
                            f"job {session.hex()}; refused")
        if not peer.segment:
            raise WireError(f"{peer.describe()} announced no segment size in its hello "
                            f"(version {PROTOCOL_VERSION} needs one); refused")
        if peer.flags & ~_KNOWN_HELLO_FLAGS:
            raise WireError(f"{peer.describe()} sent unknown handshake flags {peer.flags:#x}")
        if (peer.flags & HELLO_FLAG_NO_MAC) != (flags & HELLO_FLAG_NO_MAC):
            raise WireError(f"{peer.describe()} has frame MACs "
                            f"{'off' if peer.flags & HELLO_FLAG_NO_MAC else 'on'}, this node has "
                            f"them {'off' if benchmark_only_disable_mac else 'on'}; MACs may "
                            "only be disabled on both ends, for benchmarks")
        if (peer.flags & HELLO_FLAG_PLAINTEXT) != (flags & HELLO_FLAG_PLAINTEXT):
            theirs_on = not peer.flags & HELLO_FLAG_PLAINTEXT
            raise WireError(
                f"{peer.describe()} has frame encryption {'on' if theirs_on else 'off'}, this "
                f"node has it {'on' if encrypt else 'off'}; set `[mesh] encrypt` the same on "
                "every node (encryption is on unless `encrypt = false`)")
        peer_key = None
        if node_key is not None:
            proof = node_key.public + node_key.sign(keys.transcript, nonce)
            try:
                sock.sendall(proof)
            except (socket.timeout, OSError) as exc:
                raise PeerLostError(f"{peer.describe()} failed during the handshake: "
                                    f"{exc}") from None
        if peer.flags & HELLO_FLAG_NODE_KEY:
            proof = _read_exact(sock, PUBLIC_KEY_SIZE + SIGNATURE_SIZE, "node key proof",
                                peer.describe(), deadline)
            peer_key = proof[:PUBLIC_KEY_SIZE]
            verify_signature(peer_key, proof[PUBLIC_KEY_SIZE:], keys.transcript, peer.nonce)
        sock.settimeout(timeout)
    except BaseException as exc:
        log.debug("handshake with %s failed: %s", where, exc)
        close_socket(sock)
        raise
    log.debug("authenticated %s (role %d)", peer.describe(), peer.role)
    channel = Channel(sock, keys=keys, rank=rank, world=world, peer=peer, timeout=timeout,
                      max_frame=max_frame, mac=not benchmark_only_disable_mac, encrypt=encrypt,
                      segment=segment, max_message=max_message, peer_key=peer_key,
                      partials=partials)
    if offering or peer.flags & HELLO_FLAG_RESUME:
        # Version 5: the offer of cut transfers and its answer (docs/wire.md §2.5).
        try:
            if callable(offers):
                offers = check_offers(offers(channel))
            exchange_offers(channel, offers, partials, bool(peer.flags & HELLO_FLAG_RESUME),
                            offering=offering)
        except BaseException as exc:
            log.debug("resume offer with %s failed: %s", peer.describe(), exc)
            channel.close()
            raise
    return channel
