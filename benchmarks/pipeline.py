"""Pipelined inference through 3 ranks on 127.0.0.1, against a raw-socket relay.

What is measured, in one run:

* **meshkit**: a coordinator (this process, ``tcp`` transport, the default
  frames: HMAC-SHA256 on every header, AES-256-GCM encrypted bodies) and three
  ``meshkit node`` subprocesses, each serving an ``identity`` stage (so the
  transport and the node driver are measured, not a model). ``--board`` makes the middle rank a
  ``meshkit node --board loopback`` fixed-function rank instead (adds the
  board's deadline thread and the per-activation length checks).
* **raw relay**: the same bytes through the same hops with plain sockets and
  no framing or authentication: three relay subprocesses that ``recv_into``
  a preallocated buffer and ``sendall`` it on, fed and drained by this
  process with the same number of activations in flight.

Topology: ``--topology mesh`` (the default) connects ranks directly, so both
systems move each activation over the same 4 hops (coordinator -> r1 -> r2 ->
r3 -> coordinator). ``--topology star`` routes worker-to-worker frames
through the coordinator (6 hops); the raw relay then takes the same 6 hops
(each relay sends back to a forwarder in this process).

Reported per size: activations/s with ``--in-flight`` activations in flight
(throughput) and the ratio meshkit / raw; the round trips with one
activation in flight as a distribution (p50 and p99 of the best run) and
the p50 ratio; the CPU every process spent per activation; every run's
figures (the spread); and the floor: one hop's per-frame work on one thread
(:func:`hop_floor`), which bounds both; and the *wire-level chain*
(:func:`wire_chain`): the same hops, one activation in flight, each relay doing
only the wire's receive and send, so meshkit's p50 against the chain's is what
the layers above the wire add and the chain's against the raw relay's is the
wire's share. ``MESHKIT_BENCH_PROFILE_RANK=r`` profiles node rank ``r`` on
every thread. Targets (issue 18), authentication
on: p50 latency at 1 KiB <= 5x the raw relay's, 1 KiB at one activation a
frame >= 0.3x, 1 MiB >= 0.6x.

``--compare-encryption`` also builds the same pipeline with ``encrypt=False``
(``[mesh] encrypt = false``, nodes ``--no-encrypt``: authenticated only,
header HMAC and body GMAC), keeps both up and alternates their timed runs,
and reports the authenticated-only throughput and what encryption costs
(issue 17's target: <= 10 % at 16 MiB; add ``--sizes 16MiB``).

    .venv/bin/python benchmarks/pipeline.py                # mesh, 1 KiB and 1 MiB
    .venv/bin/python benchmarks/pipeline.py --topology star --board
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from meshkit.train import free_ports

SIZES = {"1KiB": 1024, "1MiB": 1 << 20, "16MiB": 16 << 20}

#: When each output of the last timed run arrived (``time.perf_counter()``),
#: the run's start first: with one activation in flight the gaps between them
#: are the round trips, whose p50 and p99 the table reports.
LAST_STAMPS: list[float] = []


def round_trips(stamps: list[float]) -> np.ndarray:
    """Seconds between consecutive outputs of a run with one activation in flight."""
    return np.diff(np.asarray(stamps, dtype=np.float64))


# -- raw relay ------------------------------------------------------------------


def cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system) of this process and ``pids`` so far, in seconds.

    Differences of this around a run give the CPU each system spends per
    activation: with every process on the same two cores, the throughput
    ratio cannot beat the inverse ratio of CPU per activation.
    """
    times = os.times()
    total = times.user + times.system
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total



def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return False
        got += k
    return True


def relay_main(listen_port: int, next_port: int, nbytes: int) -> None:
    """One raw hop: accept upstream, dial downstream, copy fixed-size messages."""
    listener = socket.create_server(("127.0.0.1", listen_port))
    down = socket.create_connection(("127.0.0.1", next_port))
    down.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    print("ready", flush=True)
    up, _ = listener.accept()
    up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(nbytes))
    while _recv_exact(up, buf):
        down.sendall(buf)
    down.close()


