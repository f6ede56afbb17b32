"""Secure aggregation (SecAgg+): what masking costs against a plaintext float32 round.

Run (from the repository root, in the dev venv)::

    python benchmarks/secagg.py                        # n = 100, 1M parameters, 10% drop
    python benchmarks/secagg.py --scaling 25,50,100,200 --length 1000000
    python benchmarks/secagg.py --clients 20 --length 100000   # a quick look

One round in one process (``meshkit_secagg.simulate_round``): every client's
``ClientRound`` and the coordinator's ``ServerRound`` with real X25519, HKDF,
AES-GCM, Shamir and ChaCha20, and no sockets, so the figures are the
protocol's own cost. The degree and threshold are ``choose_degree(n,
dropout, corruption)`` unless ``--degree``/``--threshold`` are given;
``--drop`` of the cohort drops after masking, so the coordinator also
cancels their pairwise masks. The updates are random float32 vectors,
quantised one at a time as each client masks (``quantize`` is timed on its
own).

Printed, per cohort size: upload bytes per client (every message's payload,
``payload_bytes``: the masked vector plus keys and shares, before the
codec's framing) against the plaintext float32 upload (``4 * length``),
their ratio (goal <= 1.1); client CPU per client per stage; the
coordinator's CPU per stage, the unmasking (``finish``: self-masks of the
survivors, pairwise masks of the dropped) included (goal <= 5 s), against
the baseline: the coordinator summing the same number of plaintext float32
updates (``np.add`` in place). CPU seconds come from ``time.process_time``
and are summed over every client; this is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Iterator, Mapping

import numpy as np

from meshkit_secagg import STAGES, SecAggParams, choose_degree, quantize, simulate_round


class _LazyUpdates(Mapping[int, np.ndarray]):
    """Client id -> its quantised update, made when asked (one in memory at a time)."""

    def __init__(self, params: SecAggParams, length: int) -> None:
        self.params, self.length = params, length
        self.quantize_seconds = 0.0

    def __getitem__(self, client: int) -> np.ndarray:
        raw = np.random.default_rng(client).standard_normal(self.length, dtype=np.float32)
        start = time.process_time()
        q = quantize(raw * np.float32(0.1), self.params)
        self.quantize_seconds += time.process_time() - start
        return q

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.params.clients))

    def __len__(self) -> int:
        return self.params.clients


def _plaintext_fold(clients: int, length: int, repeat: int = 3) -> float:
    """CPU seconds for the coordinator to sum ``clients`` float32 updates (the median of ``repeat``)."""
    update = np.random.default_rng(0).standard_normal(length, dtype=np.float32)
    times = []
    for _ in range(repeat):
        total = np.zeros(length, np.float32)
        start = time.process_time()
        for _ in range(clients):
            np.add(total, update, out=total)
        times.append(time.process_time() - start)
    return statistics.median(times)


def run(clients: int, length: int, drop: float, dropout: float, corruption: float,
        degree: int | None, threshold: int | None, bits: int) -> dict[str, float]:
    if degree is None or threshold is None:
        chosen_degree, chosen_t = choose_degree(clients, dropout, corruption)
        degree = chosen_degree if degree is None else degree
        threshold = chosen_t if threshold is None else threshold
    params = SecAggParams(clients=clients, degree=degree, threshold=threshold, clip_range=1.0,
                          modulus_bits=bits)
    updates = _LazyUpdates(params, length)
    dropped = list(range(0, clients, max(1, round(1 / drop))))[:round(drop * clients)] \
        if drop else []
    start = time.perf_counter()
    sim = simulate_round(params, updates, b"benchmark round", drop_after_masking=dropped,
                         length=length)
    wall = time.perf_counter() - start
    assert len(sim.result.contributors) == clients - len(dropped)
    plain = _plaintext_fold(clients - len(dropped), length)
    senders = clients - len(dropped)
    upload = (sim.upload_bytes["advertise"] + sim.upload_bytes["share"]) / clients \
        + (sim.upload_bytes["mask"] + sim.upload_bytes.get("unmask", 0)) / senders
    server = sum(sim.server_seconds.values())
    print(f"\nn = {clients}, {length:,} parameters, degree {params.effective_degree}, t = "
          f"{threshold}, modulus 2^{bits}, {len(dropped)} dropped after masking")
    print(f"  upload per client: {upload:,.0f} B against plaintext float32 {4 * length:,} B "
          f"= {upload / (4 * length):.4f}x")
    per_client = {s: sim.client_seconds.get(s, 0.0) / clients for s in STAGES}
    print("  client CPU per client: " + ", ".join(f"{s} {v * 1e3:.1f} ms"
                                                 for s, v in per_client.items() if v)
          + f"; quantize {updates.quantize_seconds / clients * 1e3:.1f} ms; total "
          f"{sum(per_client.values()) * 1e3:.0f} ms")
    print("  coordinator CPU: " + ", ".join(f"{s} {sim.server_seconds.get(s, 0.0):.3f} s"
                                           for s in STAGES)
          + f"; total {server:.2f} s against a plaintext fold of {senders} updates "
          f"{plain:.3f} s = {server / plain:.1f}x")
    print(f"  unmasking (finish): {sim.server_seconds['finish']:.2f} s CPU (goal <= 5 s); the "
          f"whole in-process round {wall:.1f} s wall")
    return {"upload_ratio": upload / (4 * length), "client_s": sum(per_client.values()),
            "server_s": server, "finish_s": sim.server_seconds["finish"], "plain_s": plain}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--length", type=int, default=1_000_000)
    parser.add_argument("--drop", type=float, default=0.1,
                        help="fraction of the cohort that drops after masking")
    parser.add_argument("--dropout", type=float, default=0.1,
                        help="the dropout choose_degree tolerates")
    parser.add_argument("--corruption", type=float, default=0.05,
                        help="the colluding fraction choose_degree tolerates")
    parser.add_argument("--degree", type=int, default=None, help="0: the complete graph")
    parser.add_argument("--threshold", type=int, default=None)
    parser.add_argument("--bits", type=int, default=32)
    parser.add_argument("--scaling", default="", help="comma list of cohort sizes")
    args = parser.parse_args()
    sizes = [int(n) for n in args.scaling.split(",") if n] or [args.clients]
    rows = {n: run(n, args.length, args.drop, args.dropout, args.corruption, args.degree,
                   args.threshold, args.bits) for n in sizes}
    if len(rows) > 1:
        print("\n| n | upload / float32 | client CPU per client | coordinator CPU | "
              "unmasking | plaintext fold | coordinator / plaintext |")
        print("|---|---|---|---|---|---|---|")
        for n, r in rows.items():
            print(f"| {n} | {r['upload_ratio']:.4f}x | {r['client_s'] * 1e3:.0f} ms | "
                  f"{r['server_s']:.2f} s | {r['finish_s']:.2f} s | {r['plain_s']:.3f} s | "
                  f"{r['server_s'] / r['plain_s']:.0f}x |")


if __name__ == "__main__":
    main()
