"""A worker's side of a pipeline job: serve_worker and the "pipeline" job handler."""

from __future__ import annotations

import threading
from typing import Any

from meshkit import NodeConfig, NodeControl, NodeReport
from meshkit.pipeline import serve_worker


def test_a_parked_worker_leaves_promptly_when_stopped():
    hub = "inproc://parked"
    cfg = [NodeConfig(rank=r, world=2, peers=[hub], topology="star", transport="inproc",
                      secret=b"k", timeout=5) for r in range(2)]
    groups: dict[int, Any] = {}
    t = threading.Thread(target=lambda: groups.__setitem__(1, cfg[1].connect()))
    t.start()
    groups[0] = cfg[0].connect()
    t.join(5)
    control = NodeControl()
    out: list[NodeReport] = []
    worker = threading.Thread(target=lambda: out.append(
        serve_worker(groups[1], control=control)))
    worker.start()
    control.stop()
    worker.join(5)
    assert not worker.is_alive()
    assert out[0].activations == 0 and out[0].stopped == "stop"
    for g in groups.values():
        g.close()