def _spawn_relay(listen_port: int, next_port: int, nbytes: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--relay", str(listen_port), str(next_port), str(nbytes)],
        stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _forwarder(listen: socket.socket, next_port: int, nbytes: int) -> threading.Thread:
    """In-process hop for the star variant: what the coordinator's relay does."""

    def run() -> None:
        up, _ = listen.accept()
        down = socket.create_connection(("127.0.0.1", next_port))
        for s in (up, down):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = memoryview(bytearray(nbytes))
        while _recv_exact(up, buf):
            down.sendall(buf)
        down.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def raw_relay(nbytes: int, count: int, in_flight: int, star: bool,
              batch: int = 1) -> tuple[float, float]:
    """Seconds to push ``count`` activations of ``nbytes`` around the relay chain,
    and the CPU seconds every process of the relay spent meanwhile.

    Activations travel ``batch`` to a message, exactly as meshkit packs them
    into frames, so both move the same messages over the same hops.
    """
    count = -(-count // batch)
    in_flight = max(1, in_flight // batch)
    nbytes *= batch
    sink = socket.create_server(("127.0.0.1", 0))
    sink_port = sink.getsockname()[1]
    procs = []
    try:
        next_port = sink_port
        for _ in range(3):
            if star:
                # worker -> coordinator (forwarder) -> next worker
                fwd = socket.create_server(("127.0.0.1", 0))
                _forwarder(fwd, next_port, nbytes)
                next_port = fwd.getsockname()[1]
            port = free_ports(1)[0]
            procs.append(_spawn_relay(port, next_port, nbytes))
            next_port = port
        src = socket.create_connection(("127.0.0.1", next_port))
        src.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out, _ = sink.accept()
        window = threading.Semaphore(in_flight)
        payload = memoryview(np.random.default_rng(0).bytes(nbytes))

        def feed() -> None:
            for _ in range(count):
                window.acquire()
                src.sendall(payload)

        buf = memoryview(bytearray(nbytes))
        pids = [p.pid for p in procs]
        cpu = cpu_seconds(pids)
        started = time.perf_counter()
        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        stamps = LAST_STAMPS
        stamps[:] = [started]
        for _ in range(count):
            if not _recv_exact(out, buf):
                raise RuntimeError("relay chain closed early")
            window.release()
            stamps.append(time.perf_counter())
        elapsed = time.perf_counter() - started
        feeder.join()
        cpu = cpu_seconds(pids) - cpu
        src.close()
        out.close()
        return elapsed, cpu
    finally:
        for p in procs:
            p.wait(10) if p.poll() is not None else None
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(10)
        sink.close()


# -- the floor: one hop's work on one thread -------------------------------------------


def hop_floor(nbytes: int, count: int = 4000) -> dict[str, float]:
    """CPU microseconds one hop's per-frame work takes on one thread, no waiting.

    Over a socketpair, with nothing else in the way: the raw relay's hop
    (``sendall`` + ``recv_into`` a preallocated buffer) and meshkit's wire
    hop (``Channel.send`` of an activation frame as the pipeline sends it,
    ``{"act/<job>/<seq>": rows}``, + ``Channel.recv``: header HMACs, the
    AES-GCM body, the tensor-table encode and decode). ``wire_leaf_hop_us``
    is the same with the older ``{"act": [job, seq], "x": rows}`` frame
    (an array plus a JSON leaf), which nodes still serve. A pipeline can
    beat neither: with every process on two cores its CPU per activation is
    at least the hops times this, and with one activation in flight its
    latency is at least the sum.
    """
    from meshkit import wire

    x = np.zeros((1, nbytes // 4), np.float32)
    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    channels: dict[str, object] = {}

    def shake(sock: socket.socket, rank: int) -> None:
        channels[str(rank)] = wire.handshake(sock, b"s" * 32, rank=rank, world=2, role=2,
                                             timeout=30, handshake_timeout=30,
                                             max_frame=1 << 30)

    t = threading.Thread(target=shake, args=(b, 1))
    t.start()
    shake(a, 0)
    t.join()
    ca, cb = channels["0"], channels["1"]
    count = count if nbytes <= 65536 else max(50, count // 40)
    started = time.process_time()
    for i in range(count):
        ca.send(1, 0xFFFF0013, {f"act/1/{i}": x})
        cb.recv()
    wire_us = (time.process_time() - started) / count * 1e6
    started = time.process_time()
    for i in range(count):
        ca.send(1, 0xFFFF0013, {"act": [1, i], "x": x})
        cb.recv()
    leaf_us = (time.process_time() - started) / count * 1e6
    ca.close()
    cb.close()
    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    payload = memoryview(bytes(nbytes))
    buf = memoryview(bytearray(nbytes))
    started = time.process_time()
    for _ in range(count):
        a.sendall(payload)
        _recv_exact(b, buf)
    raw_us = (time.process_time() - started) / count * 1e6
    a.close()
    b.close()
    return {"wire_hop_us": wire_us, "wire_leaf_hop_us": leaf_us, "raw_hop_us": raw_us}


# -- the wire-level chain: meshkit's wire on every hop, nothing above it ---------------

_CHAIN_SECRET = b"wire-chain-benchmark-secret-0123"


def _chain_channel(sock: socket.socket, rank: int) -> object:
    from meshkit import wire

    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return wire.handshake(sock, _CHAIN_SECRET, rank=rank, world=8, role=2, timeout=60,
                          handshake_timeout=60, max_frame=1 << 30)


def wire_relay_main(listen_port: int, next_port: int) -> None:
    """One wire-level hop: ``Channel.recv`` a frame, ``Channel.send`` its state on.

    What a node's reader does per activation with the transport, the node
    and the stage taken away: authenticate, decrypt, decode, encode, seal.
    """
    listener = socket.create_server(("127.0.0.1", listen_port))
    down_sock = socket.create_connection(("127.0.0.1", next_port))
    print("ready", flush=True)
    up_sock, _ = listener.accept()
    _chain_hop(up_sock, (1, down_sock, 2), forward=False)


def _chain_hop(up_sock: socket.socket, down: tuple[int, socket.socket, int], *,
               forward: bool) -> None:
    """Handshake both links of a hop (``down`` = up rank, down socket, down rank), then pass
    every frame on: decoded and sent again (a node's work), or forwarded (the star's relay)."""
    up_rank, down_sock, down_rank = down
    shaken: dict[str, object] = {}
    thread = threading.Thread(target=lambda: shaken.setdefault("down", _chain_channel(
        down_sock, down_rank)))
    thread.start()
    up = _chain_channel(up_sock, up_rank)
    thread.join()
    out = shaken["down"]
    while True:
        try:
            frame = up.recv(timeout=None)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 (the chain is being taken down)
            break
        if forward:
            out.forward(frame)  # type: ignore[attr-defined]
        else:
            out.send(frame.kind, frame.tag, frame.state)  # type: ignore[attr-defined]
    out.close()  # type: ignore[attr-defined]


def _wire_forwarder(listen: socket.socket, next_port: int) -> threading.Thread:
    """In-process hop for the star variant: the coordinator's relay (``Channel.forward``)."""

    def run() -> None:
        up_sock, _ = listen.accept()
        down_sock = socket.create_connection(("127.0.0.1", next_port))
        _chain_hop(up_sock, (3, down_sock, 4), forward=True)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wire_chain(nbytes: int, count: int, star: bool) -> tuple[list[float], float]:
    """Round trips (seconds) of ``count`` activations, one in flight, through wire-level
    hops, and the CPU seconds every process of the chain spent meanwhile.

    The same hops as the pipeline (three relay processes, in a star each
    relaying back through a forwarder in this process), each doing only the
    wire's receive and send of the frame the pipeline sends. The difference
    from meshkit's p50 is what the transport, the node and the coordinator
    add above the wire; the difference from the raw relay's is the wire's.
    """
    sink = socket.create_server(("127.0.0.1", 0))
    next_port = sink.getsockname()[1]
    procs = []
    try:
        for _ in range(3):
            if star:
                fwd = socket.create_server(("127.0.0.1", 0))
                _wire_forwarder(fwd, next_port)
                next_port = fwd.getsockname()[1]
            port = free_ports(1)[0]
            proc = subprocess.Popen(
                [sys.executable, __file__, "--wire-relay", str(port), str(next_port)],
                stdout=subprocess.PIPE, text=True)
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            procs.append(proc)
            next_port = port
        src_sock = socket.create_connection(("127.0.0.1", next_port))
        shaken: dict[str, object] = {}
        other = threading.Thread(target=lambda: shaken.setdefault("src", _chain_channel(
            src_sock, 0)))
        other.start()
        out_sock, _ = sink.accept()
        out = _chain_channel(out_sock, 5)
        other.join()
        src = shaken["src"]
        x = np.random.default_rng(0).standard_normal((1, nbytes // 4)).astype(np.float32)
        trips = []
        clock = time.perf_counter
        pids = [p.pid for p in procs]
        cpu = cpu_seconds(pids)
        for i in range(count):
            started = clock()
            src.send(1, 0x13, {f"act/1/{i}": x})  # type: ignore[attr-defined]
            out.recv(timeout=60)  # type: ignore[attr-defined]
            trips.append(clock() - started)
        cpu = cpu_seconds(pids) - cpu
        src.close()  # type: ignore[attr-defined]
        out.close()  # type: ignore[attr-defined]
        return trips, cpu
    finally:
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        sink.close()


# -- meshkit ------------------------------------------------------------------------


class Mesh:
    def __init__(self, topology: str, board_elems: int | None, secret_file: Path,
                 encrypt: bool = True) -> None:
        from meshkit import NodeConfig
        from meshkit.node import collect_caps

        secret = secret_file.read_bytes()
        env = {k: v for k, v in os.environ.items() if k != "MESHKIT_SECRET"}
        if topology == "mesh":
            peers = [f"127.0.0.1:{port}" for port in free_ports(4)]
            config = NodeConfig(rank=0, world=4, peers=peers, topology="mesh",
                                transport="tcp", secret=secret, timeout=60, encrypt=encrypt)
            peer_arg = ",".join(peers)
        else:
            config = NodeConfig(rank=0, world=4, topology="star", bind="127.0.0.1:0",
                                transport="tcp", secret=secret, timeout=60, encrypt=encrypt)
        holder: dict = {}
        connector = threading.Thread(target=lambda: holder.setdefault("g", config.connect()))
        connector.start()
        if topology == "star":
            connector.join(30)
            peer_arg = holder["g"].address
        self.procs = []
        for rank in (1, 2, 3):
            # MESHKIT_BENCH_PROFILE_RANK=r runs rank r with a cProfile on every
            # thread (its readers serve the activations), /tmp/node<r>.<thread>.prof.
            profile = os.environ.get("MESHKIT_BENCH_PROFILE_RANK") == str(rank)
            args = [sys.executable, *([__file__, "--profiled-node", f"/tmp/node{rank}"]
                                      if profile else ["-m", "meshkit"]),
                    "node", "--rank", str(rank), "--world", "4", "--peers", peer_arg,
                    "--topology", topology, "--timeout", "60",
                    "--secret-file", str(secret_file), *([] if encrypt else ["--no-encrypt"])]
            if rank == 2 and board_elems is not None:
                args += ["--board", "loopback", "--board-option", "stage_id=mid",
                         "--board-option", f"input_elems={board_elems}",
                         "--board-option", f"output_elems={board_elems}"]
            self.procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, env=env))
        connector.join(60)
        self.group = holder["g"]
        self.group.wait_for_workers(timeout=60)
        self.caps = collect_caps(self.group, hook=False, timeout=60)

    def close(self) -> None:
        from meshkit.node import shutdown_nodes

        shutdown_nodes(self.group)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        self.group.close()


def meshkit_run(mesh: Mesh, stages: list, nbytes: int, count: int, in_flight: int,
                batch: int = 1) -> tuple[float, float]:
    """Seconds for ``count`` activations through the pipeline, and the CPU seconds."""
    from meshkit.pipeline import run_pipeline

    x = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
    pids = [p.pid for p in mesh.procs]
    last: list = []

    stamps = LAST_STAMPS
    clock = time.perf_counter

    def take(index: int, y: np.ndarray) -> None:
        # Streamed like the relay's drain: each output is looked at, then let go
        # (collecting them all would cost fresh memory per output, which the
        # relay, reusing one buffer, never pays).
        last[:] = [index, y]
        stamps.append(clock())

    cpu = cpu_seconds(pids)
    started = time.perf_counter()
    stamps[:] = [started]
    result = run_pipeline(mesh.group, stages, mesh.caps, (x for _ in range(count)),
                          in_flight=in_flight, batch=batch, timeout=60, on_output=take)
    elapsed = time.perf_counter() - started
    cpu = cpu_seconds(pids) - cpu
    assert result.count == count and last[0] == count - 1 and np.array_equal(last[1], x)
    return elapsed, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", choices=["mesh", "star"], default="mesh")
    parser.add_argument("--board", action="store_true",
                        help="middle rank is a loopback fixed-function board")
    parser.add_argument("--sizes", default="1KiB,1MiB")
    parser.add_argument("--in-flight-1KiB", type=int, default=64)
    parser.add_argument("--in-flight-1MiB", type=int, default=8)
    parser.add_argument("--batches-1KiB", default="1,16",
                        help="activations per frame/message to measure (comma list)")
    parser.add_argument("--batches-1MiB", default="1")
    parser.add_argument("--in-flight-16MiB", type=int, default=2)
    parser.add_argument("--batches-16MiB", default="1")
    parser.add_argument("--count-16MiB", type=int, default=24)
    parser.add_argument("--compare-encryption", action="store_true",
                        help="also time the authenticated-only path (encrypt=False), "
                             "alternating with the encrypted one")
    parser.add_argument("--count-1KiB", type=int, default=8000)
    parser.add_argument("--count-1MiB", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3, help="best of N")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from meshkit.pipeline import Stage

    rows = []
    star = args.topology == "star"
    with tempfile.TemporaryDirectory() as tmp:
        secret_file = Path(tmp) / "secret"
        secret_file.write_bytes(secrets.token_hex(32).encode())
        secret_file.chmod(0o600)
        for label in args.sizes.split(","):
            nbytes = SIZES[label]
            count = getattr(args, f"count_{label}")
            in_flight = getattr(args, f"in_flight_{label}")
            batches = [int(b) for b in getattr(args, f"batches_{label}").split(",")]
            latency_count = max(count // 8, 20)
            board = nbytes // 4 if args.board else None
            stages = [Stage(op="identity"),
                      Stage.board("mid") if args.board else Stage(op="identity"),
                      Stage(op="identity")]
            mesh = Mesh(args.topology, board, secret_file)
            plain = (Mesh(args.topology, board, secret_file, encrypt=False)
                     if args.compare_encryption else None)
            measured = {}
            auth: dict[int, list[float]] = {}
            enc: dict[int, list[float]] = {}
            try:
                meshkit_run(mesh, stages, nbytes, min(count, 50), in_flight)  # warm-up
                if plain is not None:
                    meshkit_run(plain, stages, nbytes, min(count, 50), in_flight)
                runs: dict[int, list[tuple[float, float]]] = {}
                for batch in batches:
                    runs[batch] = []
                    for _ in range(args.repeat):
                        # Alternated, so a load spike hits both paths alike.
                        runs[batch].append(
                            meshkit_run(mesh, stages, nbytes, count, in_flight, batch))
                        if plain is not None:
                            auth.setdefault(batch, []).append(
                                meshkit_run(plain, stages, nbytes, count, in_flight, batch)[0])
                    measured[batch] = min(runs[batch])
                    enc[batch] = [r[0] for r in runs[batch]]
                m_trips = []
                for _ in range(args.repeat):
                    meshkit_run(mesh, stages, nbytes, latency_count, 1)
                    m_trips.append(round_trips(LAST_STAMPS))
            finally:
                mesh.close()
                if plain is not None:
                    plain.close()
            raw_relay(nbytes, min(count, 50), in_flight, star)  # warm-up
            r_trips = []
            for _ in range(args.repeat):
                raw_relay(nbytes, latency_count, 1, star)
                r_trips.append(round_trips(LAST_STAMPS))
            w_trips, w_cpu = [], []
            for _ in range(args.repeat):
                trips, cpu = wire_chain(nbytes, latency_count, star)
                w_trips.append(np.asarray(trips))
                w_cpu.append(cpu / latency_count * 1e6)
            w_best = min(w_trips, key=lambda t: float(np.median(t)))
            # The best run's distribution (lowest p50), and the spread of p50s.
            m_best = min(m_trips, key=lambda t: float(np.median(t)))
            r_best = min(r_trips, key=lambda t: float(np.median(t)))
            m_p50s = sorted(float(np.median(t)) * 1e6 for t in m_trips)
            r_p50s = sorted(float(np.median(t)) * 1e6 for t in r_trips)
            raw: dict[int, tuple[float, float]] = {}
            for batch in sorted({1, *batches}):
                raw[batch] = min(raw_relay(nbytes, count, in_flight, star, batch)
                                 for _ in range(args.repeat))
            floor = hop_floor(nbytes)
            for batch in batches:
                m_tp, m_cpu = measured[batch]
                rows.append({
                    "size": label, "topology": args.topology, "board": args.board,
                    "in_flight": in_flight, "batch": batch,
                    "meshkit_act_per_s": count / m_tp,
                    # the relay moving each activation as its own message
                    "raw_act_per_s": count / raw[1][0],
                    "ratio": raw[1][0] / m_tp,
                    # the relay moving the very messages meshkit's frames carry
                    "raw_same_msgs_act_per_s": count / raw[batch][0],
                    "ratio_same_msgs": raw[batch][0] / m_tp,
                    # CPU (all processes) per activation, in the timed runs above
                    "meshkit_cpu_us": m_cpu / count * 1e6,
                    "raw_cpu_us": raw[1][1] / count * 1e6,
                    "meshkit_latency_us": float(np.mean(m_best)) * 1e6,
                    "raw_latency_us": float(np.mean(r_best)) * 1e6,
                    "meshkit_p50_us": float(np.percentile(m_best, 50)) * 1e6,
                    "meshkit_p99_us": float(np.percentile(m_best, 99)) * 1e6,
                    "raw_p50_us": float(np.percentile(r_best, 50)) * 1e6,
                    "raw_p99_us": float(np.percentile(r_best, 99)) * 1e6,
                    "p50_ratio": float(np.median(m_best) / np.median(r_best)),
                    "meshkit_p50s_us": m_p50s,
                    # the same hops with meshkit's wire and nothing above it
                    "wire_chain_p50_us": float(np.median(w_best)) * 1e6,
                    "wire_chain_p99_us": float(np.percentile(w_best, 99)) * 1e6,
                    "wire_chain_p50s_us": sorted(float(np.median(t)) * 1e6 for t in w_trips),
                    "wire_chain_cpu_us": min(w_cpu),
                    "raw_p50s_us": r_p50s,
                    "throughput_runs": [count / t for t, _ in runs[batch]],
                    **floor,
                    "meshkit_MiB_per_s": count * nbytes / m_tp / (1 << 20),
                })
                if batch in auth:
                    rows[-1]["auth_act_per_s"] = count / min(auth[batch])
                    rows[-1]["encryption_overhead"] = m_tp / min(auth[batch]) - 1
                    rows[-1]["encryption_overhead_per_trial"] = [
                        e / a - 1 for e, a in zip(enc[batch], auth[batch])]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"3-rank pipeline on 127.0.0.1, topology {args.topology}"
          f"{', middle rank a loopback board' if args.board else ''}, "
          f"encryption on (HMAC-SHA256 headers, AES-256-GCM bodies), best of {args.repeat}; "
          f"latency = round trips with one activation in flight (p50, p99 of the best run)")
    print(f"{'size':>5} {'flight':>6} {'batch':>5}  {'meshkit act/s':>13}  "
          f"{'raw act/s':>10}  {'ratio':>5}  {'raw same-msg':>12}  {'ratio':>5}  "
          f"{'meshkit p50':>11}  {'p99':>8}  {'raw p50':>8}  {'p99':>8}  {'p50 ratio':>9}  "
          f"{'CPU/act meshkit':>15}  {'raw':>6}")
    for r in rows:
        print(f"{r['size']:>5} {r['in_flight']:>6} {r['batch']:>5}  "
              f"{r['meshkit_act_per_s']:>13.0f}  {r['raw_act_per_s']:>10.0f}  "
              f"{r['ratio']:>5.2f}  {r['raw_same_msgs_act_per_s']:>12.0f}  "
              f"{r['ratio_same_msgs']:>5.2f}  {r['meshkit_p50_us']:>9.0f}us  "
              f"{r['meshkit_p99_us']:>6.0f}us  {r['raw_p50_us']:>6.0f}us  "
              f"{r['raw_p99_us']:>6.0f}us  {r['p50_ratio']:>8.1f}x  "
              f"{r['meshkit_cpu_us']:>13.0f}us  {r['raw_cpu_us']:>4.0f}us"
              + (f"  auth-only {r['auth_act_per_s']:.0f} act/s, encryption costs "
                 f"{r['encryption_overhead']:.0%} (per trial "
                 f"{min(r['encryption_overhead_per_trial']):.0%}.."
                 f"{max(r['encryption_overhead_per_trial']):.0%})"
                 if "auth_act_per_s" in r else ""))
    print("spread: meshkit act/s per run " + "; ".join(
        f"{r['size']} batch {r['batch']}: " + ", ".join(f"{v:.0f}" for v in r["throughput_runs"])
        for r in rows))
    print("floor, one hop on one thread (CPU us): " + "; ".join(
        f"{r['size']}: meshkit wire {r['wire_hop_us']:.0f} (JSON-leaf frame "
        f"{r['wire_leaf_hop_us']:.0f}), raw {r['raw_hop_us']:.0f}"
        for r in rows if r["batch"] == 1))
    print("wire-level chain, one in flight (the same hops, meshkit's wire and nothing above "
          "it): " + "; ".join(
              f"{r['size']}: p50 {r['wire_chain_p50_us']:.0f} us (p99 "
              f"{r['wire_chain_p99_us']:.0f}), {r['wire_chain_p50_us'] / r['raw_p50_us']:.1f}x "
              f"raw; meshkit p50 {r['meshkit_p50_us'] / r['wire_chain_p50_us']:.2f}x the chain's; "
              f"chain CPU/act {r['wire_chain_cpu_us']:.0f} us"
              for r in rows if r["batch"] == 1))
    print("spread: p50 per run (us) " + "; ".join(
        f"{r['size']}: meshkit " + ", ".join(f"{v:.0f}" for v in r["meshkit_p50s_us"])
        + " raw " + ", ".join(f"{v:.0f}" for v in r["raw_p50s_us"])
        + " wire chain " + ", ".join(f"{v:.0f}" for v in r["wire_chain_p50s_us"])
        for r in rows if r["batch"] == 1))


def profiled_node(prefix: str, argv: list[str]) -> None:
    """``meshkit <argv>`` with a cProfile (thread CPU time) on every thread.

    Each thread's profile goes to ``<prefix>.<thread name>.prof`` at exit.

    ``python -m cProfile`` sees only the main thread, and a node serves its
    activations on the transport's reader threads.
    """
    import cProfile

    profiles: list[tuple[str, cProfile.Profile]] = []

    def start(*_: object) -> None:
        sys.setprofile(None)
        # Thread CPU time, not wall time: a thread preempted on a busy machine
        # (or parked in poll) is not charged for the wait.
        profile = cProfile.Profile(time.thread_time_ns, 1e-9)
        profiles.append((threading.current_thread().name, profile))
        profile.enable()

    threading.setprofile(start)
    from meshkit.cli import main as cli_main

    sys.argv = ["meshkit", *argv]
    start()
    try:
        cli_main()
    finally:
        for name, profile in profiles:
            profile.disable()
            profile.dump_stats(f"{prefix}.{name}.prof")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--relay":
        relay_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    elif len(sys.argv) == 4 and sys.argv[1] == "--wire-relay":
        wire_relay_main(int(sys.argv[2]), int(sys.argv[3]))
    elif len(sys.argv) > 2 and sys.argv[1] == "--profiled-node":
        profiled_node(sys.argv[2], sys.argv[3:])
    else:
        main()
