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

Bytes are measured on the wire, the same way for both: the tcp transport's
frame body bytes at the coordinator (``bytes_up``/``bytes_down`` of every
metrics row, both directions; on the star every replica's traffic crosses
it), plus, on a mesh (``--exchange ring``), what each replica's transport sent
for its ring collectives (``ring_bytes``: data-parallel's all-reduce of the
float32 gradients every step, DiLoCo's exact int16/int8 sum of its codes
every exchange), which the coordinator never sees. ``DP / wire, a step``
compares one outer step once running (rounds 2 on) against the data-parallel
run of the same exchange: DiLoCo's first round also sends the float32 model
to every replica, data-parallel's is sent before its first round. ``payload`` is what the
arithmetic says (data-parallel: float32 gradients up and the mean down every
step; DiLoCo: its encoded codes and scales, ``payload_up``/``payload_down``).
Frame headers and AEAD tags are not counted for either.

The inner optimizer is AdamW with an optional warmup and cosine schedule
(``ScheduledAdamW``; the workers read it from ``DILOCO_SCHEDULE``, which this
script sets). ``--torchft`` adds torchft's DiLoCo on the same model and data
(``diloco_torchft.py``); ``diloco_sweep.py`` runs the same arithmetic in one
process to sweep settings.

    python benchmarks/diloco.py --outer-steps 12 --trials 1 --fragments 1 --torchft
    python benchmarks/diloco.py --outer-steps 3 --fragments 1 --bits 8 4
    python benchmarks/diloco.py --outer-steps 3 --fragments 1 --bits 8 4 --exchange star ring
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
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

import meshkit.torch
from meshkit.train import Runner, read_metrics

#: The model and corpus, as a config: small enough for minutes on two loaded cores.
LM = {"vocab": 24, "context": 24, "width": 48, "layers": 2, "heads": 4,
      "train_sequences": 8192, "test_sequences": 512, "corpus_seed": 1234}


def chain() -> tuple[np.ndarray, np.ndarray]:
    """The corpus's second-order Markov chain: ``allowed[a, b]`` the 3 symbols that may follow
    ``a, b``, ``weights[a, b]`` their probabilities."""
    rng = np.random.default_rng(LM["corpus_seed"])
    v = LM["vocab"]
    return rng.integers(0, v, size=(v, v, 3)), rng.dirichlet(np.ones(3) * 0.5, size=(v, v))


def corpus(sequences: int, seed: int) -> torch.Tensor:
    """Sequences of a seeded second-order Markov chain: each pair of symbols allows 3 next."""
    v = LM["vocab"]
    allowed, weights = chain()
    draw = np.random.default_rng(seed)
    out = np.empty((sequences, LM["context"] + 1), dtype=np.int64)
    out[:, :2] = draw.integers(0, v, size=(sequences, 2))
    for t in range(2, LM["context"] + 1):
        a, b = out[:, t - 2], out[:, t - 1]
        pick = (draw.random(sequences)[:, None] > np.cumsum(weights[a, b], axis=1)).sum(1)
        out[:, t] = allowed[a, b, np.minimum(pick, 2)]
    return torch.from_numpy(out)


def entropy_floor(x: torch.Tensor, y: torch.Tensor) -> float:
    """The loss the chain itself scores on ``(x, y)``: no model can do better on average.

    The first target follows one uniform symbol (log vocab); every later one
    has probability ``weights[a, b]`` summed over the ``allowed`` entries it equals."""
    allowed, weights = chain()
    x, y = x.numpy(), y.numpy()
    a, b = x[:, :-1], x[:, 1:]
    p = (weights[a, b] * (allowed[a, b] == y[:, 1:, None])).sum(-1)
    nll = np.concatenate([np.full((len(y), 1), math.log(LM["vocab"])), -np.log(p)], axis=1)
    return float(nll.mean())


class ScheduledAdamW(torch.optim.AdamW):
    """AdamW whose learning rate follows a linear warmup over ``warmup`` steps, then (``decay
    = "cosine"``) a cosine to a tenth of it at step ``total``.

    The step count is the optimizer's own state (each parameter's ``step``), so a replica
    healed from a peer's optimizer state continues the schedule where the peer was."""

    def __init__(self, params: Any, *, lr: float, warmup: int = 0, total: int = 0,
                 decay: str = "none", **kw: Any) -> None:
        super().__init__(params, lr=lr, **kw)
        self.base, self.warmup, self.total, self.decay = lr, warmup, total, decay

    def factor(self, t: int) -> float:
        f = min(1.0, (t + 1) / self.warmup) if self.warmup else 1.0
        if self.decay == "cosine" and self.total:
            f *= 0.1 + 0.45 * (1 + math.cos(math.pi * min(t, self.total) / self.total))
        return f

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        first = self.param_groups[0]["params"][0]
        t = int(self.state[first]["step"]) if "step" in self.state.get(first, {}) else 0
        for group in self.param_groups:
            group["lr"] = self.base * self.factor(t)
        return super().step(closure)


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


