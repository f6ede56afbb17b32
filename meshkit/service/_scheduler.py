"""Which node serves which run: the service's one place for placement and fairness.

Rules (docs/serve.md, "Sharing nodes"):

* A node serves one run at a time, for the whole run (a run's mesh is a
  star of the nodes it was given), and is free again once it says DONE.
* Only a node the run admits may be chosen: with ``[mesh] authorized_nodes``
  in the run's config, a node whose key is not listed (or is revoked, or is
  bound to another rank) is never sent that run's address or secret, so it
  can never see its model or data; a node without a key serves only runs
  that name no ``authorized_nodes``.
* Fairness is first come, first served: runs are considered in submission
  order (a restarted service puts its unfinished runs first, in that order).
  A run that cannot start yet *holds* the idle nodes it could use, so a
  later, smaller run can start only on nodes the earlier one could not use:
  a big run is never starved by a stream of small ones.
* A node that drops out and comes back (same key) while its run still runs
  is sent the same rank again, and rejoins at the run's next round.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import attrs

from meshkit import wire
from meshkit.errors import MeshError
from meshkit.service._protocol import Assign, Refused, send
from meshkit.service._store import Store

__all__ = ["NodeLink", "Scheduler", "admission_problem"]

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class NodeLink:
    """One connected node, as the service sees it."""

    id: str
    public: bytes | None
    channel: Any
    caps: dict[str, Any]
    address: str
    #: The run this node serves ("" : idle).
    busy: str = ""
    _send_lock: threading.Lock = attrs.Factory(threading.Lock)

    def send(self, message: Any) -> bool:
        """Send ``message``; False when the link is gone (its reader notices and drops it)."""
        with self._send_lock:
            try:
                send(self.channel, message)
                return True
            except (MeshError, OSError) as exc:
                log.info("node %s: send failed: %s", self.id, exc)
                return False


def admission_problem(authorized: wire.AuthorizedNodes | None, public: bytes | None,
                      rank: int | None = None) -> str | None:
    """Why a node (key ``public``) may not serve under ``authorized``, or None.

    ``rank`` None asks whether the key is admitted at all (the service's own
    registry, where ranks mean nothing).
    """
    if authorized is None:
        return None
    if rank is not None:
        return authorized.problem(public, rank)
    entries = [k for k in authorized.keys if k.public == public]
    if public is None or not entries or any(k.revoked for k in entries):
        return authorized.problem(public, 1)
    return None


@attrs.define(eq=False)
class _Active:
    job: Any
    #: node id -> rank in the run's mesh.
    ranks: dict[str, int]
    #: The ASSIGN each rank is sent (once the run's coordinator listens).
    assignments: dict[int, Assign] = attrs.Factory(dict)


class Scheduler:
    """Node registry, run queue and placement (see the module docstring).

    ``start_run(record, ranks)`` starts a run on ``ranks`` (node id -> rank)
    and returns its job; the job calls :meth:`listening` once its
    coordinator listens and :meth:`run_ended` when it is over.
    ``authorized_for(record)`` is a run's parsed ``authorized_nodes`` (or None).
    """

    def __init__(self, store: Store, *, start_run: Callable[[Any, dict[str, int]], Any],
                 authorized_for: Callable[[Any], wire.AuthorizedNodes | None]) -> None:
        self._store = store
        self._start_run = start_run
        self._authorized_for = authorized_for
        self._lock = threading.RLock()
        self.nodes: dict[str, NodeLink] = {}
        self._queue: list[str] = []
        self._active: dict[str, _Active] = {}

    # -- runs ---------------------------------------------------------------------

    def enqueue(self, run_id: str) -> None:
        with self._lock:
            if run_id not in self._queue and run_id not in self._active:
                self._queue.append(run_id)
        self.kick()

    def dequeue(self, run_id: str) -> bool:
        """Take a queued run out of the queue (``meshkit stop``); False if it is not queued."""
        with self._lock:
            if run_id in self._queue:
                self._queue.remove(run_id)
                return True
        return False

    def active(self, run_id: str) -> Any:
        with self._lock:
            entry = self._active.get(run_id)
            return None if entry is None else entry.job

    def listening(self, run_id: str, assignments: dict[int, Assign]) -> None:
        """The run's coordinator listens: send each chosen node its ASSIGN."""
        with self._lock:
            entry = self._active[run_id]
            entry.assignments = dict(assignments)
            targets = [(self.nodes.get(node_id), assignments[rank])
                       for node_id, rank in entry.ranks.items()]
        for link, assign in targets:
            if link is not None and link.busy == run_id:
                link.send(assign)

    def run_ended(self, run_id: str) -> None:
        with self._lock:
            entry = self._active.pop(run_id, None)
            if entry is not None and not entry.assignments:
                # Its coordinator never listened: no node was told, none will say DONE.
                for node_id in entry.ranks:
                    link = self.nodes.get(node_id)
                    if link is not None and link.busy == run_id:
                        link.busy = ""
                        self._store.update_node(node_id, busy_run=None)
        self.kick()

    # -- nodes --------------------------------------------------------------------

    def node_joined(self, link: NodeLink) -> None:
        with self._lock:
            old = self.nodes.get(link.id)
            self.nodes[link.id] = link
            rejoin = None
            for run_id, entry in self._active.items():
                rank = entry.ranks.get(link.id)
                if rank is not None and rank in entry.assignments:
                    rejoin = (run_id, entry.assignments[rank])
                    link.busy = run_id
        if old is not None and old is not link:
            old.channel.close("replaced by a new connection from the same node")
        self._store.update_node(link.id, connected=True,
                                busy_run=rejoin[0] if rejoin else None)
        if rejoin is not None:
            self._store.add_event(rejoin[0], "node", f"node {link.id} rejoined as rank "
                                                     f"{rejoin[1].rank}")
            link.send(rejoin[1])
        self.kick()

    def node_done(self, link: NodeLink, run_id: str, ok: bool, detail: str) -> None:
        with self._lock:
            if link.busy == run_id:
                link.busy = ""
        self._store.update_node(link.id, busy_run=None, served=True)
        self._store.add_event(run_id, "node", f"node {link.id} done ({'ok' if ok else 'failed'})"
                                              + (f": {detail}" if detail else ""))
        self.kick()

    def node_gone(self, link: NodeLink) -> None:
        with self._lock:
            if self.nodes.get(link.id) is link:
                del self.nodes[link.id]
                self._store.update_node(link.id, connected=False, busy_run=None)
        if link.busy:
            self._store.add_event(link.busy, "node", f"node {link.id} lost its service link")
        self.kick()

    def refuse(self, link: NodeLink, why: str) -> None:
        link.send(Refused(detail=why))

    # -- placement ----------------------------------------------------------------

    def kick(self) -> None:
        """Start every queued run that can start now, in submission order."""
        starts = []
        with self._lock:
            held: set[str] = set()
            for run_id in list(self._queue):
                record = self._store.run(run_id)
                if record is None or record.state != "queued":
                    self._queue.remove(run_id)
                    continue
                idle = [n for n in sorted(self.nodes.values(), key=lambda n: n.id)
                        if not n.busy and n.id not in held]
                ranks = self._choose(record, idle)
                if ranks is None:
                    held |= {n.id for n in idle if self._eligible(record, n, None)}
                    continue
                for node_id in ranks:
                    self.nodes[node_id].busy = run_id
                self._queue.remove(run_id)
                entry = self._active[run_id] = _Active(job=None, ranks=ranks)
                starts.append((record, ranks, entry))
            for record, ranks, entry in starts:
                for node_id in ranks:
                    self._store.update_node(node_id, busy_run=record.id)
                # The entry held, not looked up again: a run that ends before its start
                # returns (its job says so on this thread) has already left _active.
                entry.job = self._start_run(record, ranks)

    def _eligible(self, record: Any, link: NodeLink, rank: int | None) -> bool:
        try:
            authorized = self._authorized_for(record)
        except MeshError:
            return False
        if authorized is None:
            return True
        return admission_problem(authorized, link.public, rank) is None

    def _choose(self, record: Any, idle: list[NodeLink]) -> dict[str, int] | None:
        """Node id -> rank for ranks 1..workers from ``idle``, or None if it cannot start."""
        chosen: dict[str, int] = {}
        for rank in range(1, record.workers + 1):
            pick = next((n for n in idle if n.id not in chosen
                         and self._eligible(record, n, rank)), None)
            if pick is None:
                return None
            chosen[pick.id] = rank
        return chosen
