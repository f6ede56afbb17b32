"""``[mesh] launch = "local"``: the worker processes a run starts on this machine.

Each local run gets a fresh secret (:func:`new_secret`), written 0600 into
a private temporary directory (:func:`write_secret`) that only the spawned
workers are pointed at; ``MESHKIT_SECRET`` is removed from their
environment, so no secret of the user's is ever reused on loopback. Workers
are ranks ``1..workers``, fixed-function boards follow them, and each
writes its output to ``OUT/logs/worker-RANK.log``. :func:`reap` stops them
in order when the run ends.

With ``[mesh] relays = R``, R host relays (``meshkit relay``) start first,
each carrying a contiguous block of the worker ranks and writing to
``OUT/logs/relay-I.log``; those workers dial their relay instead of the
coordinator. Relays are kept in the same processes table under the keys
``-1 .. -R``.

With ``[mesh] topology = "mesh"`` every rank gets the same list of one
address per rank (``--peers``; :func:`loopback_peers` picks free loopback
ports when the config gives none), listens at its own and dials the lower
ranks'. The nodes start before the coordinator forms the mesh.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import AbstractSet, Any, Mapping, MutableMapping, Sequence

from meshkit.errors import ConfigError, PeerLostError
from meshkit.train._coordinator.blas import give_back, share_cores

__all__ = ["new_secret", "write_secret", "spawn_workers", "reap", "exited_early", "exit_message",
           "ExitWatch", "logs_dir", "free_ports", "loopback_peers", "mesh_bind"]

_SECRET_NAME = "secret"


def new_secret() -> bytes:
    """A fresh secret for one local run."""
    return secrets.token_hex(32).encode()


def write_secret(secret: bytes) -> tuple[str, Path]:
    """Write ``secret`` 0600 into a new private directory: (directory, file)."""
    tmpdir = tempfile.mkdtemp(prefix="meshkit-run-")
    secret_file = Path(tmpdir) / _SECRET_NAME
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(secret)
    return tmpdir, secret_file


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 when picked.

    All are held open at once (so they are distinct), then released for the
    caller to bind; another program could take one first, and binding it
    then fails with the address named.
    """
    held = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in held]
    finally:
        for sock in held:
            sock.close()


def loopback_peers(world: int) -> tuple[str, ...]:
    """One free 127.0.0.1 address per rank, for a local mesh (:func:`free_ports`)."""
    return tuple(f"127.0.0.1:{port}" for port in free_ports(world))


def mesh_bind(bind: str, peers: Sequence[str]) -> str:
    """Where a mesh's coordinator listens: ``[mesh] bind`` when it names a port, else peers[0].

    (``bind = "0.0.0.0:29500"`` with ``peers[0] = "host0:29500"`` listens on
    every interface; the default ``127.0.0.1:0`` defers to the peers list.)
    """
    return bind if not bind.strip().endswith(":0") else peers[0]


def logs_dir(out: str | os.PathLike[str]) -> Path:
    """Where local workers write their output."""
    return Path(out) / "logs"


def _flag_text(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def spawn_workers(processes: MutableMapping[int, subprocess.Popen], cfg: Any, *,
                  address: str, secret_file: Path, world: int,
                  boards: Sequence[tuple[str, Mapping[str, Any]]],
                  mesh_peers: Sequence[str] = ()) -> None:
    """Start ``python -m meshkit node`` for ranks 1..world-1, recording each in ``processes``.

    ``mesh_peers`` (one address per rank): a full mesh, every node given the
    whole list; otherwise a star whose workers dial ``address`` (or their relay).

    Each process is recorded as soon as it starts, so a failure to start a
    later one still leaves the earlier ones to be reaped. The workers share
    this machine's cores with the coordinator, whose OpenBLAS pool is cut to
    one thread first (:func:`.blas.share_cores`: a woken pool spins a core
    away between rounds), unless the user chose a count.
    """
    share_cores(processes)
    logs = logs_dir(cfg.run.out)
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.pop("MESHKIT_SECRET", None)
    # Workers import a "module:attribute" task the way the coordinator did.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [os.getcwd(), env.get("PYTHONPATH", "")] if p)
    # Workers are ranks 1..workers; fixed-function boards follow them.
    extra: dict[int, list[str]] = {}
    for i, (board, options) in enumerate(boards):
        flags = ["--board", board]
        for key, value in options.items():
            flags += ["--board-option", f"{key}={_flag_text(value)}"]
        extra[cfg.mesh.workers + 1 + i] = flags
    # Every rank uses the same [transport] options as the coordinator.
    transport_flags: list[str] = []
    for key, value in cfg.transport.options.items():
        transport_flags += ["--transport-option", f"{key}={_flag_text(value)}"]
    topology = "mesh" if mesh_peers else "star"
    peers = {rank: ",".join(mesh_peers) if mesh_peers else address for rank in range(1, world)}
    relays = cfg.mesh.relays
    if relays:
        peers.update(_spawn_relays(processes, cfg, relays, address=address,
                                   secret_file=secret_file, world=world, env=env,
                                   transport_flags=transport_flags))
    for rank in range(1, world):
        cmd = [sys.executable, "-m", "meshkit", "node", "--rank", str(rank),
               "--world", str(world), "--peers", peers[rank],
               "--topology", topology, "--transport", cfg.mesh.transport,
               "--timeout", str(cfg.mesh.timeout), "--secret-file", str(secret_file),
               "--segment-bytes", str(cfg.mesh.segment_bytes),
               "--resume-seconds", str(cfg.mesh.resume_seconds),
               "--resume-bytes", str(cfg.mesh.resume_bytes),
               *([] if cfg.mesh.encrypt else ["--no-encrypt"]),
               # The coordinator's own [mesh] trust_network, or a trusting run's
               # workers refuse the rendezvous address it was allowed.
               *(["--trust-network"] if cfg.mesh.trust_network else []),
               *transport_flags, *extra.get(rank, [])]
        log_file = open(logs / f"worker-{rank}.log", "wb")
        try:
            # A new session: Ctrl-C in the terminal reaches the coordinator
            # only, which then stops its workers in order.
            processes[rank] = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                env=env, start_new_session=True)
        finally:
            log_file.close()


