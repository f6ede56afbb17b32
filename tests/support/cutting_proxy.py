"""A protocol-blind TCP proxy on 127.0.0.1 that cuts a connection after a set number of bytes.

It knows nothing of meshkit: it accepts a connection, dials the upstream
address, and copies bytes both ways. The i-th connection it accepts is cut
(both of its sockets shut down and closed) once ``cuts[i]`` bytes have
passed from the dialer to the upstream (None, or past the end of ``cuts``:
never cut); ``down_cuts`` does the same for the bytes from the upstream
to the dialer. It counts the bytes it forwards each way, per connection, so a
test can say how much crossed after a reconnect without trusting either end.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence

_CHUNK = 64 << 10
# A pump waits this long for bytes before it gives the connection up (bounds every loop).
_IDLE = 60.0


class Link:
    """One proxied connection: bytes forwarded each way, and whether it was cut."""

    def __init__(self, client: socket.socket, upstream: socket.socket, cut: int | None,
                 down_cut: int | None = None) -> None:
        self.client = client
        self.upstream = upstream
        self.cut_at = cut
        self.down_cut_at = down_cut
        #: Bytes read from the dialer and forwarded upstream (counted before they are written).
        self.up = 0
        #: Bytes read from upstream and forwarded to the dialer.
        self.down = 0
        self.cut = threading.Event()
        self.closed = threading.Event()
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            for sock in (self.client, self.upstream):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
            self.closed.set()

    def pump(self, source: socket.socket, sink: socket.socket, upward: bool) -> None:
        source.settimeout(_IDLE)
        try:
            while True:
                limit = _CHUNK
                at, done = (self.cut_at, self.up) if upward else (self.down_cut_at, self.down)
                if at is not None:
                    limit = min(limit, at - done)
                    if limit <= 0:
                        self.cut.set()
                        break
                data = source.recv(limit)
                if not data:
                    break
                if upward:
                    self.up += len(data)
                else:
                    self.down += len(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            self.close()


class CuttingProxy:
    """Listen on 127.0.0.1 (port 0) and proxy each connection to ``upstream``."""

    def __init__(self, upstream: tuple[str, int], cuts: Sequence[int | None] = (),
                 down_cuts: Sequence[int | None] = ()) -> None:
        self.upstream = upstream
        self.cuts = list(cuts)
        self.down_cuts = list(down_cuts)
        self.links: list[Link] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = self._listener.getsockname()
        self._accepted = threading.Condition()
        self._thread = threading.Thread(target=self._serve, name="cutting-proxy", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self.upstream, timeout=10)
            upstream.settimeout(None)
            index = len(self.links)
            link = Link(client, upstream, self.cuts[index] if index < len(self.cuts) else None,
                        self.down_cuts[index] if index < len(self.down_cuts) else None)
            for source, sink, upward in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=link.pump, args=(source, sink, upward), daemon=True,
                                 name=f"cutting-proxy-{index}-{'up' if upward else 'down'}").start()
            with self._accepted:
                self.links.append(link)
                self._accepted.notify_all()

    def link(self, index: int, timeout: float = 10.0) -> Link:
        """The ``index``-th connection, once accepted."""
        with self._accepted:
            if not self._accepted.wait_for(lambda: len(self.links) > index, timeout):
                raise AssertionError(f"the proxy accepted {len(self.links)} connections, "
                                     f"waited for {index + 1}")
            return self.links[index]

    def close(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone may not)
        except OSError:
            pass
        self._listener.close()
        for link in list(self.links):
            link.close()
        self._thread.join(5)

    def __enter__(self) -> CuttingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
