"""Compressed uploads against the uncompressed run and Flower 1.42, in bytes and accuracy.

Run (from the repository root)::

    python benchmarks/compression.py                     # digits and the torch CNN, 3 trials
    python benchmarks/compression.py --workload digits --trials 1
    python benchmarks/compression.py --workload digits --schemes secure,secure-int8
    python benchmarks/compression.py --workload digits --broadcast   # bytes up and down
    python benchmarks/compression.py --workload digits --grid        # one sum a worker up

Two workloads, each run by ``meshkit.run`` with local worker processes over
TCP on loopback (the transport counts every frame body both ways):

* **digits**: the shipped numpy MLP (2,410 float64 parameters), 100 clients
  (``federated``, contiguous shards, every client every round), 2 local
  epochs at lr 0.5, ``--digits-rounds`` rounds;
* **cnn**: ``examples/torch/digits_cnn.py``'s BatchNorm CNN (float32), 6
  clients, ``--cnn-rounds`` rounds, the example's options.

Schemes, each against the same run uncompressed (the baseline, in the same
invocation and with the same seeds): ``quantize`` 8 bits, ``quantize`` 2 bits
rotated, ``top-k`` 1.5 % with error feedback, ``top-k`` 1.5 % without.
``top-k-32x-ef`` and ``top-k-32x`` (with and without error feedback; not in
the default list) run at the largest fraction whose fields are at most 1/32
of the same keys in float32 on every chosen workload, as the plugin rounds
``k`` per key (0.014539930555555556 = 67/4608 for digits and the CNN
together), or at ``--topk-fraction``. ``top-k-gap8-v8-ef`` and ``top-k-gap8-v4-ef``
(not in the default list) send the kept indices as uint8 gaps and the values as 8- or
4-bit codes (``index = "gap8"``, ``value_bits``), error feedback kept by the worker, at the
largest fraction whose fields *at their declared bounds* (every filler a key could need,
a scale a key) are at most 1/32 of float32 on every chosen workload, or at
``--pack-fraction``.
Under secure aggregation (``secagg+``, ``clip_range`` ``--secure-clip``):
``secure`` (its own 32-bit field) against ``secure-int8`` (``quantize`` 8 bits
inside the masking field, ``8 + ceil(log2 n)`` bits); ``vs none`` is then
against ``secure``, and the bits a masked coordinate cost are also
*measured*: 32 less the bytes the int8 run's uploads saved per worker per
coordinate (``measured``).

Per row:

* ``bits/coord``: the compressed update's payload per compressed coordinate,
  from the encoder on the model's own keys (fields only; an error-feedback
  residual is counted separately, ``resid``) -- float32 is 32. The task's
  buffers (BatchNorm's running statistics) travel whole;
* ``up/fit``: bytes the coordinator's transport *received* per client fit,
  mean over rounds (the payload, the reply's metrics and framing, and with
  error feedback the client's residual, which rides the wire in a simulation
  because any worker may serve any client -- docs/compression.md);
  the uncompressed run's batched round uploads one exact partial per
  worker instead, so its figure is per worker partial;
* ``acc``: final accuracy, median over trials with (min, max), and its
  difference from the uncompressed run's median.

A second table gives, per scheme, the compressed keys' payload as the
wire's codec lays it out (``payload B``: a tensor-table entry per field,
its name and shape, each piece aligned to 64 bytes; the residual aside)
against the same keys in float32 (``f32 B``), the bytes the wire carried per
fit (``wire up/fit``, as above) per compressed coordinate (``wire bits``),
and each trial's accuracy minus the uncompressed run's with the same seed
(for the secure schemes too: against plain ``none`` when it ran).

The Flower 1.42 row is Flower's own serialisation of the same model's
arrays as float32 (``flwr.common.ndarrays_to_parameters``): Flower ships no
compression, so that is what each of its clients uploads per fit.

With ``--broadcast`` the schemes are ``none``, ``quantize-8`` and
``quantize-8+broadcast`` (``[compression] broadcast = true``: the model goes
down as a compressed delta against what each worker holds), and a second
table gives the bytes per round each way as the coordinator's transport
counted them: ``up/rnd``, ``down r1`` (the first round, which sends the
whole model) and ``down/rnd`` (the mean over the later rounds), each the
mean over trials, with the later rounds' (min, max) down.

With ``--grid`` the schemes are ``none``, ``quantize-8`` and
``quantize-8+grid`` (``[compression] clip_range = --grid-clip``: each worker
uploads one exact integer sum of its clients' codes on the shared grid, not
each client's payload), with the same bytes table.

A benchmark, not a test: it asserts nothing; the accuracy spread is over
seeds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads; workers inherit it

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

import meshkit  # noqa: E402
from meshkit.compression import encode_update, is_residual  # noqa: E402
from meshkit.task import buffer_keys  # noqa: E402
from meshkit.train import read_metrics  # noqa: E402

SCHEMES: dict[str, dict[str, Any] | None] = {
    "none": None,
    "quantize-8": {"name": "quantize", "bits": 8},
    "quantize-2-rotated": {"name": "quantize", "bits": 2, "rotate": True},
    "top-k-1.5%-ef": {"name": "top-k", "fraction": 0.015},
    "top-k-1.5%": {"name": "top-k", "fraction": 0.015, "error_feedback": False},
    # top-k at the largest fraction whose fields are <= 1/32 of float32 on every chosen
    # workload (set in main() by under_32(), or --topk-fraction).
    "top-k-32x-ef": {"name": "top-k", "fraction": 0.0},
    "top-k-32x": {"name": "top-k", "fraction": 0.0, "error_feedback": False},
    # Under [secure_aggregation] (SECURE); "secure" is their baseline.
    "secure": None,
    "secure-int8": {"name": "quantize", "bits": 8},
    # [compression] broadcast = true: the model goes down as a compressed delta too.
    "quantize-8+broadcast": {"name": "quantize", "bits": 8, "broadcast": True},
    # [compression] clip_range: one integer sum of codes a worker (--grid-clip sets it).
    "quantize-8+grid": {"name": "quantize", "bits": 8, "clip_range": 0.25},
    # Uncompressed, played flat (a round deadline no round reaches): each client uploads
    # its whole model, so a fit's bytes on the wire are measured (--efwire's baseline).
    "none-flat": None,
    # Error feedback with the residual kept by the worker (--efwire, --ef-fraction).
    "top-k-ef-worker": {"name": "top-k", "fraction": 0.0145, "residual": "worker"},
    "top-k-ef-coordinator": {"name": "top-k", "fraction": 0.0145},
    # More coordinates for the same bits (issue 37): the indices as uint8 gaps, the values
    # as 8- or 4-bit codes, at the largest fraction whose fields are at most 1/32 of float32
    # on every chosen workload by the plugin's bounds (under_32(); --pack-fraction), error
    # feedback kept by the worker so only the payload travels.
    "top-k-gap8-v8-ef": {"name": "top-k", "fraction": 0.0, "index": "gap8", "value_bits": 8,
                         "residual": "worker"},
    "top-k-gap8-v4-ef": {"name": "top-k", "fraction": 0.0, "index": "gap8", "value_bits": 4,
                         "residual": "worker"},
}
#: The schemes ``--broadcast`` compares.
BROADCAST = ("none", "quantize-8", "quantize-8+broadcast")
#: The schemes ``--grid`` compares.
GRID = ("none", "quantize-8", "quantize-8+grid")
#: ``--digits-hidden``: the digits MLP's hidden width (None: the task's default, 32).
DIGITS_HIDDEN: list[int | None] = [None]
#: The schemes ``--efwire`` compares.
EFWIRE = ("none", "none-flat", "top-k-ef-worker")
#: The schemes whose rounds are played flat (a round deadline they never reach).
FLAT = ("none-flat",)
#: The schemes that run under [secure_aggregation].
SECURE = ("secure", "secure-int8")
#: The schemes whose fraction main() sets (under_32()).
AT_32 = ("top-k-32x-ef", "top-k-32x")
#: The packed top-k schemes whose fraction main() sets (under_32() with their options).
PACKED = ("top-k-gap8-v8-ef", "top-k-gap8-v4-ef")


def _workload(name: str, rounds: int) -> dict[str, Any]:
    if name == "digits":
        return {"run": {"task": "digits"},
                "strategy": {"name": "federated", "rounds": rounds, "clients": 100,
                             "fraction": 1.0},
                "task": {"lr": 0.5, "epochs": 2,
                         **({"hidden": DIGITS_HIDDEN[0]} if DIGITS_HIDDEN[0] else {})}}
    return {"run": {"task": "examples.torch.digits_cnn:task"},
            "strategy": {"name": "federated", "rounds": rounds, "clients": 6,
                         "fraction": 1.0},
            "task": {"lr": 0.05, "epochs": 2, "batch_size": 32, "threads": 1}}


def run_one(workload: str, rounds: int, scheme: dict[str, Any] | None, seed: int,
            workers: int, out: Path, secure_clip: float | None = None,
            flat: bool = False) -> dict[str, float]:
    config = _workload(workload, rounds)
    config["run"].update({"seed": seed, "out": str(out)})
    config["mesh"] = {"launch": "local", "workers": workers, "transport": "tcp"}
    if scheme is not None:
        config["compression"] = dict(scheme)
    if secure_clip is not None:
        config["secure_aggregation"] = {"name": "secagg+", "clip_range": secure_clip}
    if flat:
        config["strategy"]["round_timeout"] = 3600.0
    meshkit.run(config)
    rows = read_metrics(out)
    fits = [r["secure_sum_of"] if secure_clip is not None
            else len(r["clients"]) if scheme is not None or flat else len(r["answered"])
            for r in rows]
    return {"accuracy": float(rows[-1]["accuracy"]), "cohort": statistics.mean(fits),
            "up_per_round": statistics.mean(r["bytes_up"] for r in rows),
            "up_per_fit": statistics.mean(r["bytes_up"] / n for r, n in zip(rows, fits)),
            "down_per_round": statistics.mean(r["bytes_down"] for r in rows),
            "up_later": statistics.mean(r["bytes_up"] for r in rows[1:] or rows),
            "down_first": float(rows[0]["bytes_down"]),
            "down_later": statistics.mean(r["bytes_down"] for r in rows[1:] or rows),
            "down_later_min": min(r["bytes_down"] for r in rows[1:] or rows),
            "down_later_max": max(r["bytes_down"] for r in rows[1:] or rows)}


def _task(workload: str) -> Any:
    hidden = {"hidden": DIGITS_HIDDEN[0]} if DIGITS_HIDDEN[0] else {}
    return meshkit.plugins.create("task", "digits", hidden) if workload == "digits" else \
        meshkit.task.create_task("examples.torch.digits_cnn:task", {"threads": 1})


def secure_coordinates(workload: str) -> int:
    """What one masked vector holds: every float array of the model."""
    state = _task(workload).init_state(0)
    return sum(v.size for v in state.values()
               if isinstance(v, np.ndarray) and v.dtype.kind == "f")


def payload_bits(workload: str, scheme: dict[str, Any] | None,
                 cohort: int = 0) -> tuple[float, float]:
    """(payload bits per float coordinate, residual bits per coordinate) on the model;
    ``cohort`` > 0: under secure aggregation, the round's field."""
    if cohort:
        return (32.0 if scheme is None else scheme["bits"] + (cohort - 1).bit_length()), 0.0
    task = _task(workload)
    state = task.init_state(0)
    # What the round engine compresses: float arrays, the task's buffers aside (sent whole).
    floats = {k: v for k, v in state.items() if k not in buffer_keys(task)
              and isinstance(v, np.ndarray) and v.dtype.kind == "f" and v.size}
    coords = sum(v.size for v in floats.values())
    if scheme is None:
        return 32.0, 0.0
    options = {k: v for k, v in scheme.items()
               if k not in ("name", "broadcast", "clip_range", "residual")}
    compressor = meshkit.plugins.create("compression", scheme["name"], options)
    rng = np.random.default_rng(0)
    fitted = {k: v + rng.standard_normal(v.shape).astype(v.dtype) * 0.01
              for k, v in floats.items()}
    payload, residual = encode_update(compressor, floats, fitted, seed=1)
    sent = sum(a.nbytes for k, a in payload.items() if not is_residual(k))
    if scheme.get("residual") == "worker":  # kept by the worker: it never travels
        return 8 * sent / coords, 0.0
    return 8 * sent / coords, 8 * sum(a.nbytes for a in residual.values()) / coords


