"""torchrun starts meshkit: rank 0 runs the coordinator, every other rank a node (or, with
``[transport] mode = "spmd"``, every rank runs the same program: :mod:`meshkit_torchdist.spmd`).

Run one config on every process torchrun starts::

    torchrun --standalone --nproc-per-node 3 -m meshkit_torchdist CONFIG [--resume | --overwrite]
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 -m meshkit_torchdist CONFIG   # trust_network = true

The rule: the config says ``[mesh] transport = "torchdist"`` and ``workers =
WORLD_SIZE - 1`` (torchrun's world minus the coordinator); this module reads
RANK and WORLD_SIZE, and the transport rendezvouses ``env://`` (MASTER_ADDR,
MASTER_PORT). Rank 0 is ``meshkit run CONFIG`` with ``launch = "external"``
(its workers are torchrun's other processes): metrics, checkpoints and the
summary land in ``[run] out`` as for any run. Every other rank is ``meshkit
node``: it serves the coordinator's jobs until the run ends. Exit status: 0
when the run finished, 2 when it was refused or a rank was lost.

With ``[transport] mode = "spmd"`` there is no coordinator and ``[mesh]
workers`` is not checked against WORLD_SIZE (it is what ``meshkit run`` of
the same config starts): every rank plays its slice of each federated
round, and rank 0 writes ``[run] out``.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
from typing import Any

import attrs
import click

import meshkit
from meshkit.config import Selection, load_config
from meshkit.node import NodeConfig, caps_for, serve_node
from meshkit.pipeline import serve_pipeline_job
from meshkit.train import serve_train_job

from meshkit_torchdist.progress import print_progress

__all__ = ["main", "torchrun_config", "spmd_mode"]

log = logging.getLogger(__name__)


def _env_int(name: str) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw)
    except ValueError:
        raise meshkit.ConfigError(
            f"{name} = {raw!r}: python -m meshkit_torchdist runs under torchrun, which sets "
            f"RANK and WORLD_SIZE; start it with `torchrun --nproc-per-node N -m "
            f"meshkit_torchdist CONFIG`") from None


def torchrun_config(path: str, world: int) -> Any:
    """The config at ``path`` as this launch runs it: checked, ``env://``, external launch."""
    config = load_config(path)
    if config.mesh.transport != "torchdist":
        raise meshkit.ConfigError(
            f"{path}: [mesh] transport = {config.mesh.transport!r}; under torchrun set "
            f"transport = \"torchdist\" (torchrun's processes meet through torch.distributed)")
    if spmd_mode(config):
        return config  # every rank runs the config itself (meshkit_torchdist.spmd)
    if world < 2:
        # "workers = 0" would be the arithmetic, and [mesh] refuses it: a coordinator
        # with no worker has no one to train.
        raise meshkit.ConfigError(
            f"{path}: torchrun started WORLD_SIZE = {world} process: rank 0 is the "
            f"coordinator, and a run needs at least one worker. Start "
            f"{config.mesh.workers + 1} processes (torchrun --nproc-per-node "
            f"{config.mesh.workers + 1}) for [mesh] workers = {config.mesh.workers}, or set "
            f"[transport] mode = \"spmd\", where every rank trains")
    if config.mesh.workers != world - 1:
        raise meshkit.ConfigError(
            f"{path}: [mesh] workers = {config.mesh.workers}, but torchrun started "
            f"WORLD_SIZE = {world} processes: rank 0 is the coordinator, so set workers = "
            f"{world - 1} (or start {config.mesh.workers + 1} processes)")
    options = dict(config.transport.options)
    options.setdefault("init_method", "env://")
    transport = Selection(config.transport.kind, config.transport.name, options,
                          config.transport.where)
    return attrs.evolve(config, mesh=attrs.evolve(config.mesh, launch="external"),
                        transport=transport)


def spmd_mode(config: Any) -> bool:
    """Whether the config asks for every rank to run the same program (``mode = "spmd"``)."""
    return config.transport.options.get("mode", "coordinator") == "spmd"


def _coordinator(config: Any, *, resume: bool, overwrite: bool) -> int:
    if not (os.environ.get("MESHKIT_SECRET") or config.mesh.secret_file):
        # torchdist authenticates nothing, so no secret guards its links; the
        # runner's check for one (written for transports that use it) is met
        # with a throwaway value that never leaves this process.
        os.environ["MESHKIT_SECRET"] = secrets.token_hex(32)
    report = meshkit.run(config, launch="external", resume=resume, overwrite=overwrite,
                         progress=print_progress)
    print(f"meshkit_torchdist: rank 0: run {'finished' if report.ok else 'failed'}: "
          f"{report.rounds_completed}/{report.rounds} round(s), metrics "
          f"{ {k: round(v, 4) for k, v in report.metrics.items()} }"
          + (f"; {report.error}" if report.error else ""), flush=True)
    return 0 if report.ok else 2


def _node(config: Any, rank: int, world: int) -> int:
    node = NodeConfig(rank=rank, world=world, transport="torchdist",
                      transport_options=dict(config.transport.options),
                      timeout=config.mesh.timeout, trust_network=config.mesh.trust_network)
    group = node.connect()
    try:
        reports = serve_node(group, caps_for(node),
                             jobs={"train": serve_train_job, "pipeline": serve_pipeline_job})
    finally:
        group.close()
    stopped = [r for r in reports if r.error]
    return 2 if stopped else 0


@click.command(help="Run a meshkit config on the processes torchrun starts (rank 0: the "
                    "coordinator; others: nodes). CONFIG is the run's TOML config, with "
                    "[mesh] transport = \"torchdist\".")
@click.argument("config", metavar="CONFIG")
@click.option("--resume", is_flag=True,
              help="Continue from the run's last checkpoint (as meshkit run --resume).")
@click.option("--overwrite", is_flag=True,
              help="Replace an earlier run in [run] out (as meshkit run --overwrite).")
def command(config: str, resume: bool, overwrite: bool) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
        resolved = torchrun_config(config, world)
        if spmd_mode(resolved):
            from meshkit_torchdist.spmd import run_spmd  # torch loads only under torchrun

            return run_spmd(resolved, rank, world, resume=resume, overwrite=overwrite)
        if rank == 0:
            return _coordinator(resolved, resume=resume, overwrite=overwrite)
        return _node(resolved, rank, world)
    except meshkit.MeshError as exc:
        click.echo(f"meshkit_torchdist: rank {os.environ.get('RANK', '?')}: {exc}", err=True)
        return 2


def main(argv: list[str] | None = None) -> int:
    """Run :func:`command` on ``argv`` and return its exit status (a usage error is 2)."""
    try:
        code = command.main(args=argv, prog_name="python -m meshkit_torchdist",
                            standalone_mode=False)
    except click.ClickException as exc:  # a usage error: said as click says it
        exc.show()
        return exc.exit_code
    except click.Abort:
        return 1
    return int(code or 0)


def exit_now(code: int) -> None:
    """Leave without the interpreter's teardown, once every group is closed.

    A gloo receive still waiting on a peer that has not closed yet (it
    leaves when it reads our goodbye) makes an ordinary exit abort with
    "terminate called without an active exception": the run is over and its
    artifacts are written, so nothing is lost by skipping the teardown.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