def schedule() -> dict[str, Any]:
    """The inner optimizer's schedule, from the environment the benchmark sets for its workers
    (``[task]`` takes only the task's own options)."""
    warmup, total, decay = os.environ.get("DILOCO_SCHEDULE", "0,0,none").split(",")
    return {"warmup": int(warmup), "total": int(total), "decay": decay}


task = meshkit.torch.task(model=TinyLM, loss=lm_loss, data=data,
                          optimizer=lambda p, o: ScheduledAdamW(p, lr=o.lr, weight_decay=0.0,
                                                                **schedule()))


def config(path: Path, out: Path, strategy: str, seed: int, lr: float,
           topology: str = "star") -> Path:
    path.write_text(f"""
[run]
task = "diloco:task"
seed = {seed}
out = "{out}"

[task]
lr = {lr}
threads = 1

[mesh]
launch = "local"
workers = 4
timeout = 600
topology = "{topology}"

{strategy}
""")
    return path


def run(kind: str, args: argparse.Namespace, seed: int, where: Path) -> dict[str, Any]:
    h, steps = args.inner_steps, args.inner_steps * args.outer_steps
    ring = kind.endswith(" ring")
    if kind.startswith("data-parallel"):
        lr = args.dp_lr
        strategy = (f'[strategy]\nname = "data-parallel"\nrounds = {args.outer_steps}\n'
                    f'steps = {h}\nbatch_size = {args.batch}\n\n'
                    f'[outer_optimizer]\nname = "average"')
    else:
        lr = args.inner_lr
        fragments = int(kind.split("F=")[1].split()[0])
        bits = int(kind.split("int")[-1].split()[0]) if "int" in kind else 32
        strategy = (f'[strategy]\nname = "diloco"\nrounds = {args.outer_steps}\n'
                    f'inner_steps = {h}\nfragments = {fragments}\n'
                    f'outer_bits = {bits}\nbatch_size = {args.batch}\n'
                    f'exchange = "{"ring" if ring else "star"}"\n\n'
                    f'[outer_optimizer]\nname = "nesterov"\nlr = {args.outer_lr}\n'
                    f'momentum = {args.momentum}')
    out = where / f"{kind.replace(' ', '_').replace('=', '')}-{seed}"
    os.environ["DILOCO_SCHEDULE"] = f"{args.warmup},{steps},{args.decay}"
    started = time.perf_counter()
    report = Runner(str(config(where / "run.toml", out, strategy, seed, lr,
                               "mesh" if ring else "star")), overwrite=True).run()
    seconds = time.perf_counter() - started
    if not report.ok:
        raise SystemExit(f"{kind}: {report.error}")
    rows = read_metrics(out)
    params = sum(p.numel() for p in TinyLM().parameters())
    # Measured on the wire (the tcp transport's frame body bytes at the coordinator, both
    # ways, every round): on a star every replica's traffic crosses it, so this is all of it.
    # ... plus, on a mesh, what the replicas' transports sent for the ring collectives.
    wire = sum(r["bytes_up"] + r["bytes_down"] + r.get("ring_bytes", 0.0) for r in rows)
    if kind.startswith("data-parallel"):
        # What the arithmetic says it must be: float32 gradients up, the mean down, a step.
        payload = 4 * steps * params * 4 * 2
        peak = 4 * params * 4 * 2
    else:
        payload = sum(r["payload_up"] + r["payload_down"] for r in rows)
        peak = max(r["peak_exchange_bytes"] for r in rows)
    # An outer step's bytes once running (rounds 2 on): DiLoCo's first round also carries
    # the model to every replica (replica_init), data-parallel's is sent before round 1.
    steady = statistics.median(r["bytes_up"] + r["bytes_down"] + r.get("ring_bytes", 0.0)
                               for r in rows[1:])
    ring_part = statistics.median(r.get("ring_bytes", 0.0) for r in rows[1:])
    return {"loss": rows[-1]["loss"], "curve": [r["loss"] for r in rows],
            "wire": float(wire), "payload": float(payload), "peak": float(peak),
            "steady": float(steady), "ring": float(ring_part),
            "seconds": seconds, "tokens": float(4 * steps * args.batch * LM["context"])}


