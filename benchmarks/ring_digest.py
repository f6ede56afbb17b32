"""The mesh all-reduce's layout digest: canonical bytes against the former Python repr (issue 21).

Run (from the repository root, in the dev venv)::

    python benchmarks/ring_digest.py            # 1, 100 and 1000 keys

Every ``mesh_all_reduce`` computes its layout's digest once (not per
segment). Until issue 21 it was BLAKE2b-64 over ``repr()`` of the keys,
shapes, dtype strings and ranks (the named baseline, kept below as it was);
now it is BLAKE2b-64 over the documented byte encoding
(:func:`meshkit.transport._collective.layout_bytes`, docs/protocol.md
§5.1). Printed: microseconds per digest for each, the best of 5 trials, and
the ratio (> 1: the canonical encoding is slower). For scale: a 1 MiB
all-reduce over two ranks takes about 1.5 ms here.

This is a measurement, not a test: nothing here asserts a time.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np

from meshkit.transport._collective import layout_digest


def repr_digest(entries: list[tuple[str, tuple[int, ...], np.dtype]], ranks: list[int]) -> int:
    """The former digest (meshkit/transport/_collective.py before issue 21)."""
    digest = hashlib.blake2b(repr((
        [(k, s, d.str if d.name != "bfloat16" else "bf16") for k, s, d in entries],
        list(ranks))).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def best(fn, *args, n: int) -> float:
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            fn(*args)
        times.append((time.perf_counter() - start) / n * 1e6)
    return min(times)


def main() -> None:
    print("# layout digest, us per all-reduce (best of 5); ranks [1, 2, 3, 4]")
    print(f"{'keys':>6} {'repr (before)':>14} {'canonical':>10} {'ratio':>7}")
    for keys in (1, 100, 1000):
        entries = [(f"layer{i}.weight", (64, 32), np.dtype(np.float32)) for i in range(keys)]
        n = max(20, 20000 // keys)
        before = best(repr_digest, entries, [1, 2, 3, 4], n=n)
        after = best(layout_digest, entries, [1, 2, 3, 4], n=n)
        print(f"{keys:>6} {before:>14.1f} {after:>10.1f} {after / before:>7.2f}")


if __name__ == "__main__":
    main()
