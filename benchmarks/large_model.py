"""A large model through a federated round: coordinator peak memory and transfer rate (issue 39).

Run (from the repository root, in the dev venv)::

    python benchmarks/large_model.py                                  # 100M float32 (400 MB)
    python benchmarks/large_model.py --params 500e6 --repeat 1        # the issue's 2 GB model
    python benchmarks/large_model.py --baseline main-e42316d=/tmp/base-e42316d
    python benchmarks/large_model.py --params 500e6 --repeat 1 --rounds 2 --spill --flower

Each trial is a real ``meshkit run`` (local launch, ``workers`` worker
processes, one client each, ``fedavg``, ``average`` outer optimizer) on the
``synthetic`` task, whose fit is the state plus seeded noise: what a round
costs is what the mesh does with the model (plus drawing ``params`` normal
numbers per fit). The coordinator runs through ``round_memory.py``'s
wrapper, which records its own peak RSS (``ru_maxrss``; the workers are
other processes). ``[mesh] segment_bytes`` is left at its default unless
``--segment-bytes`` is given (a baseline from before segments gets none).

Beside each trial, in the same run, one raw loopback TCP stream: ``params
* 4`` bytes sent through a connected socket by another process and read by
this one, ``--raw`` times (median): the bandwidth a single TCP stream gets on
this machine at that moment. A round moves the model ``2 * workers`` times
through the coordinator (the state out to each worker, a contribution back
from each), so its *transfer rate* is ``2 * workers * model / seconds per
round`` (the rounds after the first, their own clocks in ``metrics.jsonl``),
a lower bound: the round's seconds include the workers' fits and the fold.

The transfer itself is measured apart from the fits (this tree only; every
tree with ``--phases-all``, so the baselines pay the wrapper's cost too): the
coordinator runs through :data:`PHASES_WRAPPER`, which times every
model-sized frame it writes (the *state out*: bytes over the seconds during
which at least one of its writes was under way, the worker reading as it
arrives; writes to several workers at once count their overlap once) and each contribution pulled
piece by piece (*contribution in*: from asking for its first piece to its
last folded, so the fold between pieces counts against it), in the rounds
after the first; and samples its RSS every 5 ms, keeping the highest in
each phase of a round (the state going out, the fits, a contribution coming
in, the result and evaluation, the checkpoint). Beside the raw stream, an
encrypted one: the sender AES-256-GCM encrypts each 1 MiB piece before
sending it and the reader decrypts in place, as a channel does, so the two
show what the wire costs with and without the encryption. And a raw stream
read into one fresh model-sized buffer: the raw stream reads into the same
cache-hot 4 MiB again and again, where a received model must land in memory
the kernel faults in and zeroes (on the benchmark host that zeroing was the
largest single cost of a 400 MB transfer, docs/benchmarks.md). Each trial's
rates are also divided by the streams measured right before it (the last
table), since the machine's load moves them all.

Printed per tree: peak RSS in MB and in model copies, seconds per round and
transfer rate, each as the median over ``--repeat`` trials with min-max,
the raw stream's rate, and the ratio (round rate / raw rate); then the
state out and contribution in rates and their ratios to the raw and the
encrypted streams, and the peak RSS of each phase; and the minor page faults
and CPU seconds of the coordinator and of its workers together (its reaped
children): a fresh buffer's pages are faulted in (and zeroed) by the kernel,
a recycled one's are not. With ``--spill`` this tree runs twice per trial, in turns: as configured, and
with ``[run] spill = true`` (the global model in a mapped file, ``meshkit.spill``),
and the last lines hold each one's highest peak against issue 39's bound
(2 x model + 512 MiB without the spill, model + 512 MiB with it). The peak is
the coordinator's resident set (``ru_maxrss``): the spilled model's pages in
the page cache are not in it (they are the kernel's, shared and reclaimable:
``buff/cache`` in ``free``). With ``--flower``, the same model then goes through
Flower 1.42's simulation, two clients, ``--flower-rounds`` rounds
(``benchmarks/flower_large.py``): its driver's peak RSS, its process tree's, its
time per round, or where it failed. This is a
benchmark, not a test: it asserts nothing, and its numbers depend on the
machine and its load (the load average is printed with them).

``--noise 0`` makes the synthetic task's fit free (the state sent back as it
was given: nothing drawn, nothing copied), so seconds per round are the
transfer, the fold and meshkit's bookkeeping. ``--ceiling`` runs, right
after each trial, the same round's data movement without meshkit
(``round_ceiling.py``: a thread per link, 4 MiB segments, kept buffers, the
fold as segments arrive; plain and AES-256-GCM per segment; a warm-up and one
timed round of each), and a last table gives each tree's round transfer over
that ceiling and the ceiling over the streams, trial by trial::

    python benchmarks/large_model.py --params 100e6 --repeat 5 --raw 1 --noise 0 --ceiling
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from round_memory import MB, WRAPPER, ensure_synthetic

#: The coordinator, run through this: its peak RSS (``ru_maxrss``), and, when this tree's
#: round engine has the piece fold, the phases of each round (:data:`PHASES`) with the
#: highest RSS sampled in each and their clocks. Everything is timed by wrapping the
#: coordinator's own functions; nothing of the run is changed. A baseline tree without
#: the hooked functions reports its peak RSS only.
PHASES_WRAPPER = textwrap.dedent("""
    import atexit, json, os, resource, runpy, sys, threading, time
    out = sys.argv.pop(1)
    page = os.sysconf("SC_PAGE_SIZE")
    phase = ["start"]
    high = {}
    frames_out = []   # (round, seconds, bytes) of each frame above 1 MiB written
    pulls = []        # (round, seconds) of each contribution pulled piece by piece
    rounds = [0]
    done = threading.Event()

    def rss():
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * page

    def sample():
        while not done.is_set():
            key = phase[0]
            high[key] = max(high.get(key, 0), rss())
            done.wait(0.005)

    def hook():
        try:
            from meshkit.wire import _channel
            from meshkit.train._rounds import pieces, flat
            import meshkit.checkpoint as checkpoint
            from meshkit.train._coordinator import runner
        except ImportError:
            return
        send = _channel.Channel._send_buffers
        def timed_send(self, kind, tag, flags, encoded, *args, **kwargs):
            if encoded.nbytes < (1 << 20):
                return send(self, kind, tag, flags, encoded, *args, **kwargs)
            before, phase[0] = phase[0], "state out"
            started = time.perf_counter()
            try:
                return send(self, kind, tag, flags, encoded, *args, **kwargs)
            finally:
                frames_out.append((rounds[0], time.perf_counter() - started, encoded.nbytes,
                                   started))
                phase[0] = "fits (state sent)" if before in ("round start", "state out") \
                    else before
        _channel.Channel._send_buffers = timed_send
        take, answered = pieces.PieceRound._take, pieces.PieceRound.answered
        started = {}
        def timed_take(self, rank, key, piece):
            if piece == 0:
                phase[0] = "contribution in"
                started[key] = time.perf_counter()
            return take(self, rank, key, piece)
        def timed_answered(self, rank, kind, key, payload):
            last = kind == "take" and self.pulling.get(rank, (None, -1))[1] == self.plan_size - 1
            result = answered(self, rank, kind, key, payload)
            if last:
                pulls.append((rounds[0], time.perf_counter() - started.pop(key)))
                phase[0] = "waiting for the next contribution (the sum held)"
            return result
        pieces.PieceRound._take, pieces.PieceRound.answered = timed_take, timed_answered
        play = flat.FlatRound.play_round
        def timed_play(self):
            rounds[0] += 1
            phase[0] = "round start"
            try:
                return play(self)
            finally:
                phase[0] = "after the fold (result, outer step, evaluation)"
        flat.FlatRound.play_round = timed_play
        save = checkpoint.save_checkpoint
        def timed_save(*args, **kwargs):
            phase[0] = "checkpoint"
            try:
                return save(*args, **kwargs)
            finally:
                phase[0] = "between rounds"
        checkpoint.save_checkpoint = timed_save
        runner.save_checkpoint = timed_save

    def record():
        done.set()
        with open(out, "w") as fh:
            fh.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
        mine = resource.getrusage(resource.RUSAGE_SELF)
        # The workers are this process's children (local launch), reaped by now.
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        usage = {"coordinator": [mine.ru_minflt, mine.ru_utime, mine.ru_stime],
                 "workers": [kids.ru_minflt, kids.ru_utime, kids.ru_stime]}
        with open(out + ".json", "w") as fh:
            json.dump({"phases": high, "frames_out": frames_out, "pulls": pulls,
                       "usage": usage}, fh)
    hook()
    threading.Thread(target=sample, daemon=True).start()
    atexit.register(record)
    sys.argv = ["meshkit", *sys.argv[1:]]
    runpy.run_module("meshkit", run_name="__main__")
