"""Where a large-model round's CPU goes, process by process, against the ceiling's (issue 39).

Run (from the repository root, in the dev venv; needs ``perf`` and
``kernel.perf_event_paranoid <= 1`` or root)::

    python benchmarks/round_profile.py                          # 100M float32, 5 rounds
    python benchmarks/round_profile.py --rounds 6 --tree /work/wt/basenow
    python benchmarks/round_profile.py --cprofile 25            # and the coordinator's Python

One real ``meshkit run`` (local launch, 2 workers, the synthetic task at ``noise = 0``:
free fits, ``fedavg``, ``average``) under ``perf record -g -k CLOCK_MONOTONIC``, every
process of it sampled at ``--freq`` Hz of CPU time. The coordinator runs through a wrapper
that notes ``time.monotonic()`` as each round starts (``FlatRound.play_round``), so only
the samples from the start of round 2 to the start of the last round count: start-up, the
initial model, round 1's fresh memory and shutdown are left out, and each counted round
includes its checkpoint. Then ``round_ceiling.py``'s encrypted round (a warm-up and
``--rounds - 2`` timed rounds, none of meshkit's code) under the same ``perf``.

Each sample is put in one phase by its call chain (:func:`phase`, first match wins):
encryption (AES-GCM), the checkpoint file (the write, its zip CRC-32, ``fsync``), page
faults and the zeroing or freeing of fresh memory, the kernel's TCP copies and stack,
``memcpy``/``memset`` in user space, numpy arithmetic (the fold, the outer step), checks
(``isfinite``, min/max), float64 sums and dots (metrics, the evaluation), random draws,
the Python interpreter, the rest. Printed: CPU seconds per round of each phase in the
coordinator and in the workers (together), for meshkit and the ceiling, and the load
average. With ``--cprofile N`` the coordinator's rounds 2.. are also run under
``cProfile`` (a separate run, no ``perf``) and its top ``N`` functions by own time are
printed. ``--keep-bodies`` runs the workers with two kept model-sized bodies
(``large_model.py``'s ``--keep-bodies``), ``--noise -1`` with the task's noisy fits,
``--first 3`` counts from round 3 (steady state with kept bodies). A benchmark, not a
test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from large_model import KEEP_BODIES, ROOT, config_text

#: The coordinator's wrapper: the monotonic time at each round's start, the checkpoints',
#: and optionally cProfile over rounds 2.. .
WRAPPER = textwrap.dedent("""
    import atexit, json, runpy, sys, time
    out, top = sys.argv.pop(1), int(sys.argv.pop(1))
    marks = {"rounds": [], "end": None}
    profile = None
    if top:
        import cProfile
        profile = cProfile.Profile()
    from meshkit.train._rounds import flat
    play = flat.FlatRound.play_round
    def timed_play(self):
        marks["rounds"].append(time.monotonic())
        if profile is not None and len(marks["rounds"]) == 2:
            profile.enable()
        return play(self)
    flat.FlatRound.play_round = timed_play
    def record():
        marks["end"] = time.monotonic()
        if profile is not None:
            profile.disable()
            import pstats, io
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
            marks["cprofile"] = text.getvalue()
        with open(out, "w") as fh:
            json.dump(marks, fh)
    atexit.register(record)
    sys.argv = ["meshkit", *sys.argv[1:]]
    runpy.run_module("meshkit", run_name="__main__")
