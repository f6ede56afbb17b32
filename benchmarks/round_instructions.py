"""Instructions a round executes, per process (callgrind): this tree against baselines (issue 36).

Run (from the repository root, in the dev venv; needs ``valgrind``)::

    python benchmarks/round_instructions.py --baseline turn2-669dbec=/work/wt/base669
    python benchmarks/round_instructions.py --baseline turn2=/work/wt/base669 --by-library

Why. A flat 3-clients-on-3-workers round costs ~9 ms of CPU. On a shared
2-core VM the same tree's CPU a round moves by 30-60 % between runs
(:mod:`round_cpu`), so a difference of a few percent between two trees
cannot be told from noise there, however many trials. The instructions a
process executes hardly depend on the machine's load: two runs of the same
tree gave the same run total to 0.2 % and the coordinator's to 1 % (the
polls, and which thread finds a reply first, depend on timing). They leave
out what instructions do not show (cache misses, the kernel's side of a
syscall, context switches), so this is the user-space work a round asks
for, not its time: read it beside :mod:`round_cpu` and :mod:`round_threads`.
Two things weigh more here than in time: libc's ``memcpy``/``memset`` use
``rep movsb``, which valgrind counts once a byte (a 19 KiB ``bytes()`` copy
is ~21,800 instructions, natively under a microsecond), and the AES-GCM
code valgrind runs is not the AVX-512 code the machine runs (``--by-library``
shows both apart: ``libc``, ``_rust``/``libcrypto``). Frames are encrypted
by default since b5d9fc0 (2026-12-01); earlier trees, turn 2 among them,
only authenticated them (GMAC: AES-GCM over an empty plaintext), so their
``_rust`` line is the tag alone. ``--unencrypted`` also counts this tree
with ``[mesh] encrypt = false``, the same wire as theirs. (Turn 2 counted
the same with cryptography 50.0.2 and 51.0.1: 35.802M and 35.801M a run.)

What. Each run is a real ``meshkit run`` (:mod:`engine_cost`'s config, as in
:mod:`round_cpu` and :mod:`round_calls`: ``digits``, ``fedavg``,
``average``, local launch, every client every round) under ``valgrind
--tool=callgrind --trace-children=yes``, so the coordinator and every
``meshkit node`` it starts are counted, each in its own file. Two runs per
tree that differ only in their number of rounds (``--short``, ``--long``)
have the same start-up, connections and teardown, so their difference over
the extra rounds is what one round executes. Every tree runs with
``OPENBLAS_NUM_THREADS=1``: valgrind runs a process's threads one at a
time, and an OpenBLAS pool thread that busy-waits would be counted for as
long as it is scheduled (this tree's local launch already gives its
coordinator one BLAS thread; turn 2's code spins). Printed per tree:
millions of instructions a round for the coordinator, the median worker and
the whole run (coordinator plus every worker), and the ratio to each
baseline; with ``--by-library``, the same split by shared object
(``libpython`` is the interpreter, ``_multiarray_umath`` and ``openblas``
numpy, ``_rust`` cryptography's AES-GCM). Under valgrind a round takes
~50x its native time; the default 40 and 240 rounds take 2-4 minutes a
tree. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_cost import ROOT, config_text, parse_two_runs, two_runs_parser  # noqa: E402

#: A callgrind_annotate row: its count, then ``file:function [object]``.
_ROW = re.compile(r"\s*([\d,]+) \([ \d.]+%\)\s+(.*)")


#: One process's count: its instructions, and (``--by-library``) their split by library.
Count = tuple[int, dict[str, int]]


def one_run(python: str, tree: Path, *, clients: int, workers: int, rounds: int,
            keep: Path | None, by_library: bool, encrypt: bool = True) -> dict[str, list[Count]]:
    """One ``meshkit run`` under callgrind: each process's count, by role. Played again
    (up to twice) when a process left no count: a worker still exiting under valgrind
    when the coordinator's reaping kills it writes none."""
    for _ in range(3):
        try:
            return _one_run(python, tree, clients=clients, workers=workers, rounds=rounds,
                            keep=keep, by_library=by_library, encrypt=encrypt)
        except _Incomplete as exc:
            print(f"# {exc}; running it again", file=sys.stderr, flush=True)
    raise RuntimeError(f"{tree}: three runs of {rounds} rounds left incomplete counts")