def spread(values: list[float], digits: int = 4) -> str:
    """median (min-max)"""
    return (f"{statistics.median(values):.{digits}g} "
            f"({min(values):.{digits}g}-{max(values):.{digits}g})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inner-steps", type=int, default=100, help="H")
    parser.add_argument("--outer-steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="sequences per replica step")
    parser.add_argument("--bits", type=int, nargs="+", default=[8], choices=(32, 8, 4))
    parser.add_argument("--fragments", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--inner-lr", type=float, default=3e-3)
    parser.add_argument("--dp-lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=0, help="inner lr warmup steps")
    parser.add_argument("--decay", choices=("none", "cosine"), default="none")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--first-seed", type=int, default=0, help="trial t runs seed first + t")
    parser.add_argument("--exchange", nargs="+", default=["star"], choices=("star", "ring"),
                        help="star: every run on the coordinator's star (the default "
                        "config); ring: [mesh] topology = \"mesh\", data-parallel all-reduces "
                        "over the ring and DiLoCo uses exchange = \"ring\"")
    parser.add_argument("--torchft", action="store_true",
                        help="also torchft's DiLoCo (benchmarks/diloco_torchft.py)")
    args = parser.parse_args()
    # The workers import this file as the module "diloco" (the config's task).
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here,
                                                             os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, here)
    def named(kind: str, exchange: str) -> str:
        return kind if exchange == "star" and args.exchange == ["star"] else f"{kind} {exchange}"

    kinds = [named("data-parallel", e) for e in args.exchange] + [
        named(f"diloco F={f} int{b}" if b != 32 else f"diloco F={f} f32", e)
        for e in args.exchange for b in args.bits for f in args.fragments]
    if args.torchft:
        kinds.append("torchft diloco")
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for trial in range(args.trials):
            seed = args.first_seed + trial
            for kind in kinds:  # interleaved: every kind once per trial
                if kind.startswith("torchft"):
                    from diloco_torchft import run_torchft
                    results[kind].append(run_torchft(args, seed=seed, where=Path(tmp)))
                else:
                    results[kind].append(run(kind, args, seed=seed, where=Path(tmp)))
                print(f"trial {trial} (seed {seed}) {kind}: {results[kind][-1]}", flush=True)
    params = sum(p.numel() for p in TinyLM().parameters())
    _, test = data()
    floor = entropy_floor(*test.tensors)
    print(f"\nTinyLM {params} parameters, 4 replicas, H = {args.inner_steps}, "
          f"{args.outer_steps} outer steps, {results[kinds[0]][0]['tokens']:.0f} tokens, "
          f"inner lr {args.inner_lr}, DP lr {args.dp_lr}, warmup {args.warmup}, "
          f"decay {args.decay}, outer lr {args.outer_lr} momentum {args.momentum}; "
          f"entropy floor of the test set {floor:.4f}; "
          f"{args.trials} trial(s), median (min-max)")
    print(f"{'run':<24} {'eval loss':>22} {'loss / DP':>22} {'wire bytes':>11} "
          f"{'DP / wire':>22} {'DP / wire, a step':>22} {'a step':>9} {'of it ring':>10} "
          f"{'payload':>10} {'peak exch.':>11} {'seconds':>18}")
    for kind in kinds:
        rs = results[kind]
        # Against the data-parallel run of the same exchange (star with star, ring with ring).
        same = [k for k in kinds if k.startswith("data-parallel")
                and k.endswith(" ring") == kind.endswith(" ring")]
        base = results[same[0] if same else kinds[0]]
        ratio = [r["loss"] / b["loss"] for r, b in zip(rs, base)]
        saving = [b["wire"] / r["wire"] for r, b in zip(rs, base)]
        steady = [b["steady"] / r["steady"] for r, b in zip(rs, base) if "steady" in r]
        print(f"{kind:<24} {spread([r['loss'] for r in rs]):>22} {spread(ratio):>22} "
              f"{statistics.median(r['wire'] for r in rs):>11.4g} {spread(saving):>22} "
              f"{spread(steady) if steady else '-':>22} "
              f"{statistics.median(r.get('steady', 0.0) for r in rs):>9.4g} "
              f"{statistics.median(r.get('ring', 0.0) for r in rs):>10.4g} "
              f"{statistics.median(r['payload'] for r in rs):>10.4g} "
              f"{statistics.median(r['peak'] for r in rs):>11.4g} "
              f"{spread([r['seconds'] for r in rs], 3):>18}")
    print("\nloss / DP after each outer step (median over trials):")
    for kind in [k for k in kinds if not k.startswith("data-parallel")]:
        rs = results[kind]
        same = [k for k in kinds if k.startswith("data-parallel")
                and k.endswith(" ring") == kind.endswith(" ring")]
        base = results[same[0] if same else kinds[0]]
        curve = [statistics.median(r["curve"][i] / b["curve"][i] for r, b in zip(rs, base))
                 for i in range(min(len(r["curve"]) for r in rs))]
        print(f"{kind:<24} " + " ".join(f"{c:.3f}" for c in curve))
    assert all(math.isfinite(r["loss"]) for rs in results.values() for r in rs)


if __name__ == "__main__":
    main()