""")

PHASES = (
    ("encryption/decryption (AES-GCM)", lambda leaf, dso, chain: any(
        k in leaf.lower() for k in ("aes", "gcm", "ghash"))),
    ("checkpoint file (write, zip CRC-32, fsync)", lambda leaf, dso, chain: any(
        k in chain for k in ("crc32", "vfs_write", "ext4_", "mpage_", "block_invalidate",
                             "truncate_inode", "filemap_write", "do_fsync",
                             "copy_folio_from_iter", "vfs_fsync"))),
    ("page faults, zeroing and freeing of fresh memory", lambda leaf, dso, chain: any(
        k in chain for k in ("clear_page", "exc_page_fault", "handle_mm_fault", "zap_pte",
                             "unmap_page_range", "release_pages", "free_unref",
                             "__x64_sys_munmap", "__x64_sys_mmap", "free_pcppages"))),
    ("kernel TCP copies and stack", lambda leaf, dso, chain: any(
        k in chain for k in ("tcp_", "sock_", "sendmsg", "recvmsg", "sendto", "recvfrom",
                             "handle_softirqs", "net_rx", "skb_", "do_softirq"))),
    ("memcpy in user space", lambda leaf, dso, chain: "memmove" in leaf or "memcpy" in leaf),
    ("memset in user space", lambda leaf, dso, chain: "memset" in leaf),
    ("numpy arithmetic (the fold, the outer step)", lambda leaf, dso, chain: leaf.startswith(
        ("FLOAT_add", "FLOAT_divide", "FLOAT_multiply", "FLOAT_subtract", "DOUBLE_add",
         "DOUBLE_multiply"))),
    ("checks (isfinite, min/max)", lambda leaf, dso, chain: "multiarray" in dso and any(
        k in leaf.lower() for k in ("isfinite", "maximum", "minimum", "logical_or", "any"))),
    ("float64 sums and dots (metrics, evaluation)", lambda leaf, dso, chain: any(
        k in leaf for k in ("pairwise_sum", "cast_float_to_double", "dot"))),
    ("random draws", lambda leaf, dso, chain: "pcg64" in leaf or "_generator" in dso),
    ("Python interpreter", lambda leaf, dso, chain: "libpython" in dso),
    ("kernel, other (scheduler, syscalls)", lambda leaf, dso, chain: dso.startswith("[kernel")),
)


def phase(frames: list[tuple[str, str]]) -> str:
    """The phase of one sample, from its call chain (leaf first) of (symbol, dso)."""
    leaf, dso = frames[0]
    chain = " ".join(sym for sym, _ in frames)
    for name, test in PHASES:
        if test(leaf, dso, chain):
            return name
    return "other"


def samples(data: Path) -> list[tuple[int, float, list[tuple[str, str]]]]:
    """(pid, monotonic time, call chain) of every sample in a ``perf.data``."""
    text = subprocess.run(["perf", "script", "-i", str(data), "-F", "pid,tid,time,ip,sym,dso"],
                          capture_output=True, text=True, errors="replace", check=False).stdout
    got, head = [], re.compile(r"\s*(\d+)/\d+\s+([\d.]+):")
    frame = re.compile(r"\s*[0-9a-f]+\s+(.*?)\s+\((.*)\)\s*$")
    for block in text.split("\n\n"):
        lines = block.strip("\n").splitlines()
        if not lines or not (m := head.match(lines[0])):
            continue
        frames = [(f.group(1), f.group(2).rsplit("/", 1)[-1])
                  for line in lines[1:] if (f := frame.match(line))]
        if frames:
            got.append((int(m.group(1)), float(m.group(2)), frames))
    return got


def attribute(got, lo: float, hi: float, coordinator: int, freq: float, rounds: int):
    """CPU seconds per round of each (who, phase) among the samples in ``[lo, hi)``; and of
    each (who, phase, system call, first user-space function) for the page faults and the
    checkpoint, which say more by where they come from."""
    table: collections.Counter = collections.Counter()
    for pid, when, frames in got:
        if lo <= when < hi:
            who = "coordinator" if pid == coordinator else "workers"
            name = phase(frames)
            table[who, name] += 1 / freq / rounds
            if name.startswith(("page faults", "checkpoint")):
                user = next((s for s, d in frames if not d.startswith("[kernel")), "?")
                call = next((s for s, _ in frames if s.startswith(("__x64_sys", "__sys_"))),
                            "no system call")
                table[who, name, call, user] += 1 / freq / rounds
    return table


def perf_run(cmd: list[str], data: Path, freq: int, cwd: Path, env: dict) -> None:
    subprocess.run(["perf", "record", "-q", "-F", str(freq), "-g", "-k", "CLOCK_MONOTONIC",
                    "-o", str(data), "--", *cmd], cwd=cwd, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def meshkit_profile(python: str, tree: Path, params: int, rounds: int, freq: int,
                    tmp: Path, top: int = 0, keep_bodies: bool = False,
                    noise: float | None = 0.0, first: int = 2):
    config = tmp / "run.toml"
    config.write_text(config_text(tmp / "out", params=params, workers=2, rounds=rounds,
                                  timeout=600.0, segment_bytes=None, noise=noise))
    marks_file = tmp / "marks.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MESHKIT_SECRET")}
    if keep_bodies:  # every worker keeps two model-sized bodies (large_model.py's --keep-bodies)
        (tmp / "site").mkdir(exist_ok=True)
        (tmp / "site" / "sitecustomize.py").write_text(KEEP_BODIES)
        env["PYTHONPATH"] = str(tmp / "site")
    cmd = [python, "-c", WRAPPER, str(marks_file), str(top), "run", str(config)]
    if top:
        subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True)
        return json.loads(marks_file.read_text())["cprofile"]
    data = tmp / "meshkit.data"
    perf_run(cmd, data, freq, tree, env)
    marks = json.loads(marks_file.read_text())
    got = samples(data)
    coordinator = min(pid for pid, _, _ in got)  # the first process: the others are its children
    starts = marks["rounds"]
    return attribute(got, starts[first - 1], starts[-1], coordinator, freq,
                     len(starts) - first)


#: ``round_ceiling.py``'s encrypted round: a warm-up, then the counted rounds, marked.
CEILING = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, sys.argv[1])
    from round_ceiling import SEALED, Ceiling
    out, params, rounds = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    with Ceiling(params, 2) as ceiling:
        ceiling.play(SEALED)  # the warm-up: its buffers faulted in, as in round_ceiling.py
        start = time.monotonic()
        for _ in range(rounds):
            ceiling.play(SEALED)
        end = time.monotonic()
    with open(out, "w") as fh:
        json.dump({"start": start, "end": end}, fh)
""")