def _compressed_floats(workload: str) -> dict[str, np.ndarray]:
    """The keys the round engine compresses: float arrays, the task's buffers aside."""
    task = _task(workload)
    state = task.init_state(0)
    return {k: v for k, v in state.items() if k not in buffer_keys(task)
            and isinstance(v, np.ndarray) and v.dtype.kind == "f" and v.size}


def under_32(workloads: list[str], options: dict[str, Any] | None = None) -> float:
    """The largest top-k ``fraction`` whose fields are at most 1/32 of the same keys in
    float32 on every workload, by the plugin's own ``bounds`` (the most elements each field
    may hold: for ``index = "gap8"`` every filler a key could need, so the payload is under
    1/32 whatever the update), ``options`` the top-k's others (``index``, ``value_bits``)."""
    sizes = [[v.size for v in _compressed_floats(w).values()] for w in workloads]
    compressor = meshkit.plugins.create("compression", "top-k",
                                        {**(options or {}), "fraction": 0.01})

    def most_bytes(n: int) -> int:
        return sum(np.dtype(d).itemsize * most for d, most in compressor.bounds(n).values())

    def fits(fraction: float) -> bool:
        compressor.fraction = fraction
        return all(sum(most_bytes(n) for n in ns) * 32 <= 4 * sum(ns) for ns in sizes)

    # The payload grows with the fraction: the largest that fits, to a float's precision.
    low, high = 0.0, 1.0
    if not fits(float(np.nextafter(0.0, 1.0))):
        raise SystemExit("no top-k fraction gets under 1/32 of float32 on "
                         + ", ".join(workloads))
    for _ in range(200):
        mid = (low + high) / 2
        if mid in (low, high):
            break
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def encoded_bytes(workload: str, scheme: dict[str, Any] | None) -> tuple[int, int]:
    """(the compressed keys' payload, the same keys in float32), each as the wire's codec lays
    it out (``meshkit.wire.encode_state``: a tensor-table entry per field with its name and
    shape, each piece aligned to 64 bytes), the residual aside."""
    from meshkit.wire import encode_state

    floats = _compressed_floats(workload)
    plain = encode_state({k: np.asarray(v, np.float32) for k, v in floats.items()}).nbytes
    if scheme is None:
        return plain, plain
    options = {k: v for k, v in scheme.items()
               if k not in ("name", "broadcast", "clip_range", "residual")}
    compressor = meshkit.plugins.create("compression", scheme["name"], options)
    rng = np.random.default_rng(0)
    fitted = {k: v + rng.standard_normal(v.shape).astype(v.dtype) * 0.01
              for k, v in floats.items()}
    payload, _ = encode_update(compressor, floats, fitted, seed=1)
    return encode_state({k: a for k, a in payload.items() if not is_residual(k)}).nbytes, plain