class _Incomplete(RuntimeError):
    """A run whose processes did not all leave their counts."""


def _one_run(python: str, tree: Path, *, clients: int, workers: int, rounds: int,
             keep: Path | None, by_library: bool, encrypt: bool) -> dict[str, list[Count]]:
    with tempfile.TemporaryDirectory(prefix="meshkit-round-instructions-") as tmp:
        work = Path(tmp)
        config = work / "run.toml"
        config.write_text(config_text(work / "out", clients=clients, workers=workers,
                                      rounds=rounds, flat=False, encrypt=encrypt))
        counts = (keep if keep is not None else work) / f"{tree.name}-{rounds}"
        shutil.rmtree(counts, ignore_errors=True)  # a run played again starts afresh
        counts.mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MESHKIT_SECRET")}
        env["OPENBLAS_NUM_THREADS"] = "1"
        done = subprocess.run(
            ["valgrind", "--tool=callgrind", "--trace-children=yes",
             f"--callgrind-out-file={counts}/%p.out", python, "-m", "meshkit", "run",
             str(config)],
            cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"meshkit run in {tree} under callgrind failed "
                               f"({done.returncode}):\n"
                               f"{done.stderr.decode(errors='replace')[-3000:]}")
        roles: dict[str, list[Count]] = {"coordinator": [], "worker": []}
        for path in sorted(counts.glob("*.out")):
            text = path.read_text(errors="replace")
            cmd = next((line for line in text[:4000].splitlines() if line.startswith("cmd:")), "")
            role = "worker" if " node " in cmd else "coordinator" if " run " in cmd else None
            if role is not None:
                roles[role].append((total(path, text), libraries(path) if by_library else {}))
        if len(roles["coordinator"]) != 1 or len(roles["worker"]) != workers:
            raise _Incomplete(f"{tree}: expected 1 coordinator and {workers} worker counts, "
                               f"found { {k: len(v) for k, v in roles.items()} }")
        return roles


#: The libraries whose code a round runs besides the interpreter and meshkit's.
LIBRARIES = ("cryptography", "numpy", "ml_dtypes")


def library_versions(python: str) -> str:
    """``cryptography 50.0.2, numpy 2.4.6``: what ``python`` imports."""
    code = ("import importlib.metadata as m; print(', '.join(f'{n} {m.version(n)}' for n in "
            f"{LIBRARIES!r}))")
    return subprocess.run([python, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()


def total(path: Path, text: str) -> int:
    for line in text.splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"{path}: no summary line (callgrind did not finish)")


def libraries(path: Path) -> dict[str, int]:
    """Instructions by shared object (callgrind_annotate's exclusive counts)."""
    text = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", str(path)],
                          capture_output=True, text=True, check=True).stdout
    by: dict[str, int] = {}
    for line in text.splitlines():
        row = _ROW.match(line)
        if row is None or "PROGRAM TOTALS" in line:
            continue
        where = re.search(r"\[([^\]]*)\]\s*$", row.group(2))
        name = Path(where.group(1)).name if where else "(unknown)"
        by[name] = by.get(name, 0) + int(row.group(1).replace(",", ""))
    return by