def relay_blocks(workers: int, relays: int) -> list[list[int]]:
    """Worker ranks 1..workers split into ``relays`` contiguous blocks, as even as can be."""
    if not 1 <= relays <= workers:
        raise ConfigError(f"[mesh] relays = {relays}, but there are {workers} workers; a relay "
                          f"carries at least one worker, so use 1..{workers} relays (or 0)")
    size, extra = divmod(workers, relays)
    blocks, start = [], 1
    for i in range(relays):
        count = size + (1 if i < extra else 0)
        blocks.append(list(range(start, start + count)))
        start += count
    return blocks


def _spawn_relays(processes: MutableMapping[int, subprocess.Popen], cfg: Any, relays: int, *,
                  address: str, secret_file: Path, world: int, env: Mapping[str, str],
                  transport_flags: list[str]) -> dict[int, str]:
    """Start the local host relays; each worker rank -> the address of its relay."""
    logs = logs_dir(cfg.run.out)
    started: list[tuple[int, list[int], subprocess.Popen]] = []
    for i, block in enumerate(relay_blocks(cfg.mesh.workers, relays)):
        cmd = [sys.executable, "-m", "meshkit", "relay", "--coordinator", address,
               "--bind", "127.0.0.1:0", "--world", str(world),
               "--ranks", ",".join(map(str, block)), "--name", f"relay-{i + 1}",
               "--transport", cfg.mesh.transport, "--timeout", str(cfg.mesh.timeout),
               "--secret-file", str(secret_file), "--segment-bytes", str(cfg.mesh.segment_bytes),
               *([] if cfg.mesh.encrypt else ["--no-encrypt"]), *transport_flags]
        log_file = open(logs / f"relay-{i + 1}.log", "wb")
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=log_file, env=dict(env), start_new_session=True)
        finally:
            log_file.close()
        processes[-(i + 1)] = proc
        started.append((i + 1, block, proc))
    peers: dict[int, str] = {}
    deadline = time.monotonic() + max(float(cfg.mesh.timeout), 10.0)
    for index, block, proc in started:
        line = _first_line(proc, deadline)
        try:
            relay_address = json.loads(line)["address"]
        except (ValueError, KeyError, TypeError):
            raise PeerLostError(
                f"local host relay {index} did not start (it printed {line[:200]!r}); see "
                f"{logs / f'relay-{index}.log'}") from None
        for rank in block:
            peers[rank] = relay_address
    return peers