def flower_bytes(workload: str) -> int:
    """What a Flower 1.42 client uploads per fit: its own serialisation of the float32 arrays."""
    from flwr.common import ndarrays_to_parameters

    arrays = [np.asarray(v, np.float32) for v in _task(workload).init_state(0).values()
              if isinstance(v, np.ndarray)]
    return sum(len(t) for t in ndarrays_to_parameters(arrays).tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("digits", "cnn", "both"), default="both")
    parser.add_argument("--digits-rounds", type=int, default=100)
    parser.add_argument("--cnn-rounds", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0,
                        help="trial t runs seed FIRST_SEED + t (more trials in a later run)")
    parser.add_argument("--schemes", default=None,
                        help="comma list of: " + ", ".join(SCHEMES).replace("%", "%%")
                        + " (default: every one but the secure and broadcast ones)")
    parser.add_argument("--broadcast", action="store_true",
                        help="compare " + ", ".join(BROADCAST) + " and print the bytes per "
                        "round up and down")
    parser.add_argument("--grid", action="store_true",
                        help="compare " + ", ".join(GRID) + " and print the bytes per round "
                        "up and down")
    parser.add_argument("--efwire", action="store_true",
                        help="compare " + ", ".join(EFWIRE) + " and print the measured "
                        "upload per fit against the flat uncompressed run's")
    parser.add_argument("--digits-hidden", type=int, default=None,
                        help="the digits MLP's hidden width (default: the task's, 32)")
    parser.add_argument("--ef-fraction", type=float, default=0.0145,
                        help="top-k's fraction in the top-k-ef-* schemes")
    parser.add_argument("--grid-clip", type=float, default=0.25,
                        help="[compression] clip_range of quantize-8+grid")
    parser.add_argument("--secure-clip", type=float, default=0.25,
                        help="[secure_aggregation] clip_range of the secure schemes")
    parser.add_argument("--topk-fraction", type=float, default=None,
                        help="top-k fraction of " + ", ".join(AT_32) + " (default: the largest "
                        "whose fields are at most 1/32 of float32 on every chosen workload)")
    parser.add_argument("--pack-fraction", type=float, default=None,
                        help="top-k fraction of " + ", ".join(PACKED) + " (default: the largest "
                        "whose fields, at their bounds, are at most 1/32 of float32 on every "
                        "chosen workload)")
    args = parser.parse_args()
    workloads = ("digits", "cnn") if args.workload == "both" else (args.workload,)
    DIGITS_HIDDEN[0] = args.digits_hidden
    fraction = args.topk_fraction or under_32(list(workloads))
    for name in AT_32:
        SCHEMES[name] = {**(SCHEMES[name] or {}), "fraction": fraction}
    chosen_early = args.schemes.split(",") if args.schemes else []
    for name in PACKED:
        if name in chosen_early:
            packed = SCHEMES[name] or {}
            SCHEMES[name] = {**packed, "fraction": args.pack_fraction or under_32(
                list(workloads), {k: packed[k] for k in ("index", "value_bits")})}
            print(f"{name}: fraction {SCHEMES[name]['fraction']!r}", flush=True)
    SCHEMES["quantize-8+grid"] = {**SCHEMES["quantize-8+grid"], "clip_range": args.grid_clip}
    for name in ("top-k-ef-worker", "top-k-ef-coordinator"):
        SCHEMES[name] = {**(SCHEMES[name] or {}), "fraction": args.ef_fraction}
    default = BROADCAST if args.broadcast else GRID if args.grid else EFWIRE if args.efwire \
        else [s for s in SCHEMES if s not in SECURE and s not in (
            "quantize-8+broadcast", "quantize-8+grid", *EFWIRE[1:], "top-k-ef-coordinator")]
    chosen = [s for s in args.schemes.split(",") if s] if args.schemes else list(default)
    if any(s in AT_32 for s in chosen):
        print(f"{', '.join(s for s in chosen if s in AT_32)}: fraction {fraction!r}", flush=True)
    for workload in workloads:
        rounds = args.digits_rounds if workload == "digits" else args.cnn_rounds
        results: dict[str, list[dict[str, float]]] = {s: [] for s in chosen}
        for trial in range(args.trials):
            for name in chosen:
                with tempfile.TemporaryDirectory() as tmp:
                    results[name].append(run_one(
                        workload, rounds, SCHEMES[name], args.first_seed + trial, args.workers,
                        Path(tmp) / "run",
                        args.secure_clip if name in SECURE else None, flat=name in FLAT))
                print(f"{workload} seed {args.first_seed + trial} {name}: accuracy "
                      f"{results[name][-1]['accuracy']:.4f}", flush=True)
        nan = [{"accuracy": float("nan")}]
        base = statistics.median(r["accuracy"] for r in results.get("none") or nan)
        secure_base = statistics.median(r["accuracy"] for r in results.get("secure") or nan)
        print(f"\n{workload}: {rounds} rounds, {args.trials} trials (seeds "
              f"{args.first_seed}..{args.first_seed + args.trials - 1})")
        print(f"{'scheme':<22}{'bits/coord':>11}{'vs f32':>8}{'resid':>7}{'up/fit B':>10}"
              f"{'down/rnd B':>12}  accuracy median (min, max)  vs none")
        for name in chosen:
            cohort = round(results[name][0]["cohort"]) if name in SECURE else 0
            bits, resid = payload_bits(workload, SCHEMES[name], cohort)
            accs = [r["accuracy"] for r in results[name]]
            med = statistics.median(accs)
            against = secure_base if name in SECURE else base
            print(f"{name:<22}{bits:>11.2f}{32 / bits:>7.1f}x{resid:>7.0f}"
                  f"{statistics.mean(r['up_per_fit'] for r in results[name]):>10.0f}"
                  f"{statistics.mean(r['down_per_round'] for r in results[name]):>12.0f}  "
                  f"{med:.4f} ({min(accs):.4f}, {max(accs):.4f})  {100 * (med - against):+.2f} pt")
        if all(s in results for s in SECURE):
            saved = (statistics.mean(r["up_per_round"] for r in results["secure"])
                     - statistics.mean(r["up_per_round"] for r in results["secure-int8"]))
            # One masked vector per worker per round: the coordinates and secagg+'s 2 checks.
            per = args.workers * (secure_coordinates(workload) + 2)
            print(f"secure-int8: measured {32 - 8 * saved / per:.2f} bits a masked coordinate "
                  f"(32 less the bytes saved per worker per coordinate; cohort "
                  f"{results['secure-int8'][0]['cohort']:.0f})")
        if args.broadcast or args.grid:
            _bytes_table(chosen, results)
        _wire_table(workload, chosen, results, base)
        if "none-flat" in results:
            _upload_table(workload, chosen, results)
        flower = flower_bytes(workload)
        print(f"{'flower-1.42 (none)':<22}{32.0:>11.2f}{1.0:>7.1f}x{0:>7}{flower:>10}"
              f"{'':>12}  (Flower's FedAvg uploads these bytes per fit; no compression)\n",
              flush=True)


