"""A hostile secure-aggregation worker, for the real-process tests only.

A test puts this directory first on ``PYTHONPATH`` and sets
``MESHKIT_TEST_HOSTILE = "RANK:MODE"``; a local launch passes both to its
worker processes, and Python imports this module at start-up in each. In
the ``meshkit node`` process whose ``--rank`` is RANK it patches the real
worker's :class:`~meshkit.train._worker.secure.SecureClients` (nothing else
changes: the wire, the schema checks and the fits are the real ones):

* ``error``: every ``secagg_mask`` raises, so the worker answers with a
  well-formed ``error`` reply;
* ``garbage``: every sealed share it sends (``secagg_share``) is garbage
  after its ephemeral key (on the code before, after the nonce);
* ``lie``: in ``secagg_unmask`` every share it holds of one other client's
  self-mask seed is altered (off the polynomial), through each client it
  plays.

Every other process (the coordinator, other ranks) is left alone.
"""

from __future__ import annotations

import os
import sys


def _install() -> None:
    spec = os.environ.get("MESHKIT_TEST_HOSTILE", "")
    if not spec or "node" not in sys.argv or "--rank" not in sys.argv:
        return
    rank, _, mode = spec.partition(":")
    if sys.argv[sys.argv.index("--rank") + 1] != rank:
        return
    from typing import Any

    from meshkit.train._worker import secure as _secure_worker

    original = _secure_worker.SecureClients.handle

    def handle(self: Any, op: str, request: Any, fit: Any) -> dict[str, Any]:
        if mode == "error" and op == "secagg_mask":
            raise RuntimeError("hostile worker: it will not mask")
        reply = original(self, op, request, fit)
        if mode == "garbage" and op == "secagg_share":
            sealed = reply["sealed"].copy()
            sealed[:, 32:] = 0
            reply = {**reply, "sealed": sealed}
        if mode == "lie" and op == "secagg_unmask":
            mine = set(int(h) for h in reply["holders"])
            owners = [int(o) for o, k in zip(reply["owners"], reply["kinds"])
                      if k == 0 and int(o) not in mine]
            if owners:
                target = max(owners)
                shares = reply["shares"].copy()
                for i, (o, k) in enumerate(zip(reply["owners"], reply["kinds"])):
                    if int(o) == target and k == 0:
                        shares[i, -1] ^= 1
                reply = {**reply, "shares": shares}
        return reply

    _secure_worker.SecureClients.handle = handle


_install()
