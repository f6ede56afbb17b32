"""What signing a secure round costs: the same SecAgg+ round unsigned and signed (issue 41).

Run (from the repository root, in the dev venv)::

    python benchmarks/signed_round.py                    # n = 100 clients, 4 workers, 10k params
    python benchmarks/signed_round.py --clients 20,100 --repeat 5

Each cell is one ``secure_sum`` round over a :class:`~meshkit.train.LocalPool`
(in-process workers; every message still crosses the wire encoding and the
schema checks), ``synthetic`` task with ``--params`` parameters, the
``secagg+`` defaults (``degree = "auto"``, ``clip_range = 1``). *Signed*:
every worker has a node key and a roster of all of them, so each signs its
clients' adverts and confirmations, checks every member's advert before
sharing, and every confirmation before unmasking; rank 0 checks every
signature it collects and sends ``secagg_confirm``. The two take turns,
``--repeat`` times. Printed: seconds per round (median, min-max) and the
signed round's ratio to the unsigned. In-process, so it measures CPU, not
the network's extra round trip. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import meshkit
from meshkit.secure_aggregation import Roster, choose
from meshkit.train import LocalPool, Signing, StrategyContext, Trainer, secure_sum
from meshkit.wire import NodeKey


def one_round(clients: int, workers: int, params: int, signed: bool) -> float:
    def task():
        return meshkit.plugins.create("task", "synthetic", {"params": params,
                                                         "rows": 2 * clients})

    ranks = list(range(1, workers + 1))
    trainers = {r: Trainer(task()) for r in ranks}
    if signed:
        keys = {r: NodeKey(Ed25519PrivateKey.generate()) for r in ranks}
        roster = Roster(frozenset(k.public for k in keys.values()))
        for rank, trainer in trainers.items():
            trainer.secure.signing = Signing(keys[rank], roster)
    ctx = StrategyContext(
        task=task(), aggregator=meshkit.plugins.create("aggregator", "fedavg"),
        pool=LocalPool(trainers), workers=ranks, rng=np.random.default_rng(0), seed=3,
        outer=meshkit.plugins.create("outer_optimizer", "average"), timeout=600.0)
    state = ctx.task.init_state(3)
    started = time.perf_counter()
    result = secure_sum(ctx, list(range(clients)), state=state, scheme=choose("secagg+", {}),
                        rnd=1, shards=clients, seeds={c: 1000 + c for c in range(clients)})
    elapsed = time.perf_counter() - started
    assert len(result.contributors) == clients
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="100", help="comma list of cohort sizes")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--params", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # a refused step would be the only thing to log
    print(f"load average {os.getloadavg()[0]:.1f}; {args.workers} workers, "
          f"{args.params} parameters")
    for clients in (int(c) for c in args.clients.split(",")):
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeat):
            for signed in (False, True):
                times[signed].append(one_round(clients, args.workers, args.params, signed))
        med = {s: statistics.median(t) for s, t in times.items()}
        for signed in (False, True):
            t = times[signed]
            print(f"n = {clients:4d} {'signed  ' if signed else 'unsigned'}: {med[signed]:.3f} s "
                  f"({min(t):.3f}-{max(t):.3f})")
        print(f"n = {clients:4d} signed / unsigned: {med[True] / med[False]:.3f}")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
