"""A compressed round's two ends on the coordinator: the fits it asks for, and its decoder.

The round engine plays a compressed round flat (:data:`~meshkit.train._rounds.engine.ROUND_PATHS`):
each contribution crosses the wire compressed once and is decoded as it is pulled.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs

from meshkit.compression import (CompressionPlan, compressed_keys, decode_contribution,
                                 is_residual, residual_name)
from meshkit.train._local_keys import ClientLocal
from meshkit.train._strategy import StrategyContext


from meshkit.train._rounds.work import Work

__all__ = ["compressed_work", "Unpacker"]


def compressed_work(ctx: StrategyContext, work: Sequence[Work], state: Mapping[str, Any],
                    local: ClientLocal | None
                    ) -> tuple[list[Work], ClientLocal | None, Unpacker]:
    """``work`` asking for compressed fits (``compress``), the store their local keys and
    residuals are kept in, and the round's decoder.

    Sent whole: FedBN's local keys (a client's own, never aggregated) and the task's
    buffers (BatchNorm's statistics are estimates, not updates: a sparsified running
    variance breaks the normalisation, and they are small). With error feedback the
    store is the run's client-local store (FedBN's), whose keys then also name each
    compressed key's residual, and whose values travel with the client's fit.
    """
    plan: CompressionPlan = ctx.compression
    store = local if local else None
    own = {k for k in (store.keys if store is not None else ()) if not is_residual(k)}
    raw = sorted(own | (ctx.buffers & set(state)))
    if plan.traits.stateful:
        store = ctx.client_local
        store.keys = store.keys | {residual_name(k) for k in compressed_keys(state, raw)}
    field = plan.request(raw)
    out = []
    for w in work:
        request = {**w.request, "compress": field}
        kept = store.of(w.key) if store is not None else {}
        if kept:
            request["local"] = {**kept, **dict(w.request.get("local") or {})}
        out.append(attrs.evolve(w, request=request))
    return out, store, Unpacker(plan, tuple(raw))


@attrs.frozen
class Unpacker:
    """A compressed round's decoder: a pulled payload back to the contribution it stands for."""

    plan: CompressionPlan
    #: The keys sent whole (:func:`compressed_work`).
    raw: tuple[str, ...]

    def decode(self, payload: Mapping[str, Any], reference: Mapping[str, Any],
               what: str) -> tuple[dict[str, Any], dict[str, Any]]:
        return decode_contribution(self.plan.compressor, payload, reference, raw=self.raw,
                                   what=what)
