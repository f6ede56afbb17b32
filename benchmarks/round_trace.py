"""Where a large model's round goes, event by event, on the coordinator and each worker (issue 39).

Run (from the repository root, in the dev venv)::

    python benchmarks/round_trace.py                      # 100M float32, 2 workers, 3 rounds
    python benchmarks/round_trace.py --params 20e6 --rounds 2

One real ``meshkit run`` (``benchmarks/large_model.py``'s config: local launch,
``synthetic`` task, ``fedavg``) with every process started through a
``sitecustomize`` that wraps the wire's and the round's own functions with
clocks (nothing of the run is changed). Recorded per event, with the
thread's own CPU (``getrusage(RUSAGE_THREAD)``: user, system, minor faults):
each frame above 1 MiB written (``Channel._send_buffers``: the state out, a
piece back) split into time in the socket writes, waiting for the socket to
take more (the peer behind) and AES-GCM; each segmented message read
(``read_segmented``) split into reads, waits and decryption; decoding; a
worker's fit, its piece cuts; the coordinator's fold of each piece. Printed
per round: the state out to each worker, each worker's receive of it, the
fits, each pull (its rate, and the share of it the worker spent writing: the
rest it waited for a ``take``), and the fold. Timing instruments, not a
benchmark against a baseline: its figures depend on the machine's load.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from large_model import ROOT, config_text

#: Installed as ``sitecustomize`` in every process of the run (``XFER_TRACE`` names
#: the files it writes: one JSON of events per process, at exit).
SITE = r'''import os, sys, time, threading, atexit, json
if os.environ.get("XFER_TRACE"):
    _out = os.environ["XFER_TRACE"]
    _events = []
    _acc = threading.local()
    import resource
    def ru():
        r = resource.getrusage(resource.RUSAGE_THREAD); return (r.ru_utime, r.ru_stime, r.ru_minflt)
    def ev(name, t0, t1, r0=None, **kw):
        if r0 is not None:
            r1 = ru(); kw.update(usr=r1[0]-r0[0], sys=r1[1]-r0[1], flt=r1[2]-r0[2])
        _events.append((name, t0, t1, threading.get_ident() % 10000, kw))
    def counters():
        c = getattr(_acc, "c", None)
        if c is None:
            c = _acc.c = {}
        return c
    def add(k, dt):
        c = counters(); c[k] = c.get(k, 0.0) + dt
    def dump():
        with open(f"{_out}.{os.getpid()}.json", "w") as fh:
            json.dump({"argv": sys.argv, "events": _events}, fh)
    atexit.register(dump)
    import signal
    def patch():
        from meshkit.wire import _channel, _sockets, _segments
        P = _sockets._Poller
        w0 = P.wait
        def wait(self, *a, **k):
            t = time.perf_counter()
            try: return w0(self, *a, **k)
            finally: add("pollw" if self._write else "poll", time.perf_counter() - t)
        P.wait = wait
        C = _channel.Channel
        sa0 = C._send_all
        def send_all(self, view, deadline=None):
            t = time.perf_counter()
            try: return sa0(self, view, deadline)
            finally: add("send_all", time.perf_counter() - t)
        C._send_all = send_all
        sg0 = _channel._streaming_gcm
        class G:
            def __init__(s, g): s.g = g
            def update_into(s, a, b):
                t = time.perf_counter(); r = s.g.update_into(a, b); add("gcm", time.perf_counter() - t); return r
            def __getattr__(s, n): return getattr(s.g, n)
        _channel._streaming_gcm = lambda *a, **k: G(sg0(*a, **k))
        ri0 = C._read_into
        def read_into(self, view, what, feed=None, mac_end=0, got=0):
            t = time.perf_counter()
            try: return ri0(self, view, what, feed, mac_end, got)
            finally: add("read_into", time.perf_counter() - t)
        C._read_into = read_into
        sb0 = C._send_buffers
        def send_buffers(self, kind, tag, flags, encoded, sender, deadline=None, **kw):
            if encoded.nbytes < (1 << 20):
                return sb0(self, kind, tag, flags, encoded, sender, deadline, **kw)
            _acc.c = {}
            r0 = ru(); t = time.perf_counter()
            try: return sb0(self, kind, tag, flags, encoded, sender, deadline, **kw)
            finally:
                ev("send", t, time.perf_counter(), r0, n=encoded.nbytes, peer=self.peer.rank, **counters())
        C._send_buffers = send_buffers
        rs0 = _channel.read_segmented
        def read_segmented(self, *a, **k):
            _acc.c = {}
            r0 = ru(); t = time.perf_counter()
            try: return rs0(self, *a, **k)
            finally: ev("recvseg", t, time.perf_counter(), r0, peer=self.peer.rank, **counters())
        _channel.read_segmented = read_segmented
        ds0 = _channel.decode_state
        def decode_state(body, *a, **k):
            t = time.perf_counter()
            try: return ds0(body, *a, **k)
            finally:
                if body.nbytes > (1 << 20): ev("decode", t, time.perf_counter(), n=int(body.nbytes))
        _channel.decode_state = decode_state
        try:
            from meshkit.train._worker import trainer
            T = trainer.Trainer
            for name in ("_fit", "_hold", "_answer"):
                f0 = getattr(T, name)
                def mk(f0, name):
                    def f(self, *a, **k):
                        r0 = ru(); t = time.perf_counter()
                        try: return f0(self, *a, **k)
                        finally: ev(name, t, time.perf_counter(), r0)
                    return f
                setattr(T, name, mk(f0, name))
            tp0 = trainer.take_piece
            def take_piece(*a, **k):
                t = time.perf_counter()
                try: return tp0(*a, **k)
                finally: ev("take_piece", t, time.perf_counter())
            trainer.take_piece = take_piece
            from meshkit.aggregation import _pieces
            PF = _pieces.PieceFold
            p0 = PF.piece
            def piece(self, *a, **k):
                r0 = ru(); t = time.perf_counter()
                try: return p0(self, *a, **k)
                finally: ev("fold_piece", t, time.perf_counter(), r0, i=a[0])
            PF.piece = piece
            from meshkit.train._rounds import pieces
            tk0 = pieces.PieceRound._take
            def take(self, rank, key, p):
                ev("ask", time.perf_counter(), time.perf_counter(), rank=rank, piece=p)
                return tk0(self, rank, key, p)
            pieces.PieceRound._take = take
            from meshkit.train._rounds import flat
            pr0 = flat.FlatRound.play_round
            def play_round(self):
                t = time.perf_counter()
                try: return pr0(self)
                finally: ev("play_round", t, time.perf_counter())
            flat.FlatRound.play_round = play_round
            import meshkit.train._pool as pool
            e0 = pool.encode
            def encode(*a, **k):
                t = time.perf_counter()
                try: return e0(*a, **k)
                finally: ev("encode_req", t, time.perf_counter())
            pool.encode = encode
        except Exception as exc:
            print("trace patch failed", exc, file=sys.stderr)
    patch()
'''

#: Reads the events back and prints the round by round summary (``python - PREFIX``).
SUMMARY = r'''import json,glob,sys,statistics as st
pat=sys.argv[1]
evs=[]
for f in glob.glob(pat+'.*.json'):
    d=json.load(open(f)); who='w'+d['argv'][d['argv'].index('--rank')+1] if '--rank' in d['argv'] else 'coord'
    for name,t0,t1,th,kw in d['events']: evs.append((t0,t1,who,name,kw))
evs.sort()
rounds=[e for e in evs if e[3]=='play_round']
for ri,r in enumerate(rounds):
    lo,hi=r[0],r[1]
    inr=[e for e in evs if lo<=e[0]<=hi]
    out=[e for e in inr if e[2]=='coord' and e[3]=='send']
    fits=[e for e in inr if e[3]=='_fit']
    for w in sorted({e[2] for e in inr if e[2] != 'coord'}):
        ws=[e for e in inr if e[2]==w and e[3]=='send']
        if not ws: continue
        span=ws[-1][1]-ws[0][0]; busy=sum(e[1]-e[0] for e in ws); n=sum(e[4]['n'] for e in ws)
        cpu=sum(e[4].get('usr',0)+e[4].get('sys',0) for e in ws)
        print(f"round {ri}: {w} pull: {len(ws)} pieces {n/1e6:.0f} MB in {span:.2f} s ({n/1e6/span:.0f} MB/s), worker writing {busy/span:.0%} of it, sender CPU {cpu:.2f} s")
    for e in out: print(f"round {ri}: state out to rank {e[4]['peer']}: {e[1]-e[0]:.2f} s {e[4]['n']/1e6/(e[1]-e[0]):.0f} MB/s, coord CPU {e[4]['usr']+e[4]['sys']:.2f} s, waiting for the socket {e[4].get('pollw',0):.2f} s, gcm {e[4].get('gcm',0):.2f} s")
    for e in inr:
        if e[3]=='recvseg' and e[2]!='coord': print(f"round {ri}: {e[2]} receives the state: {e[1]-e[0]:.2f} s, CPU usr {e[4]['usr']:.2f} sys {e[4]['sys']:.2f}, faults {e[4]['flt']}, decrypt {e[4].get('gcm',0):.2f} s, poll {e[4].get('poll',0):.2f} s")
    for e in fits: print(f"round {ri}: {e[2]} fit {e[1]-e[0]:.2f} s wall, CPU {e[4]['usr']+e[4]['sys']:.2f} s")
    folds=[e for e in inr if e[3]=='fold_piece']
    if folds: print(f"round {ri}: fold {len(folds)} pieces, main thread {sum(e[1]-e[0] for e in folds):.2f} s")
    print(f"round {ri}: wall {hi-lo:.2f} s")
'''


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="meshkit-round-trace-") as tmp:
        where = Path(tmp)
        (where / "site").mkdir()
        (where / "site" / "sitecustomize.py").write_text(SITE)
        config = where / "run.toml"
        config.write_text(config_text(where / "out", params=int(args.params),
                                      workers=args.workers, rounds=args.rounds, timeout=600,
                                      segment_bytes=None))
        env = {**os.environ, "PYTHONPATH": str(where / "site"),
               "XFER_TRACE": str(where / "trace")}
        env.pop("MESHKIT_SECRET", None)
        print(f"# {int(args.params):,} float32 parameters, {args.workers} workers, "
              f"{args.rounds} rounds; load {os.getloadavg()}", flush=True)
        subprocess.run([sys.executable, "-m", "meshkit", "run", str(config)], cwd=ROOT,
                       env=env, check=True, capture_output=True)
        subprocess.run([sys.executable, "-", str(where / "trace")], input=SUMMARY, text=True,
                       check=True)
        print(f"# load at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
