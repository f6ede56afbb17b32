"""Python calls a flat round costs, per process: this tree against baselines (issue 36).

Run (from the repository root, in the dev venv)::

    python benchmarks/round_calls.py --cells 3x3 \\
        --baseline turn2-669dbec=/work/wt/base669 --baseline main=/work/wt/basemain

Why. :mod:`round_cpu` says how much CPU a round costs, to about 5 % at
today's load; it cannot say where. A call count can: ``cProfile`` counts
every Python function and built-in a process calls, and the count does not
depend on the machine's load. Two runs of the same config that differ only
in their number of rounds (``--short``, ``--long``) have the same start-up,
connections and teardown, so their difference over the extra rounds is
what one round calls.

What. Each run is a real ``meshkit run`` (:mod:`engine_cost`'s config, as in
:mod:`round_cpu`) whose processes, the coordinator and every ``meshkit
node`` it starts, load a ``sitecustomize`` from a directory this script
puts on ``PYTHONPATH``: it profiles the main thread from start-up and every
thread started later (each with its own ``cProfile.Profile``, wrapped
around ``Thread.run``), and writes one stats file per process at exit (a
``SIGTERM`` included). Printed per tree: calls per round, and how many of
them are calls of Python functions (the rest are built-ins), for the
coordinator's main thread, the coordinator's other threads and one worker
(each worker serves one client a round at 3x3; the median of the workers);
then, with ``--top N``, the N functions whose calls per round changed most
against the first baseline. Counts are deterministic up to the few polls
and timeouts whose number depends on timing (a handful a round: look at
two runs). A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import os
import pstats
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_cost import ROOT, config_text, parse_two_runs, two_runs_parser  # noqa: E402

#: Loaded first by every Python process of the run (the directory is put on
#: ``PYTHONPATH``; the coordinator passes it on to the workers it starts).
SITECUSTOMIZE = textwrap.dedent('''
    import atexit, cProfile, os, signal, sys, threading

    _DIR = os.environ.get("MESHKIT_CALLS_DIR")
    if _DIR and "meshkit" in sys.orig_argv:
        _main = cProfile.Profile()
        _done = []
        _lock = threading.Lock()
        _run = threading.Thread.run

        def _profiled_run(self):
            prof = cProfile.Profile()
            prof.enable()
            try:
                _run(self)
            finally:
                prof.disable()
                with _lock:
                    _done.append(prof)

        threading.Thread.run = _profiled_run

        def _dump():
            _main.disable()
            role = "node" if "node" in sys.orig_argv else "run"
            # Written under a temporary name, then renamed: a process killed while it
            # dumps (a worker reaped under load) leaves no truncated stats file.
            def dump(stats, name):
                path = os.path.join(_DIR, name)
                stats.dump_stats(path + ".tmp")
                os.replace(path + ".tmp", path)
            dump(_main, f"{role}-{os.getpid()}-main.prof")
            with _lock:
                threads = list(_done)
            if threads:
                import pstats
                stats = pstats.Stats(threads[0])
                for prof in threads[1:]:
                    stats.add(prof)
                dump(stats, f"{role}-{os.getpid()}-threads.prof")

        def _term(signum, frame):
            sys.exit(128 + signum)

        atexit.register(_dump)
        signal.signal(signal.SIGTERM, _term)
        _main.enable()
''')


def counts(path: Path) -> tuple[int, int, dict[tuple[str, int, str], int]]:
    """All calls, calls of Python functions, and calls by function, from one stats file."""
    stats: dict[Any, Any] = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    by = {key: value[1] for key, value in stats.items()}
    python = sum(n for (file, _, _), n in by.items() if file != "~")
    return sum(by.values()), python, by


def one_run(python: str, tree: Path, *, clients: int, workers: int, rounds: int,
            keep: Path | None = None) -> dict[str, list[tuple[int, int, dict[Any, int]]]]:
    """One profiled ``meshkit run``: stats per role ("coordinator", "threads", "worker").
    Played again (up to twice) when a process left no stats: under load a worker may be
    killed by the coordinator's reaping before it has written them."""
    for _ in range(3):
        try:
            return _one_run(python, tree, clients=clients, workers=workers, rounds=rounds,
                            keep=keep)
        except _Incomplete as exc:
            print(f"# {exc}; running it again", file=sys.stderr, flush=True)
    raise RuntimeError(f"{tree}: three runs of {rounds} rounds left incomplete stats")


class _Incomplete(RuntimeError):
    """A run whose processes did not all leave their stats."""