def _wire_table(workload: str, chosen: list[str], results: dict[str, list[dict[str, float]]],
                base: float) -> None:
    """The payload as the codec lays it out, against float32; and what the wire carried."""
    coords = sum(v.size for v in _compressed_floats(workload).values())
    print(f"\n{'scheme':<22}{'payload B':>10}{'f32 B':>8}{'ratio':>8}{'bits/coord':>11}"
          f"{'wire up/fit':>12}{'wire bits':>10}  vs none (each trial, pt)")
    for name in chosen:
        scheme = SCHEMES[name]
        sent, plain = encoded_bytes(workload, scheme) if name not in SECURE else (0, 0)
        up = statistics.mean(r["up_per_fit"] for r in results[name])
        paired = " ".join(f"{100 * (r['accuracy'] - b['accuracy']):+.2f}"
                          for r, b in zip(results[name], results.get("none", [])))
        median = statistics.median(r["accuracy"] for r in results[name])
        codec = (f"{sent:>10}{plain:>8}{plain / sent:>7.1f}x{8 * sent / coords:>11.3f}"
                 if sent else f"{'-':>10}{'-':>8}{'-':>8}{'-':>11}")  # secure: nothing of it
        print(f"{name:<22}{codec}{up:>12.0f}{8 * up / coords:>10.2f}  {paired} "
              f"(median {100 * (median - base):+.2f})")


