"""A loopback TCP proxy that reads the frame headers going by: every frame's size, on the wire.

It forwards every byte both ways unchanged and parses each direction's
stream as docs/wire.md lays it out -- the hello and the key confirmation,
then frames (a 64-byte header whose body length sits at byte 24, the body,
the 16-byte tag) -- so a test sees exactly which frames crossed the socket,
whatever the code on either end believes it sent.
"""

from __future__ import annotations

import socket
import struct
import threading

from meshkit import wire

_BODY_LEN = struct.Struct("<Q")
_BODY_LEN_AT = 24
_FLAGS_AT = 5
#: Bytes each end sends before its first frame (no node key): hello, key confirmation.
HANDSHAKE_BYTES = wire.HELLO_SIZE + wire.MAC_SIZE


class FrameParser:
    """Feeds on one direction's bytes; records ``(flags, body length)`` of each frame."""

    def __init__(self) -> None:
        self.frames: list[tuple[int, int]] = []
        self._skip = HANDSHAKE_BYTES
        self._header = bytearray()

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self._skip:
                step = min(self._skip, len(view))
                self._skip -= step
                view = view[step:]
                continue
            need = wire.HEADER_SIZE - len(self._header)
            self._header += view[:need]
            view = view[need:]
            if len(self._header) == wire.HEADER_SIZE:
                (nbytes,) = _BODY_LEN.unpack_from(self._header, _BODY_LEN_AT)
                self.frames.append((self._header[_FLAGS_AT], nbytes))
                self._skip = nbytes + wire.BODY_TAG_SIZE
                self._header = bytearray()


class FrameCountingProxy:
    """Forwards every connection to ``target``, parsing each direction's frames."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        #: One (to the target, from the target) pair of parsers per connection.
        self.parsers: list[tuple[FrameParser, FrameParser]] = []
        self.bytes = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.address = "127.0.0.1:%d" % self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def frames(self) -> list[tuple[int, int]]:
        """Every frame seen, both ways, on every connection: ``(flags, body length)``."""
        with self._lock:
            return [f for pair in self.parsers for parser in pair for f in parser.frames]

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            server = socket.create_connection(self.target, timeout=10)
            pair = (FrameParser(), FrameParser())
            with self._lock:
                self.parsers.append(pair)
            for src, dst, parser in ((client, server, pair[0]), (server, client, pair[1])):
                thread = threading.Thread(target=self._pump, args=(src, dst, parser),
                                          daemon=True)
                thread.start()
                self._threads.append(thread)

    def _pump(self, src: socket.socket, dst: socket.socket, parser: FrameParser) -> None:
        src.settimeout(None)
        while True:
            try:
                chunk = src.recv(1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                for sock in (src, dst):
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                return
            with self._lock:
                parser.feed(chunk)
                self.bytes += len(chunk)
            try:
                dst.sendall(chunk)
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for thread in self._threads:
            thread.join(10)
