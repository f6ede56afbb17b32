"""The large model of ``large_model.py`` through Flower 1.42's simulation (issue 39).

``large_model.py --flower`` runs this beside meshkit in the same run: the same
``synthetic`` task (``params`` float32 parameters, fit = state + seeded noise),
two clients (``num_supernodes = 2``), FedAvg over every client each round
(``fraction_train = 1``, no evaluation round), ``rounds`` rounds, through
``flwr.simulation.run_simulation`` (Flower's Simulation Engine: the
ServerApp in this process, each ClientApp in a Ray actor, one CPU each).

It runs in a child process (``python benchmarks/flower_large.py --child``)
watched from outside: every 0.2 s the driver's own peak RSS (``VmHWM``, what
meshkit's coordinator reports) and the resident sets of its whole process tree
(Ray's raylet, GCS and actors included) are read. A tree past ``cap`` bytes is
killed, so the simulation cannot take the machine's memory from everything else
on it; the result then says so. Whatever stops it (the cap, an exception, a
protobuf or gRPC size limit, Ray missing) is reported with the last lines of
its stderr: the benchmark prints what happened rather than a number.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _status(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _session(sid: int) -> list[int]:
    """Every process of session ``sid`` (Ray's daemons outlive their parent's tree links)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    found.append(int(entry))
            except OSError:
                continue
    return found


def run(params: int, rounds: int, cap: int, budget: float) -> dict[str, Any]:
    """One Flower simulation of the large model; its peak memory and time, or how it ended."""
    try:
        import flwr  # noqa: F401
    except ImportError as exc:
        return {"ok": False, "why": f"flwr is not installed ({exc}); pip install -e '.[flower]'"}
    import importlib.util
    if importlib.util.find_spec("ray") is None:
        return {"ok": False, "why": "Flower's Simulation Engine needs Ray, which is not "
                                    "installed (pip install 'flwr[simulation]')"}
    from flwr import __version__ as version  # type: ignore[attr-defined]
    done_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"flower-large-{os.getpid()}.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'plugins'}",
           "RAY_DEDUP_LOGS": "0", "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--child", "--params", str(params),
                             "--rounds", str(rounds), "--done", str(done_file)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, text=True)
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.extend(proc.stderr or []), daemon=True)
    reader.start()
    peak_tree = peak_driver = 0
    killed = ""
    while proc.poll() is None:
        members = _session(proc.pid)
        tree = sum(_status(p, "VmRSS") for p in members)
        peak_tree = max(peak_tree, tree)
        peak_driver = max(peak_driver, _status(proc.pid, "VmHWM"))
        if tree > cap:
            killed = f"killed at {tree / 2**20:.0f} MiB of resident memory (the cap)"
        elif time.perf_counter() - started > budget:
            killed = f"killed after {budget:.0f} s (the time budget)"
        if killed:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    proc.wait()
    for pid in _session(proc.pid):  # Ray's daemons, if any outlived the driver
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    reader.join(5)
    wall = time.perf_counter() - started
    result: dict[str, Any] = {"version": version, "wall": wall, "peak_tree": peak_tree,
                              "peak_driver": peak_driver, "returncode": proc.returncode}
    if done_file.exists():
        result.update(json.loads(done_file.read_text()))
        done_file.unlink()
    progress = Path(str(done_file) + ".progress")
    if progress.exists():  # what the driver logged as it went (it may have been killed)
        result["progress"] = progress.read_text().strip().splitlines()
        progress.unlink()
    result["ok"] = not killed and proc.returncode == 0 and "rounds_done" in result
    if not result["ok"]:
        lines = [line.strip() for line in stderr if "[ROUND" in line or "Error" in line
                 or "error" in line]
        tail = " | ".join(lines[-6:]) or "".join(stderr)[-800:].strip()
        result["why"] = (f"{killed}; last log lines: {tail}" if killed
                         else f"exit status {proc.returncode}: {tail or '(no stderr)'}")
    return result


def child(params: int, rounds: int, done: str) -> None:
    """The simulation itself (in the child process)."""
    import resource

    import numpy as np
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation
    from meshkit_tasks.synthetic import SyntheticOptions, SyntheticTask

    task = SyntheticTask(SyntheticOptions(params=params, rows=1024))
    started = time.perf_counter()
    log = open(done + ".progress", "a", buffering=1)

    def note(what: str) -> None:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        log.write(f"{time.perf_counter() - started:.1f} s: {what} (driver peak so far "
                  f"{rss / 2**20:.0f} MiB)\n")
    client_app = ClientApp()
    rounds_done: list[float] = []

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        client = int(context.node_config["partition-id"])
        state = {"w0": msg.content["arrays"].to_numpy_ndarrays()[0]}
        x, y = task.train_data()
        half = len(x) // 2
        rows = slice(client * half, (client + 1) * half)
        fit = task.fit(state, x[rows], y[rows],
                       seed=int(msg.content["config"]["server-round"]) * 1_000_003 + client)
        del state
        content = RecordDict({"arrays": ArrayRecord([np.asarray(fit.state["w0"])]),
                              "metrics": MetricRecord({"num-examples": int(fit.examples)})})
        return Message(content=content, reply_to=msg)

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=2,
                          min_evaluate_nodes=0, min_available_nodes=2)
        initial = ArrayRecord([task.init_state(1)["w0"]])
        note("initial model built, strategy starting")
        last = [time.perf_counter()]

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            now = time.perf_counter()
            if server_round >= 1:
                rounds_done.append(now - last[0])
                note(f"round {server_round} done, {now - last[0]:.1f} s")
            last[0] = now
            return MetricRecord({})

        strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds,
                       evaluate_fn=evaluate)

    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=2,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 2, "include_dashboard": False}})
    Path(done).write_text(json.dumps({
        "rounds_done": len(rounds_done), "seconds": rounds_done,
        "driver_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--done", default="")
    parser.add_argument("--cap", type=float, default=12 * 2**30)
    parser.add_argument("--budget", type=float, default=900.0)
    args = parser.parse_args()
    if args.child:
        child(int(args.params), args.rounds, args.done)
    else:
        print(json.dumps(run(int(args.params), args.rounds, int(args.cap), args.budget),
                         indent=1))
