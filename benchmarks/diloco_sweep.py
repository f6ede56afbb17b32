"""The loss curve of DiLoCo against per-step data-parallel, at equal tokens, in one process.

``benchmarks/diloco.py`` runs each setting as a real ``meshkit run`` (5
processes, authenticated links): minutes per point on two loaded cores, too
slow to sweep settings or to draw a curve over many outer steps. This script
does the same arithmetic in one process so a sweep takes seconds per point:

* the model, corpus, loss and shards are ``benchmarks/diloco.py``'s (``TinyLM``,
  ``LM``, 4 contiguous shards, ``batch`` sequences a replica a step);
* data-parallel: one AdamW step a step on the mean gradient of the 4 replicas'
  batches (the mean of equal-size mean losses is the loss of their union);
* DiLoCo: 4 replicas, each with its own AdamW (kept across outer steps, as
  meshkit's replicas keep theirs), ``H`` inner steps, then the pseudo-gradients
  ``global - local`` encoded at ``bits`` with meshkit's own blockwise codes
  (:func:`meshkit.aggregation.encode_blocks`), averaged, one outer Nesterov
  step (meshkit's ``nesterov`` rule), the update encoded at ``bits`` and applied
  by every replica, as the strategy does (``fragments = 1``).

Batches are drawn with this script's own seeded generator, not meshkit's
``client_seed``: figures here are a model of the real runs, which
``benchmarks/diloco.py`` then checks at the chosen settings.

    python benchmarks/diloco_sweep.py --steps 1200 --inner-steps 100 \
        --inner-lr 3e-3 --dp-lr 3e-3 --warmup 0 --outer-lr 0.7 --seeds 0 1
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from diloco import LM, TinyLM, ScheduledAdamW, data, entropy_floor, lm_loss  # noqa: E402
from meshkit.aggregation import decode_blocks, encode_blocks  # noqa: E402

REPLICAS = 4


def coded(values: np.ndarray, bits: int) -> np.ndarray:
    codes, scales = encode_blocks(values, bits)
    return decode_blocks(codes, scales, values.size, bits).reshape(values.shape)


class Setup:
    def __init__(self, args: argparse.Namespace) -> None:
        train, test = data()
        self.x, self.y = train.tensors
        self.tx, self.ty = test.tensors
        self.args = args
        self.shard = len(self.x) // REPLICAS

    def batch(self, seed: int, step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([seed, step, replica])
        rows = torch.from_numpy(np.sort(rng.choice(self.shard, self.args.batch, replace=False))
                                + replica * self.shard)
        return self.x[rows], self.y[rows]

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> float:
        return float(lm_loss(model(self.tx), self.ty))

    def optimizer(self, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
        a = self.args
        return ScheduledAdamW(model.parameters(), lr=lr, warmup=a.warmup, total=a.steps,
                              decay=a.decay)


def data_parallel(setup: Setup, seed: int, marks: list[int]) -> list[float]:
    torch.manual_seed(seed)
    model = TinyLM()
    opt = setup.optimizer(model, setup.args.dp_lr)
    curve = []
    for step in range(setup.args.steps):
        xs, ys = zip(*(setup.batch(seed, step, r) for r in range(REPLICAS)))
        opt.zero_grad(set_to_none=True)
        lm_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        if step + 1 in marks:
            curve.append(setup.evaluate(model))
    return curve


def diloco(setup: Setup, seed: int, marks: list[int]) -> list[float]:
    a = setup.args
    torch.manual_seed(seed)
    glob = TinyLM()
    models = [TinyLM() for _ in range(REPLICAS)]
    for m in models:
        m.load_state_dict(glob.state_dict())
    opts = [setup.optimizer(m, a.inner_lr) for m in models]
    momentum: dict[str, np.ndarray] = {}
    curve = []
    names = [n for n, _ in glob.named_parameters()]
    for outer in range(a.steps // a.inner_steps):
        for r, (m, opt) in enumerate(zip(models, opts)):
            for k in range(a.inner_steps):
                x, y = setup.batch(seed, outer * a.inner_steps + k, r)
                opt.zero_grad(set_to_none=True)
                lm_loss(m(x), y).backward()
                opt.step()
        g_params = dict(glob.named_parameters())
        locals_ = [dict(m.named_parameters()) for m in models]
        for name in names:
            start = g_params[name].detach().numpy().astype(np.float32)
            mean = np.mean([coded(start - p[name].detach().numpy(), a.bits) for p in locals_],
                           axis=0, dtype=np.float64).astype(np.float32)
            # meshkit's nesterov: b <- mu b + g (first b = g); x <- x - lr (g + mu b)
            b = momentum.get(name)
            b = mean.copy() if b is None else a.momentum * b + mean
            momentum[name] = b
            stepped = start - a.outer_lr * (mean + a.momentum * b)
            update = coded(stepped - start, a.bits)
            new = torch.from_numpy(start + update)
            with torch.no_grad():
                g_params[name].copy_(new)
                for p in locals_:
                    p[name].copy_(new)
        if (outer + 1) * a.inner_steps in marks:
            curve.append(setup.evaluate(glob))
    return curve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1200, help="steps a replica (equal tokens)")
    p.add_argument("--inner-steps", type=int, default=100, help="H")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--inner-lr", type=float, default=3e-3)
    p.add_argument("--dp-lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=0, help="linear warmup steps (both)")
    p.add_argument("--decay", choices=("none", "cosine"), default="none")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--bits", type=int, default=8, choices=(32, 8, 4))
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--only", choices=("both", "dp", "diloco"), default="both")
    args = p.parse_args()
    torch.set_num_threads(1)
    setup = Setup(args)
    marks = [args.inner_steps * (i + 1) for i in range(args.steps // args.inner_steps)]
    started = time.perf_counter()
    dps, dls = [], []
    for seed in args.seeds:
        if args.only != "diloco":
            dps.append(data_parallel(setup, seed, marks))
        if args.only != "dp":
            dls.append(diloco(setup, seed, marks))
    floor = entropy_floor(setup.tx, setup.ty)
    print(f"# {vars(args)}  floor {floor:.4f}  {time.perf_counter() - started:.0f} s")
    print(f"{'outer':>5} {'tokens':>9} {'dp loss':>16} {'diloco loss':>16} {'ratio':>22} "
          f"{'excess ratio':>14}")
    for i, mark in enumerate(marks):
        line = f"{i + 1:>5} {REPLICAS * mark * args.batch * LM['context']:>9}"
        if not dls:
            print(line + f" {statistics.median(c[i] for c in dps):>16.4f}", flush=True)
            continue
        dl = [c[i] for c in dls]
        if dps:
            dp = [c[i] for c in dps]
            ratio = [b / d for b, d in zip(dl, dp)]
            excess = [(b - floor) / (d - floor) for b, d in zip(dl, dp)]
            line += (f" {statistics.median(dp):>16.4f} {statistics.median(dl):>16.4f}"
                     f" {statistics.median(ratio):>8.4f} ({min(ratio):.4f}-{max(ratio):.4f})"
                     f" {statistics.median(excess):>14.3f}")
        else:
            line += f" {'':>16} {statistics.median(dl):>16.4f}"
        print(line, flush=True)
    assert all(math.isfinite(v) for c in dls for v in c)


if __name__ == "__main__":
    main()
