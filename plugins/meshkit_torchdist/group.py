"""The Group API over torch.distributed: one gloo pair per peer for messages, the engine's all-reduce.

How the pieces map (:class:`TorchdistLinks` owns all of them and implements
:class:`meshkit.transport.Links`; ``connect`` wraps it in a plain
:class:`meshkit.transport.Group`, as ``inproc`` does):

* **Rendezvous**: a c10d store. ``env://`` reads MASTER_ADDR, MASTER_PORT
  (and RANK, WORLD_SIZE) as torchrun sets them, through
  ``torch.distributed.rendezvous``; ``tcp://host:port`` makes rank 0 host a
  ``TCPStore`` there (port 0: any free port, reported as ``group.address``).
  A rank forms its groups one at a time, in a global order (see
  :meth:`TorchdistLinks._form_pairs`), over its one store connection.
* **Links**: every pair of ranks gets its own two-rank gloo process group.
  A message is a header tensor (body length, tag, codec flags, kind) and a
  body tensor holding the meshkit wire codec's encoding of the state (never
  pickle); one reader thread per pair waits for the next header. Because
  each pair is its own gloo context, a rank that dies breaks only its own
  pairs: the others read on, and the lost rank is named, as on ``tcp``.
* **The all-reduce** (:meth:`Links.all_reduce_sum`, behind
  ``Group.mesh_all_reduce``): one process group per set of participants,
  made the first time they all-reduce together (gloo, or NCCL with
  ``backend = "nccl"`` on CUDA), so the data-parallel step's sum is
  torch.distributed's own collective and rank 0 folds nothing. A rank lost
  or stalled during it fails the collective on every participant within
  the timeout (gloo's own timeout); such a group is not used again.
* **Timeouts**: every send and the all-reduce wait at most ``[mesh]
  timeout``; a reader waits for a frame to *start* without a practical
  limit (a worker may train for a long time between frames), and a rank
  that stays silent is caught by the receiving side's ``recv`` timeout.

Security: torch.distributed authenticates nothing and encrypts nothing.
Anyone who can reach the store or a gloo port can join, read every tensor or
inject one. So the rendezvous host must be a loopback address unless
``[mesh] trust_network = true`` says the network is trusted (refused with a
:class:`~meshkit.RefusedError` naming the key otherwise), and on loopback the
gloo pairs listen on 127.0.0.1 only. The store rank 0 hosts listens on the
rendezvous address only, not on every interface (c10d's ``TCPStore`` binds
``[::]``): rank 0 binds that address itself and hands the store the
listening socket (``master_listen_fd``). Under torchrun the store is the
agent's (``TORCHELASTIC_USE_AGENT_STORE``), which torchrun binds on every
interface; meshkit cannot change that and warns (docs/security.md).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from typing import Any, Sequence
from urllib.parse import urlparse

import numpy as np
import torch
import torch.distributed as dist

from meshkit import wire
from meshkit.errors import AggregationError, ConfigError, MeshError, PeerLostError, RefusedError, \
    WireError
from meshkit.node.config import NodeConfig
from meshkit.transport import (META_KEY, TAG_BYE, Group, LinkEvents, Links, Message,
                               is_loopback, trust_refusal)
from meshkit_torchdist import TorchdistOptions, init_method

__all__ = ["TorchdistTransport", "TorchdistLinks", "is_loopback"]

log = logging.getLogger(__name__)

#: Header tensor layout: body bytes, tag, codec flags, kind (0 control, 1 model).
_HEADER = 4
_KIND_NAMES = ("control", "model")
#: How long a reader waits for the next frame to start: practically for ever,
#: since gloo closes a pair whose wait times out (30 days; meshkit's own
#: receive timeouts catch a peer that stays silent).
_IDLE = datetime.timedelta(days=30)
#: gloo threads per pair group: one link moves one message at a time.
_PAIR_THREADS = 1


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(value))


class TorchdistLinks(Links):
    """One rank's links over torch.distributed (see the module docstring).

    It owns the c10d store, one two-rank gloo pair group per peer with its
    reader thread, and the all-reduce process groups; ``connect`` wraps it
    in a plain :class:`meshkit.transport.Group`, which reaches it only
    through the :class:`meshkit.transport.Links` contract.
    """

    # Each pair has its own reader thread, which delivers only that pair's frames.
    inline_delivery = True

    def __init__(self, config: NodeConfig, options: TorchdistOptions) -> None:
        self._lock = threading.Condition()
        #: The kernel's callbacks (set by Group.__init__ through attach).
        self._events: LinkEvents
        self._pairs: dict[int, Any] = {}
        self._send_locks: dict[int, threading.Lock] = {}
        self._engine_groups: dict[tuple[int, ...], Any] = {}
        self._broken: dict[tuple[int, ...], str] = {}
        self._collective_lock = threading.Lock()
        self._address = ""
        self._readers: list[threading.Thread] = []
        self._pairing: threading.Thread | None = None
        self.config = config
        self.rank = config.rank
        self.world_size = config.world
        self.timeout = float(config.timeout)
        self.options = options
        self.max_frame = options.max_frame_bytes
        self.join_timeout = max(float(options.join_timeout), self.timeout)
        self.backend = self._pick_backend(options.backend)
        self._store: Any = None
        self._loopback = True

    @property
    def address(self) -> str:
        return self._address

    def attach(self, events: LinkEvents) -> None:
        self._events = events

    # -- bring-up ---------------------------------------------------------------

    @staticmethod
    def _pick_backend(name: str) -> str:
        if name == "auto":
            return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
        if name == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise ConfigError("[transport] backend = \"nccl\" needs CUDA and an NCCL-enabled "
                              "torch build, and this one has neither here; use \"gloo\" or "
                              "\"auto\"")
        return name

    def _init_method(self) -> str:
        return init_method(self.options, self.rank, self.config.bind or "", self.config.peers)

    def _check_trust(self, host: str) -> None:
        """The kernel's trust rule (as ``meshkit check`` applied it), for this node's config."""
        self._loopback = is_loopback(host)
        why = trust_refusal("torchdist", TorchdistOptions.traits, self.options, rank=self.rank,
                            bind=self.config.bind or "", peers=self.config.peers,
                            trust_network=self.config.trust_network)
        if why is not None:
            raise RefusedError(f"torchdist: {why}")

    def _rendezvous(self) -> None:
        method = self._init_method()
        timeout = _seconds(self.join_timeout)
        if method.startswith("env://"):
            for name in ("MASTER_ADDR", "MASTER_PORT"):
                if not os.environ.get(name):
                    raise ConfigError(
                        f"torchdist init_method = \"env://\" needs {name} (torchrun sets "
                        f"MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE); set it, or use "
                        f"init_method = \"tcp://host:port\"")
            for name, mine in (("RANK", self.rank), ("WORLD_SIZE", self.world_size)):
                raw = os.environ.get(name)
                if raw is not None and raw.strip() and raw.strip() != str(mine):
                    raise ConfigError(
                        f"torchdist: {name} = {raw} in the environment, but this node is "
                        f"configured as {name.lower().replace('_size', '')} {mine}; with "
                        f"torchrun, [mesh] workers must be --nproc-per-node x --nnodes - 1")
            host = os.environ["MASTER_ADDR"]
            self._check_trust(host)
            where = f"{host}:{os.environ['MASTER_PORT']}"
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            if agent and self.rank == 0:
                log.warning(
                    "torchdist: the rendezvous store at %s is torchrun's agent store, which "
                    "torchrun binds on every interface (not only %s); anyone who can reach "
                    "this host's port %s can read and write it (docs/security.md)", where,
                    host, os.environ["MASTER_PORT"])
            if self.rank == 0 and not agent:
                port = int(os.environ["MASTER_PORT"])
                # As env:// would make it (torch's _create_c10d_store), bound to host.
                store = self._store_at(where, lambda: self._host_store(
                    host, port, timeout, world_size=self.world_size, multi_tenant=True,
                    wait_for_workers=True))
            else:
                store = self._store_at(where, lambda: next(dist.rendezvous(
                    "env://", rank=self.rank, world_size=self.world_size, timeout=timeout))[0])
            self._address = f"env://{host}:{os.environ['MASTER_PORT']}"
        elif method.startswith("tcp://"):
            parsed = urlparse(method)
            if not parsed.hostname or parsed.port is None:
                raise ConfigError(f"torchdist init_method {method!r} must be tcp://host:port")
            host, port = parsed.hostname, parsed.port
            self._check_trust(host)
            if self.rank != 0 and port == 0:
                raise ConfigError("a torchdist worker needs rank 0's actual port, not 0")
            store = self._store_at(f"{host}:{port}", lambda: self._host_store(
                host, port, timeout) if self.rank == 0 else dist.TCPStore(
                host, port, None, False, timeout, wait_for_workers=False))
            shown = f"[{host}]" if ":" in host else host
            self._address = f"{shown}:{store.port}"
        else:
            raise ConfigError(f"[transport] init_method {method!r}: use \"env://\" or "
                              f"\"tcp://host:port\"")
        self._store = dist.PrefixStore("meshkit", store)

    @staticmethod
    def _host_store(host: str, port: int, timeout: datetime.timedelta, *,
                    world_size: int | None = None, multi_tenant: bool = False,
                    wait_for_workers: bool = False) -> Any:
        """Rank 0's ``TCPStore``, listening on ``host`` only.

        c10d binds its own listener on every interface; a socket bound here
        and handed over (``master_listen_fd``, which the store then owns)
        keeps the store where the rendezvous address says it is.
        """
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM)[0]
        except OSError as exc:  # as c10d's own errors, so _store_at names the address
            raise RuntimeError(f"cannot resolve {host!r}: {exc}") from None
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(128)
        except OSError as exc:
            listener.close()
            raise RuntimeError(f"cannot listen there: {exc}") from None
        bound = listener.getsockname()[1]
        try:
            return dist.TCPStore(host, bound, world_size, True, timeout,
                                 wait_for_workers=wait_for_workers, multi_tenant=multi_tenant,
                                 master_listen_fd=listener.fileno())
        except BaseException:
            listener.close()
            raise
        finally:
            listener.detach()  # the store owns the descriptor now (or it was closed above)

    def _store_at(self, where: str, make: Any) -> Any:
        """The c10d store ``make()`` opens at ``where``; failing to, a :class:`MeshError`."""
        try:
            return make()
        except RuntimeError as exc:  # DistNetworkError and DistStoreError are RuntimeErrors
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if self.rank == 0:
                raise ConfigError(f"torchdist rank 0 cannot host the rendezvous store at "
                                  f"{where}: {first}") from None
            raise PeerLostError(f"torchdist rank {self.rank} could not reach the rendezvous "
                                f"store at {where} within {self.join_timeout:g} s: {first}; "
                                f"is rank 0 running there?") from None

    def _options(self, threads: int) -> Any:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = _seconds(self.join_timeout)
        # On loopback nothing listens beyond this host; on a trusted network
        # gloo picks the interface (GLOO_SOCKET_IFNAME) as torch does.
        device = (dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if self._loopback
                  else dist.ProcessGroupGloo.create_default_device())
        opts._devices = [device]
        opts._threads = threads
        return opts

    def _form_pair(self, peer: int) -> None:
        low, high = sorted((self.rank, peer))
        store = dist.PrefixStore(f"pair/{low}-{high}", self._store)
        try:
            pg = dist.ProcessGroupGloo(store, 0 if self.rank == low else 1, 2,
                                       self._options(_PAIR_THREADS))
        except Exception as exc:  # a rank that never came, or a store/network that failed
            if not self._events.closed:
                self._events.lost(peer, self._pair_failure(peer, exc))
            return
        with self._lock:
            if self._events.closed:
                return
            self._pairs[peer] = pg
            self._send_locks[peer] = threading.Lock()
            self._lock.notify_all()
        self._events.linked(peer)
        reader = threading.Thread(target=self._reader, args=(peer, pg), daemon=True,
                                  name=f"meshkit-torchdist-r{self.rank}-from-{peer}")
        with self._lock:  # started before close() can see it, so close() may join it
            reader.start()
            self._readers.append(reader)

    def _pair_failure(self, peer: int, exc: Exception) -> str:
        """Why forming the pair group with ``peer`` failed, told apart from a slow peer.

        Only gloo's rendezvous timing out (a :class:`DistStoreError` that says
        so) means the peer never came; any other error is this rank's store or
        network, logged with its traceback and reported as itself.
        """
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, dist.DistStoreError) and "timeout" in text.lower():
            return (f"did not join the torch.distributed world within "
                    f"{self.join_timeout:g} s ({text})")
        log.error("torchdist rank %d: forming the pair group with rank %d failed",
                  self.rank, peer, exc_info=exc)
        return (f"could not form the gloo pair group: {type(exc).__name__}: {text} (the "
                f"rendezvous store or the network interface, not a slow peer; "
                f"GLOO_SOCKET_IFNAME picks the interface)")

    def _form_pairs(self, peers: list[int]) -> None:
        """Form this rank's pair groups one at a time, lowest peer first.

        The store client is one connection that holds its lock while it
        waits for a key, so groups forming concurrently on one rank would
        block each other (a thread waiting for a peer's address keeps the
        rank's other threads from publishing theirs, and two ranks can then
        wait on each other until the join timeout). In increasing peer
        order, every rank takes its pairs in the one global order of
        (low, high): the least pair not yet formed always has both its
        ranks at it, so the world forms without a deadlock.
        """
        for peer in sorted(peers):
            if self._events.closed:
                return
            self._form_pair(peer)

    def _await_pairing(self) -> None:
        """Wait until this rank has formed (or given up on) every pair, bounded."""
        pairing = self._pairing
        if pairing is not None and pairing is not threading.current_thread():
            pairing.join(self.join_timeout)

    def start(self) -> None:
        """Rendezvous, then form this rank's pair groups (a worker waits for all of them)."""
        self._rendezvous()
        peers = [p for p in range(self.world_size) if p != self.rank]
        self._pairing = threading.Thread(target=self._form_pairs, args=(peers,), daemon=True,
                                         name=f"meshkit-torchdist-pairs-{self.rank}")
        self._pairing.start()
        if self.rank == 0:
            return  # workers join in their own time: wait_for_workers() waits for them
        deadline = time.monotonic() + self.join_timeout

        def dead() -> dict[int, str]:
            reasons = {p: self._events.dead_reason(p) for p in peers}
            return {p: why for p, why in reasons.items() if why is not None}

        with self._lock:
            while not set(peers) <= set(self._pairs) | set(dead()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            missing = sorted(set(peers) - set(self._pairs))
        if missing:
            raise PeerLostError(
                f"rank {self.rank}: rank(s) {missing} did not join the torch.distributed "
                f"world within {self.join_timeout:g} s: {dead() or 'not started?'}")

    # -- the links --------------------------------------------------------------

    @property
    def linked(self) -> list[int]:
        """The peers whose pair group is up."""
        with self._lock:
            return sorted(self._pairs)

    def _pair(self, peer: int) -> tuple[Any, threading.Lock]:
        with self._lock:
            pg = self._pairs.get(peer)
            lock = self._send_locks.get(peer)
        if pg is None or lock is None:
            why = self._events.dead_reason(peer) or "no link (it has not joined)"
            raise PeerLostError(f"rank {peer} is unreachable: {why}")
        return pg, lock

    def transmit(self, peer: int, message: Message, timeout: float | None) -> None:
        state = dict(message.payload)
        if message.meta:
            state[META_KEY] = dict(message.meta)
        encoded = wire.encode_state(state)  # WireError: nothing sent
        if encoded.nbytes > self.max_frame:
            raise WireError(f"a {encoded.nbytes}-byte frame exceeds max_frame_bytes = "
                            f"{self.max_frame}")
        body = torch.empty(encoded.nbytes, dtype=torch.uint8)
        view = body.numpy()
        offset = 0
        for buffer in encoded.buffers:
            chunk = np.frombuffer(buffer, dtype=np.uint8)
            view[offset:offset + chunk.size] = chunk
            offset += chunk.size
        header = torch.tensor([encoded.nbytes, message.tag, encoded.flags,
                               int(message.kind == "model")],
                              dtype=torch.int64)
        pg, lock = self._pair(peer)
        other = 1 if self.rank < peer else 0
        wait = _seconds(self.timeout if timeout is None else timeout)
        try:
            with lock:
                pg.send([header], other, 0).wait(wait)
                if encoded.nbytes:
                    pg.send([body], other, 0).wait(wait)
        except RuntimeError as exc:
            reason = f"a send to it failed: {exc}"
            self._events.lost(peer, reason)
            raise PeerLostError(f"rank {peer}: {reason}") from None

    def _reader(self, peer: int, pg: Any) -> None:
        other = 1 if self.rank < peer else 0
        events = self._events
        while True:
            header = torch.zeros(_HEADER, dtype=torch.int64)
            try:
                pg.recv([header], other, 0).wait(_IDLE)
                nbytes, tag, flags, kind = (int(v) for v in header.tolist())
                if not 0 <= nbytes <= self.max_frame:
                    events.lost(peer, f"announced a {nbytes}-byte frame (max_frame_bytes = "
                                      f"{self.max_frame}): protocol violation")
                    return
                body = torch.empty(nbytes, dtype=torch.uint8)
                if nbytes:
                    pg.recv([body], other, 0).wait(_seconds(self.timeout))
            except RuntimeError as exc:
                if not events.closed:
                    events.lost(peer, f"its torch.distributed link broke: {exc}")
                return
            if tag == TAG_BYE:
                closing = events.closed
                events.lost(peer, "closed its group (left the mesh)", quiet=True)
                if not closing:
                    # Answer the goodbye, so the leaving rank's reader for us ends
                    # too and its close() need not wait for ours.
                    self._goodbye(peer, pg)
                return
            try:
                state = wire.decode_state(body.numpy(), flags=flags)
            except WireError as exc:
                events.lost(peer, f"sent a frame that does not decode: {exc}")
                return
            meta = state.pop(META_KEY, None) or {}
            if not isinstance(meta, dict):
                events.lost(peer, f"sent a malformed {META_KEY!r} entry (protocol violation)")
                return
            with self._lock:
                current = self._pairs.get(peer) is pg
            if not current:
                return  # dropped: the kernel declared it dead
            events.deliver(Message(peer, self.rank, tag, state, meta,
                                   _KIND_NAMES[1 if kind == 1 else 0]))
            del body, state

    def drop(self, peer: int) -> None:
        with self._lock:
            self._pairs.pop(peer, None)
            self._send_locks.pop(peer, None)
            self._lock.notify_all()

    def _goodbye(self, peer: int, pg: Any) -> None:
        header = torch.tensor([0, TAG_BYE, 0, 0], dtype=torch.int64)
        try:
            pg.send([header], 1 if self.rank < peer else 0, 0).wait(_seconds(1.0))
        except RuntimeError:
            pass

    def close(self) -> None:
        with self._lock:
            pairs = dict(self._pairs)
            self._pairs.clear()
            self._lock.notify_all()

        goodbye = self._goodbye
        # Peers' readers end on the goodbye (ours end on theirs, or when
        # their process exits); bounded, so a stalled peer cannot hold close().
        byes = [threading.Thread(target=goodbye, args=item, daemon=True)
                for item in pairs.items()]
        for thread in byes:
            thread.start()
        for thread in byes:
            thread.join(1.5)
        # A reader ends on its peer's goodbye (a peer that closes too). Wait
        # for them, bounded: gloo aborts an interpreter that exits while one
        # still waits inside a receive.
        with self._lock:
            readers = list(self._readers)
        deadline = time.monotonic() + min(self.timeout, 3.0)
        for reader in readers:
            if reader is not threading.current_thread():
                reader.join(max(0.0, deadline - time.monotonic()))
        with self._collective_lock:
            engines = list(self._engine_groups.values())
            self._engine_groups.clear()
        # gloo's own threads must be stopped before the interpreter exits, or
        # their destructors abort the process ("terminate called ...").
        for pg in [*engines, *pairs.values()]:
            try:
                pg.shutdown()
            except Exception:  # best effort: the group is closing
                log.debug("shutting a process group down failed", exc_info=True)

    # -- the all-reduce ---------------------------------------------------------

    def _engine_group(self, ranks: tuple[int, ...]) -> Any:
        self._await_pairing()  # the store connection is the pairing thread's until then
        with self._collective_lock:
            if ranks in self._broken:
                raise PeerLostError(
                    f"the all-reduce over ranks {list(ranks)} failed before "
                    f"({self._broken[ranks]}); a torch.distributed group does not recover")
            pg = self._engine_groups.get(ranks)
            if pg is not None:
                return pg
            store = dist.PrefixStore("coll/" + ",".join(map(str, ranks)), self._store)
            local = ranks.index(self.rank)
            try:
                if self.backend == "nccl":
                    opts = dist.ProcessGroupNCCL.Options()
                    opts._timeout = _seconds(self.timeout)
                    pg = dist.ProcessGroupNCCL(store, local, len(ranks), opts)
                else:
                    opts = self._options(2)
                    opts._timeout = _seconds(self.timeout)
                    pg = dist.ProcessGroupGloo(store, local, len(ranks), opts)
            except Exception as exc:
                self._broken[ranks] = str(exc)
                raise PeerLostError(f"rank {self.rank}: forming the all-reduce group over "
                                    f"ranks {list(ranks)} failed within {self.timeout:g} s: "
                                    f"{exc}") from None
            self._engine_groups[ranks] = pg
            return pg

    def all_reduce_sum(self, buffers: Sequence[np.ndarray], ranks: list[int], check: int,
                       timeout: float) -> bool:
        members = tuple(ranks)
        pg = self._engine_group(members)
        wait = _seconds(timeout)
        device = torch.device("cuda", torch.cuda.current_device()) \
            if self.backend == "nccl" else None
        try:
            # One tiny MAX-reduce of (check, -check): equal on every rank iff
            # every rank packed the same layout; otherwise every rank sees it.
            probe = torch.tensor([check, -check], dtype=torch.int64, device=device)
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX
            pg.allreduce([probe], opts).wait(wait)
            if int(probe[0]) != check or -int(probe[1]) != check:
                raise AggregationError(
                    f"torchdist all-reduce over ranks {ranks}: rank {self.rank}'s layout (keys, "
                    f"shapes, dtypes) differs from another participant's; every participant "
                    f"must reduce the same keys with the same shapes and dtypes")
            for buffer in buffers:
                tensor = torch.from_numpy(buffer)
                if device is not None:
                    moved = tensor.to(device)
                    pg.allreduce([moved]).wait(wait)
                    tensor.copy_(moved.cpu())
                else:
                    pg.allreduce([tensor]).wait(wait)
        except RuntimeError as exc:
            with self._collective_lock:
                self._broken[members] = str(exc)
            raise PeerLostError(
                f"rank {self.rank}: the torch.distributed all-reduce over ranks {ranks} "
                f"failed (a participant was lost or stalled past {timeout:g} s): {exc}") from None
        return True


class TorchdistTransport:
    """Factory result of the ``torchdist`` component: ``connect(node_config) -> Group``."""

    def __init__(self, options: TorchdistOptions | None = None) -> None:
        self.options = options if options is not None else TorchdistOptions()

    def connect(self, config: NodeConfig) -> Group:
        links = TorchdistLinks(config, self.options)
        group = Group(links, rank=links.rank, world_size=links.world_size,
                      timeout=links.timeout, is_star=False)
        try:
            links.start()
        except BaseException:
            group.close()
            raise
        if links.world_size > 1 and not links.linked and links.rank != 0:
            group.close()
            raise MeshError(f"rank {links.rank}: no torch.distributed link came up")
        return group
