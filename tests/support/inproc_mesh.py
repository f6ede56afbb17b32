"""A real (in-process) mesh for node tests: a coordinator plus ranks running ``serve_node``.

Ranks are threads joined through the ``inproc`` transport, each running the
same :func:`meshkit.node.serve_node` a ``meshkit node`` process runs, with
the same job handlers. Test files take the fixture with
the ``mesh_factory`` fixture (``tests/node/conftest.py``). ``transport="tcp"`` joins them over
authenticated sockets on 127.0.0.1 instead (a star, or ``topology="mesh"``),
where each link has its own reader thread and activations are served on it.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from meshkit import NodeConfig
from meshkit.node import (
    TAG_UP,
    DeadlineBoard,
    collect_caps,
    local_caps,
    open_board,
    serve_node,
    shutdown_nodes,
)
from meshkit.pipeline import serve_pipeline_job
from meshkit.train import serve_train_job

from meshkit.train import free_ports

#: The job handlers ``meshkit node`` serves with.
JOBS = {"pipeline": serve_pipeline_job, "train": serve_train_job}

_hubs = itertools.count()


class Mesh:
    """A coordinator (this thread) plus worker threads running ``serve_node``.

    ``nodes`` maps a rank to its spec: ``board`` (a fixed-function rank),
    ``caps``, ``control`` and ``jobs`` (the handlers; :data:`JOBS` by default).
    """

    def __init__(self, nodes: dict[int, dict[str, Any]], timeout: float = 10.0, *,
                 transport: str = "inproc", topology: str = "star") -> None:
        self.world = max(nodes) + 1
        hub = f"inproc://serve-{next(_hubs)}"
        self.results: dict[int, Any] = {}
        self.errors: dict[int, BaseException] = {}
        self.groups: dict[int, Any] = {}
        self.nodes = nodes
        g0 = None
        if transport == "inproc":
            peers = [hub] if topology == "star" else [hub] * self.world
        elif topology == "star":
            g0 = NodeConfig(rank=0, world=self.world, topology="star", bind="127.0.0.1:0",
                            transport="tcp", secret=b"test-secret-0123456789", timeout=timeout).connect()
            peers = [g0.address]
        else:
            peers = [f"127.0.0.1:{port}" for port in free_ports(self.world)]

        def config(rank: int) -> NodeConfig:
            return NodeConfig(rank=rank, world=self.world, peers=peers, topology=topology,
                              transport=transport, secret=b"test-secret-0123456789", timeout=timeout)

        def run(rank: int) -> None:
            spec = nodes[rank]
            try:
                group = self.groups[rank] = config(rank).connect()
                caps = spec.get("caps") or local_caps(rank, fixed_function=(
                    spec["board"].descriptor if spec.get("board") else None))
                self.results[rank] = serve_node(group, caps, jobs=spec.get("jobs", JOBS),
                                                board=spec.get("board"),
                                                control=spec.get("control"))
            except BaseException as exc:  # handed to the test
                self.errors[rank] = exc

        self.threads = [threading.Thread(target=run, args=(r,), daemon=True,
                                         name=f"mesh-node-r{r}") for r in nodes]
        for t in self.threads:
            t.start()
        self.g0 = g0 if g0 is not None else config(0).connect()
        self.g0.wait_for_workers()
        self.caps = collect_caps(self.g0, hook=False)

    def join(self) -> None:
        for t in self.threads:
            t.join(10)
            assert not t.is_alive(), "a node did not leave"

    def close(self) -> None:
        shutdown_nodes(self.g0)
        self.join()
        self.g0.close()
        for g in self.groups.values():
            g.close()



def loopback(stage_id: str = "mid", n_in: int = 8, n_out: int = 8,
             **options: Any) -> DeadlineBoard:
    """A ``loopback`` board implementing ``stage_id`` (``n_in`` -> ``n_out``)."""
    return open_board("loopback", {"stage_id": stage_id, "input_elems": n_in,
                                   "output_elems": n_out, **options})


def reply(g0: Any, kinds: tuple[str, ...]) -> dict[str, Any]:
    """The next ``TAG_UP`` reply of one of ``kinds`` (with ``src``), skipping others."""
    for _ in range(10):  # bounded: skip nothing but what the test does not ask for
        src, msg = g0.recv(None, TAG_UP, timeout=5.0)
        if msg.get("kind") in kinds:
            return {"src": src, **msg}
    raise AssertionError(f"no {kinds} reply")
