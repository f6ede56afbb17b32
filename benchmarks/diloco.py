"""DiLoCo against per-step data-parallel on a small transformer language model, 4 replicas.

Baseline: meshkit's ``data-parallel`` strategy (one averaged gradient every
step, float32 each way) on the same task, the same replicas and the same
number of tokens, in the same run. Compared: ``diloco`` with H inner steps
and int8 outer gradients (F = 1), and Streaming DiLoCo (F = 4).

The task is built here from a config (``LM``): a causal transformer trained
from scratch on CPU on a generated corpus -- a seeded second-order Markov
chain over a small vocabulary, so there is no download and no licence to
carry; its entropy bounds the loss from below. Every run is a real ``meshkit
run`` (local launch: 4 worker processes on loopback, authenticated and
encrypted links).

Bytes are the payload each strategy puts on the wire per replica and
direction, counted the same way for both: data-parallel's float32 gradients
up and the float32 mean down every step; DiLoCo's encoded pseudo-gradients
up and encoded outer updates down (codes and block scales, from its own
``bytes_up``/``bytes_down`` metrics). Frame headers and AEAD tags are not
counted for either.

    python benchmarks/diloco.py                    # H = 100, int8, 2 trials
    python benchmarks/diloco.py --trials 3 --outer-steps 3
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

import meshkit.torch
from meshkit.train import Runner, read_metrics

#: The model and corpus, as a config: small enough for minutes on two loaded cores.
LM = {"vocab": 24, "context": 24, "width": 48, "layers": 2, "heads": 4,
      "train_sequences": 8192, "test_sequences": 512, "corpus_seed": 1234}


def corpus(sequences: int, seed: int) -> torch.Tensor:
    """Sequences of a seeded second-order Markov chain: each pair of symbols allows 3 next."""
    rng = np.random.default_rng(LM["corpus_seed"])
    v = LM["vocab"]
    allowed = rng.integers(0, v, size=(v, v, 3))
    weights = rng.dirichlet(np.ones(3) * 0.5, size=(v, v))
    draw = np.random.default_rng(seed)
    out = np.empty((sequences, LM["context"] + 1), dtype=np.int64)
    out[:, :2] = draw.integers(0, v, size=(sequences, 2))
    for t in range(2, LM["context"] + 1):
        a, b = out[:, t - 2], out[:, t - 1]
        pick = (draw.random(sequences)[:, None] > np.cumsum(weights[a, b], axis=1)).sum(1)
        out[:, t] = allowed[a, b, np.minimum(pick, 2)]
    return torch.from_numpy(out)


def data() -> tuple[TensorDataset, TensorDataset]:
    train, test = corpus(LM["train_sequences"], 1), corpus(LM["test_sequences"], 2)
    return (TensorDataset(train[:, :-1], train[:, 1:]), TensorDataset(test[:, :-1], test[:, 1:]))


class TinyLM(nn.Module):
    """A causal transformer: token + position embeddings, pre-norm blocks, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        w = LM["width"]
        self.tokens = nn.Embedding(LM["vocab"], w)
        self.positions = nn.Embedding(LM["context"], w)
        block = nn.TransformerEncoderLayer(w, LM["heads"], 2 * w, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, LM["layers"], enable_nested_tensor=False)
        self.norm = nn.LayerNorm(w)
        self.head = nn.Linear(w, LM["vocab"])
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(
            LM["context"]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tokens(x) + self.positions.weight[: x.shape[1]]
        h = self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.head(self.norm(h))


def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


task = meshkit.torch.task(model=TinyLM, loss=lm_loss, data=data,
                          optimizer=lambda p, o: torch.optim.AdamW(p, lr=o.lr,
                                                                   weight_decay=0.0))


def config(path: Path, out: Path, strategy: str, seed: int) -> Path:
    path.write_text(f"""
[run]
task = "diloco:task"
seed = {seed}
out = "{out}"

[task]
lr = 0.003
threads = 1

[mesh]
launch = "local"
workers = 4
timeout = 600

{strategy}
""")
    return path


def run(kind: str, args: argparse.Namespace, seed: int, where: Path) -> dict[str, float]:
    h, steps = args.inner_steps, args.inner_steps * args.outer_steps
    if kind == "data-parallel":
        strategy = (f'[strategy]\nname = "data-parallel"\nrounds = {args.outer_steps}\n'
                    f'steps = {h}\nbatch_size = {args.batch}\n\n'
                    f'[outer_optimizer]\nname = "average"')
    else:
        fragments = 1 if kind.startswith("diloco F=1") else 4
        strategy = (f'[strategy]\nname = "diloco"\nrounds = {args.outer_steps}\n'
                    f'inner_steps = {h}\nfragments = {fragments}\n'
                    f'outer_bits = {args.bits}\nbatch_size = {args.batch}\n\n'
                    f'[outer_optimizer]\nname = "nesterov"\nlr = 0.7\nmomentum = 0.9')
    out = where / f"{kind.replace(' ', '_').replace('=', '')}-{seed}"
    started = time.perf_counter()
    report = Runner(str(config(where / "run.toml", out, strategy, seed)), overwrite=True).run()
    seconds = time.perf_counter() - started
    if not report.ok:
        raise SystemExit(f"{kind}: {report.error}")
    rows = read_metrics(out)
    params = sum(p.numel() for p in TinyLM().parameters())
    if kind == "data-parallel":
        # Per replica: float32 gradients up and the float32 mean down, every step.
        total = 4 * steps * params * 4 * 2
        peak = 4 * params * 4 * 2
    else:
        total = sum(r["bytes_up"] + r["bytes_down"] for r in rows)
        peak = max(r["peak_exchange_bytes"] for r in rows)
    return {"loss": rows[-1]["loss"], "bytes": float(total), "peak": float(peak),
            "seconds": seconds, "tokens": float(4 * steps * args.batch * LM["context"])}


def spread(values: list[float]) -> str:
    mean = statistics.mean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.4g} ± {sd:.2g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inner-steps", type=int, default=100, help="H")
    parser.add_argument("--outer-steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="sequences per replica step")
    parser.add_argument("--bits", type=int, default=8, choices=(32, 8, 4))
    parser.add_argument("--trials", type=int, default=2)
    args = parser.parse_args()
    # The workers import this file as the module "diloco" (the config's task).
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here,
                                                             os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, here)
    kinds = ["data-parallel", f"diloco F=1 int{args.bits}", f"diloco F=4 int{args.bits}"]
    results: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for trial in range(args.trials):
            for kind in kinds:
                results[kind].append(run(kind, args, seed=trial, where=Path(tmp)))
                print(f"trial {trial} {kind}: {results[kind][-1]}", flush=True)
    params = sum(p.numel() for p in TinyLM().parameters())
    print(f"\nTinyLM {params} parameters, 4 replicas, H = {args.inner_steps}, "
          f"{args.outer_steps} outer steps, {results[kinds[0]][0]['tokens']:.0f} tokens, "
          f"entropy floor of the corpus ~ see docs; {args.trials} trial(s), mean ± sd")
    base = results["data-parallel"]
    print(f"{'run':<18} {'eval loss':>16} {'loss / DP':>10} {'bytes':>14} {'DP / bytes':>10} "
          f"{'peak exch.':>12} {'seconds':>14}")
    for kind in kinds:
        rs = results[kind]
        ratio = [r["loss"] / b["loss"] for r, b in zip(rs, base)]
        saving = [b["bytes"] / r["bytes"] for r, b in zip(rs, base)]
        print(f"{kind:<18} {spread([r['loss'] for r in rs]):>16} {spread(ratio):>10} "
              f"{statistics.mean(r['bytes'] for r in rs):>14.4g} {spread(saving):>10} "
              f"{statistics.mean(r['peak'] for r in rs):>12.4g} "
              f"{spread([r['seconds'] for r in rs]):>14}")
    plain, streamed = results[kinds[1]], results[kinds[2]]
    print(f"streaming F=4 peak / plain peak: "
          f"{statistics.mean(s['peak'] for s in streamed) / statistics.mean(p['peak'] for p in plain):.3f}")
    assert all(math.isfinite(r["loss"]) for rs in results.values() for r in rs)


if __name__ == "__main__":
    main()
