"""What a round's transfer can reach on this machine, without meshkit (issue 39's ceiling).

Run (from the repository root, in the dev venv)::

    python benchmarks/round_ceiling.py                          # 100M float32 (400 MB), 5 trials
    python benchmarks/round_ceiling.py --params 500e6 --repeat 5
    python benchmarks/round_ceiling.py --fit add                # the workers' fit: one in-place add
    python benchmarks/round_ceiling.py --repeat 3 --meshkit     # and meshkit's round, CPU per round

Issue 39 asks for a round's transfer at 0.6x of one loopback TCP stream. A
round of 2 workers moves the model 4 times through the coordinator: the state
out to each worker, a contribution back from each. This does exactly that
data movement at its best, with none of meshkit's code, so its rate is what a
*perfect* implementation of a round reaches on this machine and this topology:

* one coordinator (this process) and ``--workers`` worker processes (this
  script with ``--worker``), each connected over a loopback TCP socket;
* the coordinator sends the model to every worker at once, a thread per link,
  straight from the model's memory in 4 MiB segments;
* each worker receives it into one buffer it keeps across rounds (its pages
  were faulted in by the warm-up round, so no round pays the kernel's zeroing),
  does a free fit (``--fit none``: nothing; ``--fit add``: one in-place float32
  add), and sends the buffer back in segments;
* the coordinator reads each link's contribution into that link's 4 MiB
  segment buffer (cache-hot, reused) and folds each segment into a running sum
  as it arrives (copied in if it is the segment's first, ``np.add`` into it if
  not; the sum is kept across rounds too), the links' threads folding at once.

Three variants alternate trial by trial: *plain* (bytes as they are);
*encrypted*: AES-256-GCM per 4 MiB segment as ``meshkit/wire/_channel.py``
seals a segment's frame (``cryptography``'s streaming GCM, a 1 MiB piece
encrypted into a scratch buffer and sent while in cache; the receiver decrypts
in place as the bytes arrive and checks the segment's 16-byte tag), a key per
direction and link, the nonce the round and the segment's number; and
*tagged*: the bytes in clear with each segment's AES-GMAC tag, as a channel
with ``[mesh] encrypt = false`` sends a body. Headers, MACs and
acknowledgements are left out: they are a few bytes per 4 MiB.

Beside each trial, in the same run, one loopback stream of the model's size
per variant (:func:`stream`: another process sends, this one reads, both ends
cache-hot as in ``large_model.raw_stream``; the raw one is the stream issue 39
measures against). Printed: each variant's seconds per round and round
transfer (``2 * workers * model / seconds``), and each trial's round transfer
over the streams measured right before it, median (min-max) over the trials;
the load average with them. Then the CPU seconds of each round's processes and
of each stream's two ends, and the rates those allow on this machine's cores
(:func:`cpu_table`): the load stretches wall clocks many times over, CPU
seconds far less. "MB" is 2**20 bytes, as in ``large_model.py``. A warm-up
round of each variant comes first and is not counted. This is a benchmark,
not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from round_memory import MB  # noqa: E402  (MiB, as large_model.py prints)

SEGMENT = 4 << 20
PIECE = 1 << 20  # the channel's _SEND_PIECE
TAG = 16
#: A round's order to a worker: model bytes, variant (0 stop, 1 plain, 2 encrypted), round.
ORDER = struct.Struct("<QII")
PLAIN, SEALED, TAGGED = 1, 2, 3
#: A worker's CPU seconds (user, system) over a round, sent after its contribution.
CPU = struct.Struct("<dd")
VARIANTS = {"plain": PLAIN, "encrypted": SEALED, "tagged": TAGGED}
#: Each variant's stream, as measure() names it.
STREAMS = {"plain": "raw", "encrypted": "sealed", "tagged": "gmac"}


def _key(link: int, direction: int) -> bytes:
    return bytes((link * 2 + direction + i) % 256 for i in range(32))


def _nonce(round_: int, segment: int) -> bytes:
    return struct.pack("<IQ", round_, segment)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("the other end closed mid-transfer")
        got += n


def send_body(sock: socket.socket, body: memoryview, variant: int, key: bytes, round_: int,
              scratch: memoryview) -> None:
    """``body`` in segments: as it is (plain), each segment sealed by AES-256-GCM
    (encrypted), or in clear followed by its AES-GMAC tag (tagged: ``[mesh] encrypt =
    false``, the body fed to GCM as associated data, as the channel's streaming GMAC)."""
    for index, start in enumerate(range(0, body.nbytes, SEGMENT)):
        segment = body[start:start + SEGMENT]
        if variant == PLAIN:
            sock.sendall(segment)
            continue
        gcm = Cipher(algorithms.AES(key), modes.GCM(_nonce(round_, index))).encryptor()
        for at in range(0, segment.nbytes, PIECE):
            piece = segment[at:at + PIECE]
            if variant == TAGGED:
                gcm.authenticate_additional_data(piece)
                sock.sendall(piece)
                continue
            out = scratch[:piece.nbytes]
            gcm.update_into(piece, out)
            sock.sendall(out)
        gcm.finalize()
        sock.sendall(gcm.tag)


def recv_segments(sock: socket.socket, nbytes: int, variant: int, key: bytes, round_: int,
                  into: memoryview | None, landing: memoryview | None = None):
    """Yield ``(start, view)`` for each segment of a body as it is complete (and checked).

    With ``into`` (the body's whole buffer) each segment lands at its place in it; else
    every segment lands in ``landing`` (one segment's buffer, reused).
    """
    tag = bytearray(TAG)
    for index, start in enumerate(range(0, nbytes, SEGMENT)):
        size = min(SEGMENT, nbytes - start)
        view = into[start:start + size] if into is not None else landing[:size]
        if variant == PLAIN:
            _recv_exact(sock, view)
            yield start, view
            continue
        gcm = Cipher(algorithms.AES(key), modes.GCM(_nonce(round_, index))).decryptor()
        got = 0
        while got < size:  # decrypt (or tag) each read in place while it is in cache
            n = sock.recv_into(view[got:])
            if not n:
                raise ConnectionError("the other end closed mid-transfer")
            if variant == TAGGED:
                gcm.authenticate_additional_data(view[got:got + n])
            else:
                gcm.update_into(view[got:got + n], view[got:got + n])
            got += n
        _recv_exact(sock, memoryview(tag))
        gcm.finalize_with_tag(bytes(tag))
        yield start, view


def worker(address: str, link: int, fit: str) -> None:
    """A worker: receive the model into a kept buffer, fit (free), send it back; repeat."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(struct.pack("<I", link))
    order = bytearray(ORDER.size)
    body: np.ndarray | None = None
    scratch = memoryview(bytearray(PIECE))
    while True:
        _recv_exact(sock, memoryview(order))
        before = resource.getrusage(resource.RUSAGE_SELF)
        nbytes, variant, round_ = ORDER.unpack(order)
        if variant == 0:
            return
        if body is None or body.nbytes != nbytes:
            body = np.empty(nbytes, dtype=np.uint8)  # kept across rounds
        view = memoryview(body)
        for _ in recv_segments(sock, nbytes, variant, _key(link, 0), round_, view):
            pass
        if fit == "add":
            weights = body.view(np.float32)
            np.add(weights, np.float32(1e-3), out=weights)
        send_body(sock, view, variant, _key(link, 1), round_, scratch)
        after = resource.getrusage(resource.RUSAGE_SELF)
        sock.sendall(CPU.pack(after.ru_utime - before.ru_utime,
                              after.ru_stime - before.ru_stime))


def stream(nbytes: int, variant: int = PLAIN) -> tuple[float, float, float]:
    """One loopback TCP stream of ``nbytes`` from another process: (bytes per second, the
    sender's CPU seconds, the reader's), as ``large_model.raw_stream`` measures it (both
    ends cache-hot: a 4 MiB source sent again and again, read into one 4 MiB buffer), the
    encrypted (or tagged) one per 4 MiB segment as the round's links are."""
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()
    pid = os.fork()
    if pid == 0:  # the sender: another process, as a worker is
        code = 1
        try:
            dialer = socket.create_connection(address)
            source = memoryview(bytearray(os.urandom(1 << 20)) * 4)
            scratch = memoryview(bytearray(PIECE))
            before = resource.getrusage(resource.RUSAGE_SELF)
            for start in range(0, nbytes, source.nbytes):
                send_body(dialer, source[:min(source.nbytes, nbytes - start)], variant,
                          _key(9, 0), start // source.nbytes, scratch)
            after = resource.getrusage(resource.RUSAGE_SELF)
            dialer.sendall(CPU.pack(after.ru_utime - before.ru_utime,
                                    after.ru_stime - before.ru_stime))
            dialer.recv(1)
            code = 0
        finally:
            os._exit(code)
    reader, _ = listener.accept()
    listener.close()
    landing = memoryview(bytearray(SEGMENT))
    before = resource.getrusage(resource.RUSAGE_THREAD)
    started = time.perf_counter()
    for start in range(0, nbytes, SEGMENT):
        size = min(SEGMENT, nbytes - start)
        for _ in recv_segments(reader, size, variant, _key(9, 0), start // SEGMENT, None,
                               landing):
            pass
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_THREAD)
    cpu = bytearray(CPU.size)
    _recv_exact(reader, memoryview(cpu))
    reader.sendall(b"x")
    reader.close()
    os.waitpid(pid, 0)
    return (nbytes / elapsed, sum(CPU.unpack(cpu)),
            after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)


class Ceiling:
    """The coordinator's side: ``workers`` worker processes, kept for every round."""

    def __init__(self, params: int, workers: int, fit: str = "none") -> None:
        self.nbytes = params * 4
        self.model = np.random.default_rng(0).standard_normal(params, dtype=np.float32)
        self.total = np.zeros(params, dtype=np.float32)  # the running sum, kept
        segments = -(-self.nbytes // SEGMENT)
        self.locks = [threading.Lock() for _ in range(segments)]
        self.folded = [0] * segments
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        self.procs = [subprocess.Popen([sys.executable, __file__, "--worker",
                                        f"127.0.0.1:{port}", "--link", str(i), "--fit", fit])
                      for i in range(workers)]
        self.links: list[socket.socket] = [None] * workers  # type: ignore[list-item]
        for _ in range(workers):
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.links[struct.unpack("<I", conn.recv(4, socket.MSG_WAITALL))[0]] = conn
        listener.close()
        self.scratch = [memoryview(bytearray(PIECE)) for _ in range(workers)]
        self.landing = [memoryview(bytearray(SEGMENT)) for _ in range(workers)]
        self.round = 0
        #: CPU seconds (user + system) of the last round: the coordinator's, each worker's.
        self.cpu: tuple[float, list[float]] = (0.0, [])
        self._worker_cpu = [0.0] * workers

    def _link(self, link: int, variant: int, errors: list[BaseException]) -> None:
        try:
            sock = self.links[link]
            sock.sendall(ORDER.pack(self.nbytes, variant, self.round))
            send_body(sock, memoryview(self.model).cast("B"), variant, _key(link, 0),
                      self.round, self.scratch[link])
            total = self.total.view(np.uint8)
            for start, view in recv_segments(sock, self.nbytes, variant, _key(link, 1),
                                             self.round, None, self.landing[link]):
                index = start // SEGMENT
                piece = np.frombuffer(view, dtype=np.float32)
                with self.locks[index]:  # the fold, segment by segment as they arrive
                    into = total[start:start + view.nbytes].view(np.float32)
                    if self.folded[index] == 0:
                        np.copyto(into, piece)
                    else:
                        np.add(into, piece, out=into)
                    self.folded[index] += 1
            cpu = bytearray(CPU.size)
            _recv_exact(sock, memoryview(cpu))
            self._worker_cpu[link] = sum(CPU.unpack(cpu))
        except BaseException as exc:  # reported by play()
            errors.append(exc)

    def play(self, variant: int) -> float:
        """One round: seconds from the first byte sent to the last segment folded."""
        self.round += 1
        self.folded = [0] * len(self.folded)
        errors: list[BaseException] = []
        threads = [threading.Thread(target=self._link, args=(i, variant, errors))
                   for i in range(len(self.links))]
        before = resource.getrusage(resource.RUSAGE_SELF)
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_SELF)
        self.cpu = (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime,
                    list(self._worker_cpu))
        if errors:
            raise errors[0]
        if any(count != len(self.links) for count in self.folded):
            raise RuntimeError("a segment was not folded from every worker")
        return seconds

    def close(self) -> None:
        for sock in self.links:
            try:
                sock.sendall(ORDER.pack(0, 0, 0))
            except OSError:
                pass
        for proc in self.procs:
            proc.wait(timeout=60)
        for sock in self.links:
            sock.close()

    def __enter__(self) -> Ceiling:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fmt(values: list[float], unit: str = "", scale: float = 1.0, digits: int = 2) -> str:
    scaled = [v / scale for v in values]
    return (f"{statistics.median(scaled):,.{digits}f}{unit} "
            f"({min(scaled):,.{digits}f}-{max(scaled):,.{digits}f})")


def measure(params: int, workers: int, repeat: int, fit: str, streams: bool = True,
            say: Any = print, meshkit: tuple[str, ...] = ()) -> dict[str, Any]:
    """``repeat`` trials of each variant (alternating), each beside its stream (raw,
    encrypted, tagged): a dict of lists (seconds per variant, each stream's rate by its
    name in :data:`STREAMS`, loads; the CPU seconds of each round, ``cpu plain`` etc.:
    (coordinator, [workers]); of each stream's ends, ``cpu raw`` etc.: (sender, reader))."""
    nbytes = params * 4
    got: dict[str, Any] = {key: [] for name in VARIANTS
                           for key in (name, STREAMS[name], f"cpu {name}",
                                       f"cpu {STREAMS[name]}")}
    got["load"] = []
    for name in meshkit:
        got[f"meshkit {name}"] = []
    with Ceiling(params, workers, fit) as ceiling:
        for variant in VARIANTS.values():  # warm-up: the kept buffers are faulted in here
            ceiling.play(variant)
        for trial in range(repeat):
            if streams:
                for name, variant in VARIANTS.items():
                    rate, sender, reader = stream(nbytes, variant)
                    name = STREAMS[name]
                    got[name].append(rate)
                    got[f"cpu {name}"].append((sender, reader))
            line = []
            for name, variant in VARIANTS.items():
                seconds = ceiling.play(variant)
                got[name].append(seconds)
                got[f"cpu {name}"].append(ceiling.cpu)
                line.append(f"{name} {seconds:.3f} s ({2 * workers * nbytes / seconds / MB:,.0f}"
                            f" MB/s)")
            got["load"].append(os.getloadavg()[0])
            streams_text = (f"; raw stream {got['raw'][-1] / MB:,.0f} MB/s, encrypted stream "
                            f"{got['sealed'][-1] / MB:,.0f} MB/s, tagged stream "
                            f"{got['gmac'][-1] / MB:,.0f} MB/s" if streams else "")
            say(f"# trial {trial + 1}: {', '.join(line)}{streams_text}; "
                f"load {got['load'][-1]:.1f}")
            for name in meshkit:  # meshkit's round, right after the ceiling's
                got[f"meshkit {name}"].append(meshkit_cpu(params, workers, name))
                coord, kids, seconds = got[f"meshkit {name}"][-1]
                say(f"#   meshkit {name}: CPU per round coordinator {coord:.3f} s, workers "
                    f"{kids:.3f} s; {seconds:.2f} s/round; load {os.getloadavg()[0]:.1f}")
    return got


def meshkit_cpu(params: int, workers: int, variant: str, rounds: tuple[int, int] = (2, 5),
                keep_bodies: bool = False) -> tuple[float, float, float]:
    """meshkit's CPU seconds per round with free fits: (coordinator, workers, s/round).

    Two real ``meshkit run`` s (``large_model.one_run``, the synthetic task at ``noise =
    0``, ``[mesh] encrypt`` on for ``encrypted``, off for ``tagged``), of ``rounds[0]``
    and ``rounds[1]`` rounds; the CPU of the longer less the shorter's, over the rounds
    between, is what one more round costs (start-up, the initial model and the imports
    cancel out; each round's checkpoint and evaluation do not). The coordinator's CPU
    is its own, the workers' its reaped children's (``getrusage``).
    """
    from large_model import ROOT, one_run

    runs = [one_run(sys.executable, ROOT, params=params, workers=workers, rounds=count,
                    timeout=600.0, segment_bytes=None, phases=True, noise=0.0,
                    encrypt=variant == "encrypted", keep_bodies=keep_bodies)
            for count in rounds]

    def cpu(run: dict[str, Any], who: str) -> float:
        _, user, system = run["usage"][who]
        return float(user + system)

    extra = rounds[1] - rounds[0]
    return ((cpu(runs[1], "coordinator") - cpu(runs[0], "coordinator")) / extra,
            (cpu(runs[1], "workers") - cpu(runs[0], "workers")) / extra,
            float(runs[1]["seconds"]))


def meshkit_table(got: dict[str, Any], moved: int, nbytes: int) -> str:
    """meshkit's rounds (``--meshkit``) against the ceiling's, by CPU and by wall clock."""
    cores = os.cpu_count() or 1
    lines = [f"\nmeshkit with free fits against the ceiling ({cores} cores): median (min-max)",
             "| meshkit | CPU s per round: coordinator, workers | round bound (MB/s) | "
             "/ ceiling's round bound | / raw stream bound | s/round (wall) | "
             "round transfer / ceiling's (wall) |", "|---|---|---|---|---|---|---|"]
    raw_bounds = [nbytes / max(pair) for pair in got["cpu raw"]]
    for name in VARIANTS:
        runs = got.get(f"meshkit {name}")
        if not runs:
            continue
        best = [moved / ((coord + sum(kids)) / cores) for coord, kids in got[f"cpu {name}"]]
        bound = [moved / ((coord + kids) / cores) for coord, kids, _ in runs]
        lines.append(
            f"| {name} | {fmt([c for c, _, _ in runs], '', 1, 3)}, "
            f"{fmt([k for _, k, _ in runs], '', 1, 3)} | {fmt(bound, '', MB, 0)} | "
            f"{fmt([b / c for b, c in zip(bound, best)], 'x')} | "
            f"{fmt([b / r for b, r in zip(bound, raw_bounds)], 'x')} | "
            f"{fmt([s for _, _, s in runs], '', 1, 2)} | "
            f"{fmt([c / s for (_, _, s), c in zip(runs, got[name])], 'x')} |")
    return "\n".join(lines)


def cpu_table(got: dict[str, Any], moved: int, nbytes: int) -> str:
    """The CPU each byte costs, and the rates the machine's cores allow (a bound the load
    moves far less than wall clocks: CPU seconds are the work, not the wait).

    A stream's two ends run on their own cores, so it can go no faster than its busier
    end: ``model / max(sender CPU, reader CPU)``. A round's processes share the
    machine's cores, so it can go no faster than its total CPU spread over all of them:
    ``2 * workers * model / (CPU of all its processes / cores)``.
    """
    cores = os.cpu_count() or 1
    lines = [f"\nCPU-bound rates ({cores} cores): median (min-max) over the trials",
             "| variant | stream: sender, reader CPU s | round: coordinator, workers CPU s | "
             "stream bound (MB/s) | round bound (MB/s) | round bound / stream bound | "
             "round bound / raw stream bound |",
             "|---|---|---|---|---|---|---|"]
    raw_bounds = [nbytes / max(pair) for pair in got["cpu raw"]]
    for name in VARIANTS:
        ends = got[f"cpu {STREAMS[name]}"]
        rounds = got[f"cpu {name}"]
        stream_bound = [nbytes / max(pair) for pair in ends]
        round_bound = [moved / ((coord + sum(kids)) / cores) for coord, kids in rounds]
        lines.append(
            f"| {name} | {fmt([a for a, _ in ends], '', 1, 3)}, "
            f"{fmt([b for _, b in ends], '', 1, 3)} | "
            f"{fmt([c for c, _ in rounds], '', 1, 3)}, "
            f"{fmt([sum(k) for _, k in rounds], '', 1, 3)} | "
            f"{fmt(stream_bound, '', MB, 0)} | {fmt(round_bound, '', MB, 0)} | "
            f"{fmt([r / b for r, b in zip(round_bound, stream_bound)], 'x')} | "
            f"{fmt([r / b for r, b in zip(round_bound, raw_bounds)], 'x')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6,
                        help="float32 parameters (default 100M: 400 MB)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--fit", choices=("none", "add"), default="none",
                        help="the workers' fit: nothing, or one in-place float32 add")
    parser.add_argument("--meshkit", nargs="*", choices=("encrypted", "tagged"), default=None,
                        help="after each trial, meshkit's own round with free fits (the "
                             "synthetic task at noise = 0; default both variants), its CPU "
                             "per round from runs of 2 and 5 rounds")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--link", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.link, args.fit)
        return
    params = int(args.params)
    nbytes = params * 4
    moved = 2 * args.workers * nbytes
    print(f"# {params:,} float32 parameters ({nbytes / MB:.0f} MB), {args.workers} workers, "
          f"fit {args.fit}, {args.repeat} trials; load {os.getloadavg()}", flush=True)
    chosen = tuple(args.meshkit or ("encrypted", "tagged")) if args.meshkit is not None else ()
    got = measure(params, args.workers, args.repeat, args.fit,
                  say=lambda text: print(text, flush=True), meshkit=chosen)
    print(f"\nraw loopback stream: {fmt(got['raw'], ' MB/s', MB, 0)}; AES-256-GCM encrypted "
          f"stream: {fmt(got['sealed'], ' MB/s', MB, 0)}; AES-GMAC tagged stream: "
          f"{fmt(got['gmac'], ' MB/s', MB, 0)}; encrypted / raw per trial: "
          f"{fmt([s / r for s, r in zip(got['sealed'], got['raw'])], 'x')}; tagged / raw: "
          f"{fmt([s / r for s, r in zip(got['gmac'], got['raw'])], 'x')}")
    print("| round, no meshkit | s/round | round transfer (MB/s) | / raw stream, per trial | "
          "/ its own variant's stream, per trial |")
    print("|---|---|---|---|---|")
    for name in VARIANTS:
        seconds = got[name]
        rates = [moved / s for s in seconds]
        print(f"| {name} | {fmt(seconds, '', 1, 3)} | {fmt(rates, '', MB, 0)} | "
              f"{fmt([r / w for r, w in zip(rates, got['raw'])], 'x')} | "
              f"{fmt([r / w for r, w in zip(rates, got[STREAMS[name]])], 'x')} |")
    print(cpu_table(got, moved, nbytes))
    if chosen:
        print(meshkit_table(got, moved, nbytes))
    print(f"\nload average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