""")

#: ``sitecustomize`` for ``--keep-bodies``: a worker process (``meshkit node``) keeps two
#: received model-sized bodies for reuse (``meshkit.wire.recycle_large_messages(2)``, off
#: in meshkit since e556faa), so a model lands in pages faulted in by an earlier round.
KEEP_BODIES = textwrap.dedent("""
    import sys
    if "node" in sys.argv[:2]:
        import meshkit.wire
        meshkit.wire.recycle_large_messages(2)
""")

ROOT = Path(__file__).resolve().parents[1]
TASK = "meshkit_tasks.synthetic:SyntheticTask"
PLAINTEXT = "this, encrypt = false"
KEPT = "this, workers keep bodies"


def config_text(out: Path, *, params: int, workers: int, rounds: int, timeout: float,
                segment_bytes: int | None, spill: bool = False, outer: str = "average",
                noise: float | None = None, encrypt: bool = True) -> str:
    segment = f"segment_bytes = {segment_bytes}" if segment_bytes else ""
    scale = f"noise = {noise!r}" if noise is not None else ""
    return textwrap.dedent(f"""
        [run]
        task = "{TASK}"
        seed = 1
        out = "{out}"
        {"spill = true" if spill else ""}

        [mesh]
        launch = "local"
        workers = {workers}
        timeout = {timeout}
        join_timeout = 600
        {segment}
        {"" if encrypt else "encrypt = false"}

        [strategy]
        name = "federated"
        rounds = {rounds}

        [task]
        params = {params}
        rows = 1024
        {scale}

        [aggregator]
        name = "fedavg"

        [outer_optimizer]
        name = "{outer}"
    """)


def one_run(python: str, tree: Path, *, params: int, workers: int, rounds: int,
            timeout: float, segment_bytes: int | None, phases: bool = False,
            spill: bool = False, outer: str = "average",
            noise: float | None = None, encrypt: bool = True,
            keep_bodies: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="meshkit-large-model-") as tmp:
        tmpdir = Path(tmp)
        out = tmpdir / "out"
        config = tmpdir / "run.toml"
        config.write_text(config_text(out, params=params, workers=workers, rounds=rounds,
                                      timeout=timeout, segment_bytes=segment_bytes,
                                      spill=spill, outer=outer, noise=noise,
                                      encrypt=encrypt))
        rss_file = tmpdir / "rss"
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MESHKIT_SECRET")}
        if keep_bodies:  # every worker process keeps two model-sized bodies for reuse
            (tmpdir / "site").mkdir()
            (tmpdir / "site" / "sitecustomize.py").write_text(KEEP_BODIES)
            env["PYTHONPATH"] = str(tmpdir / "site")
        wrapper = PHASES_WRAPPER if phases else WRAPPER
        proc = subprocess.run([python, "-c", wrapper, str(rss_file), "run", str(config)],
                              cwd=tree, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"meshkit run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                if line]
        later = [r["seconds"] for r in rows[1:]] or [rows[0]["seconds"]]
        got: dict[str, Any] = {"rss": int(rss_file.read_text()),
                               "seconds": statistics.median(later)}
        extra = Path(str(rss_file) + ".json")
        if phases and extra.exists():
            traced = json.loads(extra.read_text())
            first = 2 if rounds > 1 else 1  # the rounds after the first, as the seconds
            sent = [(t, n) for r, t, n, *_ in traced["frames_out"] if r >= first]
            pulled = [t for r, t in traced["pulls"] if r >= first]
            got["phases"] = traced["phases"]
            got["usage"] = traced.get("usage", {})
            if sent:  # the state out: every model-sized frame the coordinator wrote
                got["out"] = sum(n for _, n in sent) / writing_seconds(
                    [f for f in traced["frames_out"] if f[0] >= first])
                # Each in turn: the first worker's fit runs beside the writes to the next.
                got["each"] = [n / t for t, n in sent]
            if pulled:  # a contribution in: its first piece asked for to its last folded
                got["in"] = params * 4 / statistics.median(pulled)
        return got


def writing_seconds(frames: list) -> float:
    """Seconds during which at least one of ``frames`` ((round, seconds, bytes, start)) was
    being written: writes to several workers at once count once (their union), writes one
    after another add up (the sum of their durations, as before the start was recorded)."""
    if any(len(f) < 4 for f in frames):
        return sum(f[1] for f in frames)
    spans = sorted((f[3], f[3] + f[1]) for f in frames)
    total, (lo, hi) = 0.0, spans[0]
    for start, end in spans[1:]:
        if start > hi:
            total, lo, hi = total + hi - lo, start, end
        else:
            hi = max(hi, end)
    return total + hi - lo


def raw_stream(nbytes: int, encrypt: bool = False, into_memory: bool = False) -> float:
    """Bytes per second of one loopback TCP stream carrying ``nbytes`` from another process.

    With ``encrypt``, the stream is what a channel's body costs: the sender AES-256-GCM
    encrypts each 1 MiB piece into a scratch buffer before sending it, the reader decrypts
    what it received in place (the channel's ``_SEND_PIECE`` and its streaming GCM),
    and checks the tag at the end. With ``into_memory``, the reader reads into one fresh
    ``nbytes`` buffer (where a received model must end up: its pages are faulted in,
    and zeroed, by the kernel as the stream fills them) rather than into the same
    cache-hot 4 MiB again and again.
    """
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    key, nonce, piece = bytes(range(32)), bytes(12), 1 << 20
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()
    pid = os.fork()
    if pid == 0:  # the sender: another process, as a worker is
        code = 1
        try:
            dialer = socket.create_connection(address)
            data = memoryview(bytearray(os.urandom(1 << 20)) * 4)
            scratch = memoryview(bytearray(piece))
            gcm = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor() if encrypt else None
            left = nbytes
            while left:
                chunk = data[:min(left, piece)]
                if gcm is not None:
                    gcm.update_into(chunk, scratch)
                    chunk = scratch[:chunk.nbytes]
                dialer.sendall(chunk)
                left -= chunk.nbytes
            if gcm is not None:
                gcm.finalize()
                dialer.sendall(gcm.tag)
            dialer.shutdown(socket.SHUT_WR)
            dialer.recv(1)
            code = 0
        finally:
            os._exit(code)
    reader, _ = listener.accept()
    listener.close()
    sink = bytearray(4 << 20)
    view = memoryview(sink)
    body = memoryview(np.empty(nbytes if into_memory else 0, dtype=np.uint8)).cast("B")
    gcm = Cipher(algorithms.AES(key), modes.GCM(nonce)).decryptor() if encrypt else None
    started = time.perf_counter()
    got = 0
    while got < nbytes:
        if into_memory:
            view = body[got:]
        n = reader.recv_into(view[:min(len(sink), nbytes - got)])
        if not n:
            break
        if gcm is not None:
            gcm.update_into(view[:n], view[:n])
        got += n
    if gcm is not None:
        tag = b""
        while len(tag) < 16:
            tag += reader.recv(16 - len(tag))
        gcm.finalize_with_tag(tag)
    elapsed = time.perf_counter() - started
    reader.sendall(b"x")
    reader.close()
    os.waitpid(pid, 0)
    assert got == nbytes
    return nbytes / elapsed


def parse_baseline(text: str) -> tuple[str, Path, str]:
    label, _, where = text.partition("=")
    if not where:
        raise argparse.ArgumentTypeError(f"--baseline LABEL=DIR[:PYTHON], got {text!r}")
    directory, _, python = where.partition(":")
    tree = Path(directory).resolve()
    return label, tree, python or str(tree / ".venv" / "bin" / "python")


def fmt(values: list[float], unit: str = "", scale: float = 1.0) -> str:
    scaled = [v / scale for v in values]
    return (f"{statistics.median(scaled):.2f}{unit} "
            f"({min(scaled):.2f}-{max(scaled):.2f})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6,
                        help="float32 parameters (default 100M: 400 MB; the issue asks 500M)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--raw", type=int, default=3, help="raw-stream trials per trial")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--segment-bytes", type=int, default=None)
    parser.add_argument("--phases-all", action="store_true",
                        help="run the baselines through the timing wrapper too (a tree whose "
                             "code has the hooked functions), so every tree pays its cost")
    parser.add_argument("--baseline", type=parse_baseline, action="append", default=[],
                        metavar="LABEL=DIR[:PYTHON]")
    parser.add_argument("--spill", action="store_true",
                        help="also run this tree with [run] spill = true, trial by trial")
    parser.add_argument("--outer", default="average", help="[outer_optimizer] name")
    parser.add_argument("--noise", type=float, default=None,
                        help="[task] noise of the synthetic task (0: a free fit, the state "
                             "sent back as given, so s/round is transfer + fold + bookkeeping)")
    parser.add_argument("--plaintext", action="store_true",
                        help="also run this tree with [mesh] encrypt = false (bodies in clear, "
                             "AES-GMAC tagged), trial by trial")
    parser.add_argument("--keep-bodies", action="store_true",
                        help="also run this tree with its workers keeping two model-sized "
                             "bodies for reuse (recycle_large_messages(2)), trial by trial")
    parser.add_argument("--ceiling", action="store_true",
                        help="beside each trial, the same round's data movement without "
                             "meshkit (round_ceiling.py, plain and encrypted; one warm-up "
                             "and one timed round of each)")
    parser.add_argument("--flower", action="store_true",
                        help="then the same model through Flower 1.42's simulation")
    parser.add_argument("--flower-rounds", type=int, default=1)
    parser.add_argument("--flower-cap", type=float, default=12 * 2**30,
                        help="kill Flower's process tree past this many resident bytes")
    args = parser.parse_args(argv)
    params = int(args.params)
    model = params * 4
    trees = [("this", ROOT, sys.executable, args.segment_bytes),
             *([("this, spill", ROOT, sys.executable, args.segment_bytes)] if args.spill
               else []),
             *([(PLAINTEXT, ROOT, sys.executable, args.segment_bytes)] if args.plaintext
               else []),
             *([(KEPT, ROOT, sys.executable, args.segment_bytes)] if args.keep_bodies
               else []),
             *[(label, tree, python, None) for label, tree, python in args.baseline]]
    for label, tree, _, _ in trees[1:]:
        if tree != ROOT:
            ensure_synthetic(tree)
    results: dict[str, list[dict[str, Any]]] = {label: [] for label, *_ in trees}
    raws: list[float] = []
    sealed: list[float] = []
    landed: list[float] = []  # the raw stream into a fresh model-sized buffer
    print(f"# {params:,} float32 parameters ({model / MB:.0f} MB), {args.workers} workers, "
          f"{args.rounds} rounds, {args.repeat} trials; load {os.getloadavg()}", flush=True)
    for trial in range(args.repeat):
        for label, tree, python, segment in trees:  # the trees take turns, trial by trial
            raws.append(statistics.median(raw_stream(model) for _ in range(args.raw)))
            sealed.append(statistics.median(raw_stream(model, encrypt=True)
                                            for _ in range(args.raw)))
            landed.append(statistics.median(raw_stream(model, into_memory=True)
                                            for _ in range(args.raw)))
            got = one_run(python, tree, params=params, workers=args.workers,
                          rounds=args.rounds, timeout=args.timeout, segment_bytes=segment,
                          phases=tree == ROOT or args.phases_all,
                          spill=label == "this, spill",
                          outer=args.outer if tree == ROOT else "average",
                          noise=args.noise, encrypt=label != PLAINTEXT,
                          keep_bodies=label == KEPT)
            got.update(raw=raws[-1], landed=landed[-1], sealed=sealed[-1])
            if args.ceiling:  # the same movement at its best, right after, same streams
                from round_ceiling import measure
                best = measure(params, args.workers, 1, "none", streams=False,
                               say=lambda text: None)
                got["ceiling"] = {name: best[name][0] for name in ("plain", "encrypted",
                                                                    "tagged")}
                print(f"# trial {trial + 1} ceiling (no meshkit), s/round: "
                      f"{', '.join(f'{k} {v:.3f}' for k, v in got['ceiling'].items())}; "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
            results[label].append(got)
            wire = "".join(f", {name} {got[name] / MB:.0f} MB/s" for name in ("out", "in")
                           if name in got)
            if got.get("each"):
                wire += f" (out frame by frame: {', '.join(f'{r / MB:.0f}' for r in got['each'])})"
            print(f"# trial {trial + 1} {label}: peak {got['rss'] / MB:.0f} MB, "
                  f"{got['seconds']:.2f} s/round{wire}; raw {raws[-1] / MB:.0f} MB/s, "
                  f"encrypted {sealed[-1] / MB:.0f} MB/s, raw into a fresh model-sized buffer "
                  f"{landed[-1] / MB:.0f} MB/s; load {os.getloadavg()[0]:.1f}",
                  flush=True)
            for who, (faults, user, system) in (got.get("usage") or {}).items():
                print(f"#   {who}: {faults:,} minor page faults, user {user:.1f} s, "
                      f"system {system:.1f} s", flush=True)
            for name, high in (got.get("phases") or {}).items():
                print(f"#   peak RSS in phase {name!r}: {high / MB:.0f} MB "
                      f"({high / model:.2f} model copies)", flush=True)
    raw, enc = statistics.median(raws), statistics.median(sealed)
    print(f"\nraw loopback stream: {fmt(raws, ' MB/s', MB)}; AES-256-GCM encrypted stream: "
          f"{fmt(sealed, ' MB/s', MB)}; raw stream into a fresh model-sized buffer: "
          f"{fmt(landed, ' MB/s', MB)}")
    print("| tree | peak RSS (MB) | model copies | s/round | round transfer (MB/s) | "
          "vs raw stream | state out (MB/s) | contribution in (MB/s) | out, in vs raw | "
          "out, in vs encrypted |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, *_ in trees:
        rows = results[label]
        rss = [r["rss"] for r in rows]
        rates = [2 * args.workers * model / r["seconds"] for r in rows]
        wire = []
        for name in ("out", "in"):
            values = [r[name] for r in rows if name in r]
            wire.append((fmt(values, "", MB), statistics.median(values)) if values else None)
        shown = [w[0] if w else "-" for w in wire]
        versus = [", ".join(f"{w[1] / base:.2f}x" for w in wire if w) or "-"
                  for base in (raw, enc)]
        print(f"| {label} | {fmt(rss, '', MB)} | {fmt(rss, '', model)} | "
              f"{fmt([r['seconds'] for r in rows], '')} | {fmt(rates, '', MB)} | "
              f"{statistics.median(rates) / raw:.2f}x | {shown[0]} | {shown[1]} | "
              f"{versus[0]} | {versus[1]} |")
    # Each trial against the raw streams measured right before it (the machine's load
    # moves both): median (min-max) over the trials.
    print("\n| tree | round transfer / raw | state out / raw | contribution in / raw | "
          "state out / raw into memory | contribution in / raw into memory |")
    print("|---|---|---|---|---|---|")
    for label, *_ in trees:
        rows = results[label]
        cells = [fmt([2 * args.workers * model / r["seconds"] / r["raw"] for r in rows], "x")]
        for base in ("raw", "landed"):
            for name in ("out", "in"):
                values = [r[name] / r[base] for r in rows if name in r]
                cells.append(fmt(values, "x") if values else "-")
        print(f"| {label} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} | {cells[4]} |")
    if args.ceiling:
        print(ceiling_table(results, trees, 2 * args.workers * model))
    print(budgets(results, model))
    if args.flower:
        print(flower_line(params, args.flower_rounds, int(args.flower_cap), model), flush=True)
    print(f"\nload average at the end: {os.getloadavg()}")


def ceiling_table(results: dict[str, list[dict[str, Any]]], trees: list, moved: int) -> str:
    """Each tree's round transfer against its ceiling (round_ceiling.py, the variant its
    wire is: encrypted, or tagged with ``[mesh] encrypt = false``) and the raw stream
    measured beside the same trial: median (min-max) of the per-trial ratios."""
    lines = ["\n| tree | round transfer (MB/s) | its ceiling | ceiling (MB/s) | "
             "round / ceiling | ceiling / raw stream | round / raw stream | "
             "ceiling plain / raw stream |", "|---|---|---|---|---|---|---|---|"]
    for label, *_ in trees:
        rows = [r for r in results[label] if "ceiling" in r]
        if not rows:
            continue
        which = "tagged" if label == PLAINTEXT else "encrypted"
        rate = [moved / r["seconds"] for r in rows]
        best = [moved / r["ceiling"][which] for r in rows]
        plain = [moved / r["ceiling"]["plain"] for r in rows]
        cells = [fmt(rate, "", MB), which, fmt(best, "", MB),
                 fmt([a / b for a, b in zip(rate, best)], "x"),
                 fmt([b / r["raw"] for b, r in zip(best, rows)], "x"),
                 fmt([a / r["raw"] for a, r in zip(rate, rows)], "x"),
                 fmt([b / r["raw"] for b, r in zip(plain, rows)], "x")]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    return "\n".join(lines)


def budgets(results: dict[str, list[dict[str, Any]]], model: int) -> str:
    """Each of this tree's peaks against issue 39's bound: 2 x model (spill off) or 1 x
    model (spill on), + 512 MiB."""
    lines = []
    for label, copies in (("this", 2), ("this, spill", 1)):
        rows = results.get(label)
        if rows:
            worst = max(r["rss"] for r in rows)
            bound = copies * model + 512 * 2**20
            lines.append(f"{label}: highest peak {worst / MB:.0f} MB vs {copies} x model + 512 "
                         f"MiB = {bound / MB:.0f} MB: {'met' if worst <= bound else 'NOT met'}")
    return "\n".join(lines)


def flower_line(params: int, rounds: int, cap: int, model: int) -> str:
    """Flower's simulation of the same model: its peak memory and time, or how it ended."""
    from flower_large import run as run_flower

    print(f"\n# Flower simulation: {params:,} float32 parameters, 2 clients, {rounds} round(s); "
          f"load {os.getloadavg()}", flush=True)
    got = run_flower(params, rounds, cap, budget=1800.0)
    head = (f"Flower {got.get('version', '?')}: driver peak RSS "
            f"{got.get('peak_driver', 0) / MB:.0f} MB ({got.get('peak_driver', 0) / model:.2f} "
            f"model copies), process tree peak {got.get('peak_tree', 0) / MB:.0f} MB, wall "
            f"{got.get('wall', 0):.1f} s")
    if got["ok"]:
        seconds = got.get("seconds") or []
        shown = ", ".join(f"{s:.1f}" for s in seconds)
        steps = "".join(f"\n  Flower driver: {line}" for line in got.get("progress", []))
        return f"{head}; rounds done {got['rounds_done']} (s/round: {shown}){steps}"
    steps = "".join(f"\n  Flower driver: {line}" for line in got.get("progress", []))
    return f"{head}; FAILED: {got['why']}{steps}"


if __name__ == "__main__":
    main()