def ceiling_profile(python: str, params: int, rounds: int, freq: int, tmp: Path):
    """``round_ceiling.py``'s encrypted round under ``perf``: ``rounds - 2`` counted rounds."""
    data, marks = tmp / "ceiling.data", tmp / "ceiling.json"
    here = str(Path(__file__).resolve().parent)
    perf_run([python, "-c", CEILING, here, str(marks), str(params), str(rounds - 2)], data,
             freq, ROOT, dict(os.environ))
    got = samples(data)
    coordinator = min(pid for pid, _, _ in got)
    span = json.loads(marks.read_text())
    return attribute(got, span["start"], span["end"], coordinator, freq, rounds - 2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of the run (rounds FIRST .. rounds-1 are counted)")
    parser.add_argument("--first", type=int, default=2,
                        help="the first round counted (default 2; 3 leaves out round 2, "
                             "where a worker's second kept body is still fresh memory)")
    parser.add_argument("--freq", type=int, default=499, help="perf samples per CPU second")
    parser.add_argument("--tree", type=Path, default=ROOT, help="the meshkit tree to profile")
    parser.add_argument("--python", default=None, help="its python (default: TREE/.venv)")
    parser.add_argument("--noise", type=float, default=0.0,
                        help="the synthetic task's noise (default 0: a free fit; -1: the "
                             "task's default, 100M normals drawn per fit)")
    parser.add_argument("--no-ceiling", action="store_true")
    parser.add_argument("--keep-bodies", action="store_true",
                        help="the workers keep two model-sized bodies for reuse")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="also the coordinator's top N functions by own time (cProfile)")
    args = parser.parse_args(argv)
    python = args.python or str(args.tree / ".venv" / "bin" / "python")
    params = int(args.params)
    print(f"# {params:,} float32, 2 workers, noise {args.noise}, sitecustomize keeps bodies "
          f"{args.keep_bodies}, rounds {args.first}..{args.rounds - 1} counted; "
          f"tree {args.tree}; load {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="meshkit-round-profile-") as name:
        tmp = Path(name)
        mesh = meshkit_profile(python, args.tree, params, args.rounds, args.freq, tmp,
                               keep_bodies=args.keep_bodies,
                               noise=None if args.noise < 0 else args.noise,
                               first=args.first)
        ceiling = collections.Counter() if args.no_ceiling else ceiling_profile(
            sys.executable, params, args.rounds, args.freq, tmp)
        print("| phase | meshkit coordinator | meshkit workers | ceiling coordinator "
              "| ceiling workers |  (CPU s per round)\n|---|---|---|---|---|")
        names = [n for n, _ in PHASES] + ["other"]
        for n in names:
            row = [mesh["coordinator", n], mesh["workers", n], ceiling["coordinator", n],
                   ceiling["workers", n]]
            if any(v >= 0.0005 for v in row):
                print(f"| {n} | " + " | ".join(f"{v:.3f}" for v in row) + " |")
        total = [sum(t[who, n] for n in names) for t in (mesh, ceiling)
                 for who in ("coordinator", "workers")]
        print("| **total** | " + " | ".join(f"**{v:.3f}**" for v in total) + " |")
        print("\nwhere the page faults and the checkpoint come from (CPU s per round, >= 0.01):")
        for label, table in (("meshkit", mesh), ("ceiling", ceiling)):
            for key, value in sorted(table.items(), key=lambda kv: -kv[1]):
                if len(key) == 4 and value >= 0.01:
                    print(f"  {label} {key[0]}: {key[1]} in {key[2]}, from {key[3]}: "
                          f"{value:.3f}")
        if args.cprofile:
            print(meshkit_profile(python, args.tree, params, args.rounds, args.freq,
                                  tmp, top=args.cprofile))
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