def per_round(short: dict[str, list[Count]], long: dict[str, list[Count]],
              extra: int) -> dict[str, dict[str, float]]:
    """Instructions a round by role: ``total`` and each library; workers by their median."""
    out: dict[str, dict[str, float]] = {}
    for role in ("coordinator", "worker"):
        a = sorted(short[role], key=lambda c: c[0])[len(short[role]) // 2]
        b = sorted(long[role], key=lambda c: c[0])[len(long[role]) // 2]
        row = {"total": (b[0] - a[0]) / extra}
        for name in set(a[1]) | set(b[1]):
            row[name] = (b[1].get(name, 0) - a[1].get(name, 0)) / extra
        out[role] = row
    return out


def main(argv: list[str] | None = None) -> None:
    parser = two_runs_parser(__doc__, short=40, long=240,
                             keep="keep the callgrind files under KEEP/ (for callgrind_annotate)")
    parser.add_argument("--by-library", action="store_true",
                        help="split each role's instructions by shared object")
    parser.add_argument("--jobs", type=int, choices=(1, 2), default=1,
                        help="2: a tree's short and long run at once")
    parser.add_argument("--unencrypted", action="store_true",
                        help="also this tree with [mesh] encrypt = false: frames authenticated, "
                             "not encrypted, as every tree before 2026-12-01 (b5d9fc0) sent them")
    args = parse_two_runs(parser, argv)
    if shutil.which("valgrind") is None:
        print("round_instructions: valgrind is not installed (apt install valgrind)",
              file=sys.stderr)
        raise SystemExit(2)
    trees = [("this", sys.executable, ROOT, True)]
    if args.unencrypted:
        trees.append(("this-unencrypted", sys.executable, ROOT, False))
    trees += [(name, python, tree, True) for name, python, tree in args.baseline]
    versions = {name: library_versions(python) for name, python, _, _ in trees}
    for name, found in versions.items():
        print(f"# {name}: {found}", flush=True)
    if len(set(versions.values())) > 1:
        print("# the trees run different library versions: instructions inside those "
              "libraries may differ by build (--by-library shows them apart; pip install the "
              "same versions in each tree's venv to compare code alone)", flush=True)
    extra = args.long - args.short
    print(f"# instructions a round = (instructions in {args.long} rounds - in {args.short}) / "
          f"{extra}; callgrind, every process, OPENBLAS_NUM_THREADS=1", flush=True)
    for clients, workers in args.cells:
        print(f"## {clients} clients on {workers} workers: millions of instructions a round",
              flush=True)
        results: dict[str, dict[str, dict[str, float]]] = {}
        for name, python, tree, encrypt in trees:
            keep = None if args.keep is None else args.keep / f"{name}-{clients}x{workers}"
            # --jobs 2: the short and the long run side by side (counts do not depend
            # on timing, but a busier machine makes a worker's exit outlast the reaping).
            with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
                short, long = pool.map(lambda rounds: one_run(
                    python, tree, clients=clients, workers=workers, rounds=rounds, keep=keep,
                    encrypt=encrypt,
                    by_library=args.by_library), (args.short, args.long))
            r = per_round(short, long, extra)
            results[name] = r
            run = r["coordinator"]["total"] + workers * r["worker"]["total"]
            print(f"{name:>16}  coordinator {r['coordinator']['total'] / 1e6:7.3f}  "
                  f"worker {r['worker']['total'] / 1e6:7.3f}  run {run / 1e6:7.3f}", flush=True)
        for base, _, _, _ in trees[1:]:
            mine, theirs = results["this"], results[base]
            ratio = {role: mine[role]["total"] / theirs[role]["total"]
                     for role in ("coordinator", "worker")}
            runs = [r["coordinator"]["total"] + workers * r["worker"]["total"]
                    for r in (mine, theirs)]
            print(f"  this / {base}: coordinator {ratio['coordinator']:.3f}  worker "
                  f"{ratio['worker']:.3f}  run {runs[0] / runs[1]:.3f}", flush=True)
        if args.by_library:
            for role in ("coordinator", "worker"):
                names = sorted({k for r in results.values() for k in r[role] if k != "total"},
                               key=lambda k: -max(abs(r[role].get(k, 0.0))
                                                  for r in results.values()))
                print(f"### {role}, thousands of instructions a round, by library", flush=True)
                print("  " + "".join(f"{n:>14}" for n in results) + "  library", flush=True)
                for k in names[:12]:
                    print("  " + "".join(f"{r[role].get(k, 0.0) / 1e3:14,.0f}"
                                         for r in results.values()) + f"  {k}", flush=True)


if __name__ == "__main__":
    main()
