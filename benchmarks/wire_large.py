"""One big message over one channel between two processes: time, CPU and page faults (issue 39).

Run (from the repository root, in the dev venv)::

    python benchmarks/wire_large.py --mb 400 --repeat 3

A pair of processes over loopback TCP (port 0), a ``wire`` channel pair with
the default segment size and encryption on (``--clear``: GMAC only). The
sender sends one ``--mb`` MB float32 array message ``--repeat`` times; the
receiver reads each (``recv``) and drops it. Printed per side: MB/s (median,
min-max, the receiver's clock: from the first byte wanted to the message
decoded), user and system CPU seconds and minor page faults per message
(``getrusage``); beside it a raw loopback TCP stream of the same size
(4 MiB sends into one preallocated buffer). A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from meshkit import wire

SECRET = b"correct horse battery staple 123"
MB = 1e6


def usage() -> tuple[float, float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def raw(nbytes: int) -> float:
    a, b = _tcp()
    pid = os.fork()
    if pid == 0:
        b.close()
        data = memoryview(np.ones(nbytes, dtype=np.uint8))
        for s in range(0, nbytes, 4 << 20):
            a.sendall(data[s:s + (4 << 20)])
        os._exit(0)
    a.close()
    buf = memoryview(np.empty(nbytes, dtype=np.uint8))
    got = 0
    start = time.perf_counter()
    while got < nbytes:
        got += b.recv_into(buf[got:], min(nbytes - got, 4 << 20))
    took = time.perf_counter() - start
    os.waitpid(pid, 0)
    b.close()
    return nbytes / took


def _tcp() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        dialer = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
    return dialer, accepted


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=400)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--clear", action="store_true", help="GMAC only, no encryption")
    parser.add_argument("--recycle", type=int, default=0,
                        help="the receiver keeps this many bodies above 64 MiB for reuse "
                             "(wire.recycle_large_messages), as a worker does")
    args = parser.parse_args()
    nbytes = int(args.mb * MB) // 4 * 4
    a, b = _tcp()
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        b.close()
        os.close(rd)
        state = {"w": np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32)}
        ch = wire.handshake(a, SECRET, rank=1, world=2, timeout=60, encrypt=not args.clear)
        times = []
        for _ in range(args.repeat):
            before = usage()
            ch.recv(timeout=None)  # go
            ch.send(1, 1, state)
            after = usage()
            times.append(tuple(y - x for x, y in zip(before, after)))
        ch.recv(timeout=None)
        os.write(wr, repr(times).encode())
        os.close(wr)
        os._exit(0)
    a.close()
    os.close(wr)
    ch = wire.handshake(b, SECRET, rank=0, world=2, timeout=60, encrypt=not args.clear)
    wire.recycle_large_messages(args.recycle)
    rates, costs = [], []
    for _ in range(args.repeat):
        before = usage()
        start = time.perf_counter()
        ch.send(2, 0, {})
        frame = ch.recv(timeout=None)
        took = time.perf_counter() - start
        after = usage()
        assert frame.nbytes >= nbytes
        del frame
        rates.append(nbytes / took)
        costs.append(tuple(y - x for x, y in zip(before, after)))
    ch.send(2, 0, {})
    sent = eval(os.read(rd, 1 << 16).decode())
    os.waitpid(pid, 0)
    raws = [raw(nbytes) for _ in range(args.repeat)]

    def cpu(rows: list) -> str:
        if len(rows) > 10:  # many messages: totals over them all
            return (f"in all: user {sum(r[0] for r in rows):.2f} s, sys "
                    f"{sum(r[1] for r in rows):.2f} s, minflt {sum(r[2] for r in rows)}")
        return (f"user {statistics.median(r[0] for r in rows):.2f} s, sys "
                f"{statistics.median(r[1] for r in rows):.2f} s ({', '.join(f'{r[1]:.2f}' for r in rows)}), minflt "
                f"{statistics.median(r[2] for r in rows):.0f} (in order: "
                f"{', '.join(str(r[2]) for r in rows)})")

    print(f"{nbytes / MB:.0f} MB message, {'GMAC' if args.clear else 'AES-256-GCM'}, "
          f"segment {ch.segment_bytes} B, {args.recycle} bodies recycled, "
          f"load {os.getloadavg()[0]:.2f}")
    shown = "" if len(rates) > 10 else f"; in order: {', '.join(f'{r / MB:.0f}' for r in rates)}"
    print(f"  channel: {statistics.median(rates) / MB:.0f} MB/s "
          f"({min(rates) / MB:.0f}-{max(rates) / MB:.0f}{shown})")
    print(f"  receiver per message: {cpu(costs)}")
    print(f"  sender per message:   {cpu(sent)}")
    print(f"  raw stream: {statistics.median(raws) / MB:.0f} MB/s "
          f"({min(raws) / MB:.0f}-{max(raws) / MB:.0f})")


if __name__ == "__main__":
    main()
