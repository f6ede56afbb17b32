"""``[transport] mode = "spmd"``: every torchrun process runs the same program; one int64 sum a round.

Each rank runs the config's federated run itself (:func:`run_spmd`): the
same components from the same seed, so the same cohort each round; it fits
its slice of the cohort and folds it into an exact fixed-point partial, and
:class:`GlooReducer` sums the ranks' partials with one gloo all-reduce per
round (:mod:`meshkit.train._rounds.collective` is the round; docs/scaling-out.md
the user's view). Rank 0 writes the run's files in ``[run] out``; every
other rank runs with a private scratch directory that is removed at the end
(``--resume`` copies rank 0's checkpoint into it first, so on several hosts
``out`` must be on a filesystem every rank can read).

The process group: the c10d store torchrun's agent hosts (or, without an
agent, the one rank 0 hosts on the rendezvous address only, as the
``torchdist`` transport does), one ``ProcessGroupGloo`` of every rank, its
sockets on 127.0.0.1 when the rendezvous address is loopback. A
non-loopback MASTER_ADDR is refused unless ``[mesh] trust_network = true``:
torch.distributed authenticates nothing (docs/security.md).

A SIGTERM (torchrun's way of stopping the other workers once one has died,
or of passing on a Ctrl-C) does not stop a rank on its own: it asks, through
the next round's sum, and every rank stops after that same round (a
:class:`~meshkit.train.RunStopped`, exit 2, the round's checkpoint
written). A rank lost mid-round fails the all-reduce on every survivor within ``[mesh]
timeout`` (gloo's timeout, set on the group). The survivors then take a roll
call through the store: each writes its name under the failed sum's number
and waits at most ``ROLL_CALL`` seconds for the others', and the ranks that
never answer are the ones the :class:`~meshkit.PeerLostError` names.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
import torch.distributed as dist

import meshkit
from meshkit.checkpoint import CHECKPOINT_NAME
from meshkit_torchdist.group import TorchdistLinks, is_loopback
from meshkit_torchdist.launch import print_progress

__all__ = ["GlooReducer", "run_spmd", "ROLL_CALL"]

log = logging.getLogger(__name__)

#: Seconds the survivors of a failed sum wait for each other's roll call.
ROLL_CALL = 3.0


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(value))


class GlooReducer:
    """A :class:`meshkit.train.PartialReducer`: one gloo group of every rank, int64 sums.

    ``connect(rank, world, ...)`` rendezvouses ``env://`` (MASTER_ADDR,
    MASTER_PORT) within ``join_timeout`` seconds; each :meth:`all_reduce`
    waits at most its ``timeout`` (default ``[mesh] timeout``).
    """

    def __init__(self, rank: int, world: int, store: Any, group: Any, timeout: float) -> None:
        self.rank = rank
        self.world = world
        self.timeout = timeout
        self._store = store
        self._group = group
        self._sums = 0
        self._broken = ""
        #: Set (by SIGTERM, in :func:`run_spmd`) to stop every rank after the round in progress.
        self.stop_requested = threading.Event()

    @classmethod
    def connect(cls, rank: int, world: int, *, timeout: float, join_timeout: float,
                trust_network: bool) -> GlooReducer:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(name):
                raise meshkit.ConfigError(
                    f"[transport] mode = \"spmd\" rendezvouses env:// and {name} is not set; "
                    f"start it with torchrun (which sets MASTER_ADDR, MASTER_PORT, RANK and "
                    f"WORLD_SIZE)")
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        loopback = is_loopback(host)
        if not (loopback or trust_network):
            raise meshkit.RefusedError(
                f"torchdist spmd: MASTER_ADDR is {host!r}, not a loopback address, and "
                f"torch.distributed authenticates nothing: anyone who can reach it can join "
                f"the process group, read every sum or inject one. Set [mesh] trust_network "
                f"= true only on a network you trust, or run with the tcp transport")
        wait = _seconds(max(join_timeout, timeout))
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        try:
            if rank == 0 and not agent:
                store = TorchdistLinks._host_store(host, port, wait, world_size=world,
                                                   multi_tenant=True, wait_for_workers=True)
            else:
                store = next(dist.rendezvous("env://", rank=rank, world_size=world,
                                             timeout=wait))[0]
            store = dist.PrefixStore("meshkit-spmd", store)
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = _seconds(timeout)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
                             if loopback else dist.ProcessGroupGloo.create_default_device()]
            group = dist.ProcessGroupGloo(store, rank, world, opts)
        except RuntimeError as exc:  # c10d's DistNetworkError / DistStoreError
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise meshkit.PeerLostError(
                f"torchdist spmd rank {rank}: the {world} ranks did not all meet at "
                f"{host}:{port} within {wait.total_seconds():g} s: {first}") from None
        return cls(rank, world, store, group, timeout)

    def all_reduce(self, buffer: np.ndarray, timeout: float | None) -> None:
        """Sum ``buffer`` (flat int64) in place over every rank; see the module docstring."""
        if buffer.dtype != np.int64 or buffer.ndim != 1:
            raise ValueError(f"all_reduce sums a flat int64 buffer, got {buffer.dtype} "
                             f"{buffer.shape}")
        if self._broken:
            raise meshkit.PeerLostError(
                f"rank {self.rank}: this run's process group failed before ({self._broken}); "
                f"a torch.distributed group does not recover")
        self._sums += 1
        wait = self.timeout if timeout is None else float(timeout)
        try:
            self._group.allreduce([torch.from_numpy(buffer)]).wait(_seconds(wait))
        except RuntimeError as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            lost = self._roll_call()
            self._broken = first
            raise meshkit.PeerLostError(
                f"{lost}: the round's all-reduce failed on rank {self.rank} ({first})") from None

    def _roll_call(self) -> str:
        """Who is still here, through the store: the sentence naming the lost ranks."""
        number = self._sums
        try:
            self._store.set(f"alive/{number}/{self.rank}", "1")
            missing = []
            for rank in range(self.world):
                if rank == self.rank:
                    continue
                try:
                    self._store.wait([f"alive/{number}/{rank}"], _seconds(ROLL_CALL))
                except RuntimeError:  # its key never came: it is the lost one
                    missing.append(rank)
        except RuntimeError as exc:
            log.warning("the roll call after a failed sum could not reach the store: %s", exc)
            return ("a rank was lost, and the rendezvous store with it (rank 0 or "
                    "torchrun's agent hosts it), so rank 0 may be the one")
        if not missing:
            return (f"no rank was lost (every one answered the roll call), so one stalled "
                    f"past the {self.timeout:g} s timeout ([mesh] timeout)")
        named = ", ".join(f"rank {r}" for r in missing)
        return f"{named} lost (no answer to the roll call within {ROLL_CALL:g} s)"

    def close(self) -> None:
        """Leave the group (best effort: a broken group has nothing left to say goodbye to)."""
        group, self._group = self._group, None
        if group is None:
            return
        try:
            group.shutdown()
        except (RuntimeError, AttributeError) as exc:
            log.debug("shutting the spmd group down failed: %s", exc)


def run_spmd(config: Any, rank: int, world: int, *, resume: bool, overwrite: bool) -> int:
    """This rank's part of a ``mode = "spmd"`` run; the exit status (0 finished, 2 failed)."""
    options = dict(config.transport.options)
    _refuse_idle_options(config, options)
    join = float(options.get("join_timeout", 300.0))
    reducer = GlooReducer.connect(rank, world, timeout=config.mesh.timeout, join_timeout=join,
                                  trust_network=config.mesh.trust_network)
    scratch = None if rank == 0 else Path(tempfile.mkdtemp(prefix=f"meshkit-spmd-rank{rank}-"))
    try:
        if scratch is not None:
            # Rank 0 writes the run's record; this rank's copy of it goes nowhere.
            if resume:
                _copy_checkpoint(config, scratch, rank)
            config = attrs.evolve(config, run=attrs.evolve(config.run, out=str(scratch)),
                                  observers=())
        progress = print_progress if rank == 0 else None
        if rank == 0:
            print(f"meshkit_torchdist: spmd: {world} rank(s) each play a slice of every round "
                  f"([mesh] workers = {config.mesh.workers} is for meshkit run of this "
                  f"config)", file=sys.stderr, flush=True)
        # SIGTERM (torchrun stopping its workers, e.g. after another rank died) is asked
        # of every rank through the next sum, never acted on alone: one rank leaving
        # between rounds would leave the others waiting in a sum it never joins.
        previous = signal.signal(signal.SIGTERM, lambda *_: reducer.stop_requested.set())
        try:
            report = meshkit.run(config, resume=resume, overwrite=overwrite,
                                 progress=progress, collective=reducer)
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        reducer.close()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if rank == 0:
        print(f"meshkit_torchdist: rank 0: run {'finished' if report.ok else 'failed'}: "
              f"{report.rounds_completed}/{report.rounds} round(s) on {world} rank(s), "
              f"metrics { {k: round(v, 4) for k, v in report.metrics.items()} }"
              + (f"; {report.error}" if report.error else ""), flush=True)
    return 0 if report.ok else 2