def _first_line(proc: subprocess.Popen, deadline: float) -> str:
    """The first line ``proc`` prints, waiting until ``deadline`` at most ("" if none)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0].decode(errors="replace")


def reap(processes: Mapping[int, subprocess.Popen], grace: float = 5.0,
         dropped: AbstractSet[int] = frozenset()) -> None:
    """Wait for the workers to leave; terminate, then kill, the ones that do not.

    Then, even when a worker could not be killed in time, the BLAS pool
    :func:`spawn_workers` cut for them is given back.
    """
    try:
        # A dropped worker may be wedged (that is why it was dropped): no
        # grace for it. The others were told to stop and get time to leave.
        for rank in dropped:
            proc = processes.get(rank)
            if proc is not None and proc.poll() is None:
                proc.kill()
        deadline = time.monotonic() + grace
        for rank, proc in sorted(processes.items()):
            try:
                proc.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for rank, proc in sorted(processes.items()):
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5.0)
    finally:
        # The workers are gone (or could not be made to go): the pool is this process's again.
        give_back(processes)


#: The most of a log's end read to find an exit message (a traceback's last lines).
_TAIL_BYTES = 4096


def exit_message(out: str | os.PathLike[str], rank: int) -> str:
    """What a local worker (or relay: negative ``rank``) said last before it exited.

    Its ``meshkit: error: ...`` line when it wrote one (a refusal: the one
    sentence that says what to fix), else the last non-empty line of its log
    (a traceback's exception); "" when the log is empty or unreadable.
    """
    name = f"worker-{rank}.log" if rank > 0 else f"relay-{-rank}.log"
    try:
        with open(logs_dir(out) / name, "rb") as log_file:
            log_file.seek(0, os.SEEK_END)
            size = log_file.tell()
            log_file.seek(max(0, size - _TAIL_BYTES))
            tail = log_file.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("meshkit: error:")]
    return (errors[-1] if errors else lines[-1] if lines else "")[:1000]


class ExitWatch:
    """While the capability handshake waits, notice a local worker that exits and act at once.

    Without it the coordinator waits out ``[mesh] join_timeout`` (60 s) and
    blames the handshake, while the worker's one-sentence refusal sits in
    its log. A daemon thread polls the processes (every ``interval``
    seconds, until :meth:`stop`); the first exit is recorded (:attr:`exited`)
    and ``on_exit`` is called once -- the runner closes the group, which ends
    the wait with a ``PeerLostError`` that :meth:`describe` then explains.

    A worker may exit just as the handshake completes: the wait then ends
    normally, while the thread records the exit (and closes the group) or
    has not polled yet. So :meth:`stop` polls once more after the thread
    ended, and a ``with`` block that completes while :attr:`exited` is not
    empty raises that ``PeerLostError`` itself: the exit is quoted at once,
    never met later as a closed group or a lost rank.
    """

    def __init__(self, processes: Mapping[int, subprocess.Popen], on_exit: Any,
                 interval: float = 0.2) -> None:
        self.processes, self.on_exit, self.interval = dict(processes), on_exit, interval
        self.exited: dict[int, int] = {}
        #: Whether the wait the watch guarded completed (the exit came as it did).
        self.completed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="meshkit-exit-watch",
                                        daemon=True)

    def __enter__(self) -> "ExitWatch":
        if self.processes:
            self._thread.start()
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        self.stop()
        if kind is None and self.exited:  # the wait completed as a worker exited
            self.completed = True
            raise PeerLostError(f"local worker(s) {sorted(self.exited)} exited as the "
                                f"capability handshake completed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        if not self.exited and not self._thread.is_alive():
            self._poll()  # an exit since the thread's last look (or with no thread)

    def _poll(self) -> bool:
        """Record the processes that exited, if any; whether any did."""
        exited = {r: p.poll() for r, p in self.processes.items()}
        self.exited = {r: int(s) for r, s in exited.items() if s is not None}
        return bool(self.exited)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            if self._poll():
                self.on_exit()
                return

    def describe(self, out: str | os.PathLike[str]) -> str:
        """``local worker rank 3 exited (status 2) before the capability handshake: <its
        last words>``, each exited process quoted (``as the capability handshake
        completed`` when the wait had completed: :attr:`completed`)."""
        when = ("as the capability handshake completed" if self.completed
                else "before the capability handshake")
        parts = []
        for rank, status in sorted(self.exited.items()):
            said = exit_message(out, rank).removeprefix("meshkit: error: ")
            log_name = f"worker-{rank}.log" if rank > 0 else f"relay-{-rank}.log"
            parts.append(f"local {'worker rank' if rank > 0 else 'relay'} {abs(rank)} exited "
                         f"(status {status}) {when}"
                         + (f": {said}" if said else "") + f" (its log: {logs_dir(out) / log_name})")
        return "; ".join(parts)


def exited_early(processes: Mapping[int, subprocess.Popen], out: str | os.PathLike[str]) -> str:
    """A hint naming the local workers that already exited, each with its last words
    (:func:`exit_message`); "" when none did."""
    if not processes:
        return ""
    exited = {r: p.poll() for r, p in processes.items() if p.poll() is not None}
    if not exited:
        return ""
    parts = []
    for rank, status in sorted(exited.items()):
        said = exit_message(out, rank)
        parts.append(f"{'rank' if rank > 0 else 'relay'} {abs(rank)} (status {status})"
                     + (f" said: {said}" if said else ""))
    return ("; local worker(s) exited early: " + "; ".join(parts)
            + f" — see {logs_dir(out)}/worker-N.log (relay-N.log)")