def _one_run(python: str, tree: Path, *, clients: int, workers: int, rounds: int,
             keep: Path | None = None) -> dict[str, list[tuple[int, int, dict[Any, int]]]]:
    with tempfile.TemporaryDirectory(prefix="meshkit-round-calls-") as tmp:
        site = Path(tmp) / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        profiles = Path(tmp) / "profiles"
        profiles.mkdir()
        out = Path(tmp) / "out"
        config = Path(tmp) / "run.toml"
        config.write_text(config_text(out, clients=clients, workers=workers, rounds=rounds,
                                      flat=False))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MESHKIT_SECRET")}
        env.update(PYTHONPATH=str(site), MESHKIT_CALLS_DIR=str(profiles))
        done = subprocess.run([python, "-m", "meshkit", "run", str(config)], cwd=tree, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"meshkit run in {tree} failed ({done.returncode}):\n"
                               f"{done.stderr.decode(errors='replace')[-3000:]}")
        roles: dict[str, list[tuple[int, int, dict[Any, int]]]] = {
            "coordinator": [], "threads": [], "worker": [], "worker threads": []}
        for path in sorted(profiles.glob("*.prof")):
            role, _, part = path.stem.split("-")
            key = {("run", "main"): "coordinator", ("run", "threads"): "threads",
                   ("node", "main"): "worker", ("node", "threads"): "worker threads"}[role, part]
            roles[key].append(counts(path))
        if len(roles["coordinator"]) != 1 or len(roles["worker"]) != workers:
            raise _Incomplete(f"{tree}: expected 1 coordinator and {workers} worker profiles, "
                               f"found {sorted(p.name for p in profiles.iterdir())}")
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            for path in profiles.iterdir():
                path.rename(keep / path.name)
        return roles


def per_round(short: dict[str, Any], long: dict[str, Any],
              extra: int) -> dict[str, tuple[float, float, dict[Any, float]]]:
    """Calls per round by role: (long - short) / extra; workers by their median."""
    out: dict[str, tuple[float, float, dict[Any, float]]] = {}
    for role in short:
        a, b = short[role], long[role]
        if not a or not b:
            out[role] = (0.0, 0.0, {})
            continue
        if role.startswith("worker"):
            # Median worker by total calls, in each run.
            a = [sorted(a, key=lambda s: s[0])[len(a) // 2]]
            b = [sorted(b, key=lambda s: s[0])[len(b) // 2]]
        (ta, pa, fa), (tb, pb, fb) = a[0], b[0]
        funcs = {k: (fb.get(k, 0) - fa.get(k, 0)) / extra for k in set(fa) | set(fb)}
        out[role] = ((tb - ta) / extra, (pb - pa) / extra, funcs)
    return out


def label(key: tuple[str, int, str]) -> str:
    file, line, name = key
    if file == "~":
        return name
    parts = Path(file).parts
    for anchor in ("meshkit", "plugins", "site-packages"):
        if anchor in parts:
            parts = parts[parts.index(anchor):]
            break
    return f"{'/'.join(parts[-3:])}:{line}({name})"


def main(argv: list[str] | None = None) -> None:
    parser = two_runs_parser(__doc__, short=100, long=400,
                             keep="keep every stats file under KEEP/LABEL-ROUNDS/ (for pstats)")
    parser.add_argument("--top", type=int, default=0,
                        help="list the N functions whose calls per round differ most from "
                             "the first baseline's, per role")
    args = parse_two_runs(parser, argv)
    trees = [("this", sys.executable, ROOT)] + list(args.baseline)
    print(f"# calls per round = (calls in {args.long} rounds - calls in {args.short}) / "
          f"{args.long - args.short}; cProfile, every thread; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    for cell in args.cells:
        print(f"## {cell[0]} clients on {cell[1]} workers", flush=True)
        print(f"{'tree':>16} | {'coordinator main':>18} | {'its other threads':>18} | "
              f"{'one worker main':>18} | {'its other threads':>18}   (calls / of them Python)",
              flush=True)
        results = {}
        for name, python, tree in trees:
            keep = {n: None if args.keep is None else args.keep / f"{name}-{cell[0]}x{cell[1]}-{n}"
                    for n in (args.short, args.long)}
            short = one_run(python, tree, clients=cell[0], workers=cell[1], rounds=args.short,
                            keep=keep[args.short])
            long = one_run(python, tree, clients=cell[0], workers=cell[1], rounds=args.long,
                           keep=keep[args.long])
            results[name] = per_round(short, long, args.long - args.short)
            r = results[name]
            print(f"{name:>16} | " + " | ".join(
                f"{r[role][0]:8.0f} / {r[role][1]:7.0f}"
                for role in ("coordinator", "threads", "worker", "worker threads")), flush=True)
        if args.top and len(trees) > 1:
            base = trees[1][0]
            for role in ("coordinator", "threads", "worker", "worker threads"):
                mine, theirs = results["this"][role][2], results[base][role][2]
                # Functions by qualified name, so moved line numbers still match.
                def by_name(funcs: dict[Any, float]) -> dict[str, float]:
                    named: dict[str, float] = {}
                    for key, n in funcs.items():
                        named[label(key).split(":")[0] + ":" + key[2]] = (
                            named.get(label(key).split(":")[0] + ":" + key[2], 0.0) + n)
                    return named
                m, t = by_name(mine), by_name(theirs)
                diffs = sorted(((m.get(k, 0.0) - t.get(k, 0.0), k) for k in set(m) | set(t)),
                               key=lambda d: -abs(d[0]))[:args.top]
                print(f"### {role}: this - {base}, calls per round", flush=True)
                for d, k in diffs:
                    print(f"  {d:+8.1f}  ({m.get(k, 0.0):7.1f} vs {t.get(k, 0.0):7.1f})  {k}",
                          flush=True)
            print(f"### this, coordinator: top {args.top} by calls per round", flush=True)
            for key, n in sorted(results["this"]["coordinator"][2].items(),
                                 key=lambda kv: -kv[1])[:args.top]:
                print(f"  {n:8.1f}  {label(key)}", flush=True)
    print(f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)


if __name__ == "__main__":
    main()