#: ``[transport]`` keys an spmd run uses; the others shape the coordinator's links.
_SPMD_KEYS = frozenset({"mode", "join_timeout"})


def _refuse_idle_options(config: Any, options: dict[str, Any]) -> None:
    """A ``[transport]`` key that would do nothing here is refused, naming it."""
    backend = options.get("backend", "auto")
    if backend not in ("auto", "gloo"):
        raise meshkit.ConfigError(
            f"{config.path}: [transport] backend = {backend!r}: an spmd run sums int64 "
            f"partials on the CPU over gloo; drop backend (or set \"gloo\")")
    if options.get("init_method", "") not in ("", "env://"):
        raise meshkit.ConfigError(
            f"{config.path}: [transport] init_method = {options['init_method']!r}: an spmd "
            f"run meets through torchrun's env:// (MASTER_ADDR, MASTER_PORT); drop "
            f"init_method")
    idle = sorted(set(options) - _SPMD_KEYS - {"backend", "init_method"})
    if idle:
        raise meshkit.ConfigError(
            f"{config.path}: [transport] {', '.join(idle)}: not used by an spmd run (no "
            f"messages cross its links, only one int64 sum a round); drop "
            f"{'it' if len(idle) == 1 else 'them'}")


def _copy_checkpoint(config: Any, scratch: Path, rank: int) -> None:
    found = Path(config.run.out) / CHECKPOINT_NAME
    if not found.is_file():
        raise meshkit.ConfigError(
            f"{config.path}: --resume: rank {rank} finds no checkpoint at {found}; every rank "
            f"of an spmd run resumes from rank 0's [run] out, so on several hosts put out on "
            f"a filesystem they share")
    shutil.copy2(found, scratch / CHECKPOINT_NAME)
