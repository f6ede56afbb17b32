"""The coordinator's live memory in batched rounds, by worker count (issue 22).

Run (from the repository root, in the dev venv)::

    python benchmarks/batched_memory.py                      # 1M params, 2 and 8 workers
    python benchmarks/batched_memory.py --params 2e6 --workers 2 4 8 16

Each cell is a real ``meshkit run`` in this process (the coordinator; local
launch, worker processes), a federated job on the ``synthetic`` task with
``--clients-per-worker`` clients a worker (default 4: a batched round, see
docs/strategies.md), two rounds. Measured: the coordinator's peak of live
Python/numpy allocations (``tracemalloc``, which numpy reports to), in model
copies. Unlike peak RSS (``benchmarks/round_memory.py``) this leaves out
memory the allocator keeps after it was freed: a worker's int64 partial is
twice the model, above the wire's 4 MiB receive-buffer pool, so every
partial is a fresh allocation, and glibc keeps much of what was freed. This
is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshkit.train import Runner, read_metrics  # noqa: E402
from tests.support.configs import write_config  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=1e6)
    parser.add_argument("--workers", type=int, nargs="*", default=[2, 8])
    parser.add_argument("--clients-per-worker", type=int, default=4)
    args = parser.parse_args(argv)
    params = int(args.params)
    for workers in args.workers:
        clients = args.clients_per_worker * workers
        with tempfile.TemporaryDirectory(prefix="meshkit-batched-memory-") as tmp:
            out = Path(tmp) / "out"
            extra = (f"clients = {clients}\nmin_clients = {clients}\n"
                     f"[task]\nparams = {params}\nrows = {max(1024, clients)}")
            config = write_config(Path(tmp) / "c.toml", out, workers=workers, rounds=2,
                                  task="synthetic", extra=extra, timeout=120.0)
            started = time.perf_counter()
            tracemalloc.start()
            try:
                report = Runner(str(config)).run()
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            served = [len(r["served"]) for r in read_metrics(out)]
            print(f"{workers:>3} workers, {clients:>4} clients: ok {report.ok}, served {served}, "
                  f"peak {peak / (params * 4):.2f} model copies "
                  f"({time.perf_counter() - started:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
