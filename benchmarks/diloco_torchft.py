"""torchft's DiLoCo on ``benchmarks/diloco.py``'s model and data: 4 replica processes, gloo on
CPU, torchft's lighthouse. Run by ``python benchmarks/diloco.py --torchft`` (the same run, the
same settings); needs ``pip install torchft`` (0.2.0 keeps torch 2.13.0; not a meshkit
dependency).

Each replica is one process and one replica group of world size 1 (its own
TCPStore, a ``torchft.Manager`` with ``min_replica_size = 4``, a
``ProcessGroupGloo``), wrapped in ``torchft.local_sgd.DiLoCo`` with
``sync_every = H`` and the outer optimizer ``torch.optim.SGD(lr, momentum,
nesterov=True)`` -- the same rule as meshkit's ``nesterov``. The inner optimizer,
its schedule, the shards (4 contiguous ones) and the batch size are
``diloco.py``'s; the batches are drawn as ``diloco_sweep.py`` draws them.
Pseudo-gradients travel as float32: torchft's ``should_quantize`` needs its
CUDA kernels.

Bytes: ``wire`` is what ``ss`` reports as ``bytes_sent`` on every TCP socket
each replica process holds at the end of its run (gloo's pairs, the store,
the manager's and lighthouse's gRPC), summed over replicas -- every replica's
sends are some replica's receives, so both directions are counted once each
as for meshkit's coordinator count; ``payload`` is the bytes handed to
``Manager.allreduce`` times gloo's ring factor 2 (n - 1) / n, per replica.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPLICAS = 4


def run_torchft(args: argparse.Namespace, seed: int, where: Path) -> dict[str, Any]:
    """One torchft DiLoCo run: the lighthouse here, 4 replica processes; their figures."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=REPLICAS)
    outs = [where / f"torchft-{seed}-{i}.json" for i in range(REPLICAS)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    settings = json.dumps({k: getattr(args, k) for k in (
        "inner_steps", "outer_steps", "batch", "inner_lr", "warmup", "decay", "outer_lr",
        "momentum")})
    started = time.perf_counter()
    logs = [open(where / f"torchft-{seed}-{i}.log", "wb") for i in range(REPLICAS)]
    procs = [subprocess.Popen([sys.executable, str(Path(__file__)), "--replica", str(i),
                               "--lighthouse", lighthouse.address(), "--seed", str(seed),
                               "--settings", settings, "--out", str(outs[i])], env=env,
                              stdout=logs[i], stderr=subprocess.STDOUT)
             for i in range(REPLICAS)]
    try:
        codes = [p.wait(timeout=3600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lighthouse.shutdown()
        for log in logs:
            log.close()
    seconds = time.perf_counter() - started
    if any(codes):
        raise SystemExit(f"torchft diloco: replica exit codes {codes}; see "
                         f"{where}/torchft-{seed}-*.log")
    reports = [json.loads(o.read_text()) for o in outs]
    steps = args.inner_steps * args.outer_steps
    return {"loss": reports[0]["curve"][-1], "curve": reports[0]["curve"],
            "wire": float(sum(r["wire"] for r in reports)),
            "payload": float(sum(r["payload"] for r in reports)),
            "peak": float(max(r["peak"] for r in reports)) * REPLICAS,
            "seconds": seconds, "tokens": float(REPLICAS * steps * args.batch * 24),
            "equal_models": len({r["digest"] for r in reports}) == 1}


def _socket_bytes_sent(pid: int) -> int:
    """Sum of ``bytes_sent`` over the TCP sockets ``ss`` attributes to process ``pid``."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    total, mine = 0, False
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):
            mine = f"pid={pid}," in line
            continue
        if mine:
            found = re.search(r"\bbytes_sent:(\d+)", line)
            total += int(found.group(1)) if found else 0
    return total


def replica(i: int, lighthouse: str, seed: int, settings: dict[str, Any], out: Path) -> None:
    import hashlib

    import numpy as np
    import torch
    from torch.distributed import TCPStore
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from diloco import LM, ScheduledAdamW, TinyLM, data, lm_loss

    torch.set_num_threads(1)
    s = argparse.Namespace(**settings)
    train, test = data()
    x, y = train.tensors
    tx, ty = test.tensors
    shard = len(x) // REPLICAS
    torch.manual_seed(seed)
    model = TinyLM()  # the same initial bits on every replica (same seed): no init sync
    inner = ScheduledAdamW(model.parameters(), lr=s.inner_lr, weight_decay=0.0,
                           warmup=s.warmup, total=s.inner_steps * s.outer_steps, decay=s.decay)
    outer = torch.optim.SGD(model.parameters(), lr=s.outer_lr, momentum=s.momentum,
                            nesterov=True)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    long = timedelta(seconds=1800)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=long), min_replica_size=REPLICAS, use_async_quorum=False,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]),
                                    inner.load_state_dict(sd["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
        lighthouse_addr=lighthouse, replica_id=f"replica{i}", hostname="127.0.0.1",
        timeout=long, quorum_timeout=long, connect_timeout=timedelta(seconds=60),
        init_sync=False)
    handed = [0]
    allreduce = manager.allreduce

    def counted(tensor: torch.Tensor, *a: Any, **kw: Any) -> Any:
        handed[0] += tensor.numel() * tensor.element_size()
        return allreduce(tensor, *a, **kw)

    manager.allreduce = counted  # type: ignore[method-assign]
    curve: list[float] = []
    step = 0
    with DiLoCo(manager, [model], inner, outer, sync_every=s.inner_steps, pin_memory=False):
        while manager.current_step() < s.outer_steps:
            rng = np.random.default_rng([seed, step, i])
            rows = torch.from_numpy(np.sort(rng.choice(shard, s.batch, replace=False))
                                    + i * shard)
            before = manager.current_step()
            inner.zero_grad(set_to_none=True)
            lm_loss(model(x[rows]), y[rows]).backward()
            inner.step()  # DiLoCo's hook syncs every H steps
            step += 1
            if manager.current_step() != before:
                with torch.no_grad():
                    curve.append(float(lm_loss(model(tx), ty)))
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    ring = 2 * (REPLICAS - 1) / REPLICAS
    per_sync = sum(p.numel() * p.element_size() for p in model.parameters())
    report = {"curve": curve, "inner_steps": step, "digest": digest,
              "payload": handed[0] * ring, "peak": per_sync * ring,
              "wire": _socket_bytes_sent(os.getpid()), "context": LM["context"]}
    out.write_text(json.dumps(report))
    manager.shutdown(wait=False)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settings", required=True)
    parser.add_argument("--out", type=Path, required=True)
    a = parser.parse_args()
    replica(a.replica, a.lighthouse, a.seed, json.loads(a.settings), a.out)