def _bytes_table(chosen: list[str], results: dict[str, list[dict[str, float]]]) -> None:
    """Bytes per round each way, as the coordinator's transport counted them."""
    def mean(name: str, field: str) -> float:
        return statistics.mean(r[field] for r in results[name])

    base = mean("none", "down_later") if "none" in results else float("nan")
    print(f"\n{'scheme':<22}{'up/rnd B':>10}{'down r1 B':>11}{'down/rnd B':>12}"
          f"{'(min, max)':>18}{'down vs none':>14}")
    for name in chosen:
        low = min(r["down_later_min"] for r in results[name])
        high = max(r["down_later_max"] for r in results[name])
        print(f"{name:<22}{mean(name, 'up_later'):>10.0f}{mean(name, 'down_first'):>11.0f}"
              f"{mean(name, 'down_later'):>12.0f}{f'({low:.0f}, {high:.0f})':>18}"
              f"{mean(name, 'down_later') / base:>13.3f}x")


def _upload_table(workload: str, chosen: list[str],
                  results: dict[str, list[dict[str, float]]]) -> None:
    """Each scheme's upload per fit as the transport counted it, against the flat
    uncompressed run's (every client uploads its whole model): the raw ratio, and the
    ratio of what is left once the fixed part of a reply (its metrics, names and framing:
    the flat run's bytes less its model's) is taken off, against float32's bytes."""
    state = _task(workload).init_state(0)
    model = sum(int(v.nbytes) for v in state.values() if isinstance(v, np.ndarray))
    f32 = sum(4 * int(v.size) for v in state.values() if isinstance(v, np.ndarray))
    flat = statistics.mean(r["up_per_fit"] for r in results["none-flat"])
    fixed = flat - model
    print(f"\nmeasured upload per fit: the flat uncompressed fit {flat:.0f} B = the model "
          f"{model} B + {fixed:.0f} B fixed (metrics, names, framing); float32: {f32} B")
    print(f"{'scheme':<22}{'up/fit B':>10}{'(min, max)':>18}{'vs flat':>9}"
          f"{'less fixed':>12}{'vs f32':>9}")
    for name in chosen:
        if name in ("none", "none-flat"):
            continue
        fits = [r["up_per_fit"] for r in results[name]]
        up = statistics.mean(fits)
        print(f"{name:<22}{up:>10.0f}{f'({min(fits):.0f}, {max(fits):.0f})':>18}"
              f"{up / flat:>9.4f}{up - fixed:>12.0f}{(up - fixed) / f32:>9.4f}")


if __name__ == "__main__":
    main()
