"""A run's ``[compression]``: the built compressor, how a fit request names it, and what it
composes with (decided by :class:`CompressionTraits`, never by a compressor's name).

Rule: every decision about what compression composes with lives here.

Where compression sits (docs/compression.md has the argument):

* **the upload**, and with ``[compression] broadcast = true`` **the download**
  too: the coordinator sends each worker a compressed delta against the model
  it holds (:mod:`meshkit.train._broadcast`; only a strategy with the trait
  ``StrategyTraits.broadcast``, and not under secure aggregation, whose round
  sends the model itself);
* **after a client's clip** (``[privacy] clip = "client"``): the clip bound
  S must hold for what is *sent*, so only a ``contractive`` compressor is
  accepted there (‖C(x)‖ ≤ ‖x‖ ≤ S); the Gaussian noise is added by the
  coordinator to the sum of decoded, bounded updates, so its sensitivity
  is still S. With ``clip = "coordinator"`` (the default) the coordinator
  clips the *decoded* update, so every compressor composes: the released
  sum's sensitivity is S whatever the decoder produced;
* **before the fold**: a linear fold sums each compressed contribution a
  chunk at a time into an exact sum (:class:`~meshkit.compression.CompressedSum`,
  in the batched and the flat compressed round alike); otherwise each
  contribution is decoded as it is pulled, so robust rules see individual updates;
* **inside secure aggregation's field** when the compressor is dense and
  declares ``integer_field`` and the scheme declares ``integer_inputs``:
  each client quantises its update onto the round's shared grid
  (:class:`~meshkit.compression.FieldCompressor`), the scheme masks the
  codes in a field of ``field_bits + ceil(log2 n)`` bits, and the
  coordinator decodes the unmasked integer sum once. A sparse compressor is
  refused (its indices would reveal which coordinates each client moved),
  and so is any other, naming the trait it lacks;
* **not with** host relays' partial sums: they fold whole contributions on
  the relay's side, so a compressed run behind relays plays its rounds flat
  (each contribution crosses the wire compressed, once) -- but with
  ``clip_range`` a relay adds its ranks' integer sums of codes
  (:mod:`meshkit.train._relay.grid`). A worker serving
  many clients answers a batch of them with each one's payload
  (:mod:`meshkit.train._rounds.compressed`) -- or, with ``[compression]
  clip_range`` and a dense ``integer_field`` compressor, with one exact
  integer sum of its clients' codes on the configuration's grid
  (:class:`~meshkit.compression.CodeSum`); a ``stateful`` or ``sparse``
  compressor is refused there, naming the trait, and so is ``clip_range``
  under secure aggregation (whose own ``clip_range`` is the grid).
"""

from __future__ import annotations

from typing import Any, Collection, Mapping

import attrs

import numpy as np

from meshkit.compression._contract import CompressionTraits, compression_traits
from meshkit.compression._payload import compressed_keys, encode_update, is_residual
from meshkit.errors import RefusedError
from meshkit.secure_aggregation import SecureAggregationTraits

__all__ = ["CompressionPlan", "check_compression", "upload_estimate"]


@attrs.frozen
class CompressionPlan:
    """The run's compressor, by name and options (a worker builds the same one)."""

    name: str
    options: Mapping[str, Any]
    compressor: Any
    #: ``[compression] broadcast``: the model goes down as a compressed delta too.
    broadcast: bool = False
    #: ``[compression] clip_range``: a linear batched round's clients quantise onto the
    #: shared grid ``[-clip_range, clip_range]`` and each worker sends one integer sum
    #: (:class:`~meshkit.compression.CodeSum`); None: each client's payload on its own grid.
    clip_range: float | None = None
    #: ``[compression] residual``: where error feedback keeps a client's residual --
    #: ``"coordinator"`` (its client-local store; the residual rides with each fit and its
    #: result) or ``"worker"`` (the worker the client is pinned to keeps it; it never
    #: travels: :mod:`meshkit.train._worker.residuals`).
    residual: str = "coordinator"

    @property
    def traits(self) -> CompressionTraits:
        return compression_traits(self.compressor)

    @property
    def residuals_travel(self) -> bool:
        """Whether a payload carries its client's new residuals (error feedback whose
        residuals the coordinator keeps)."""
        return self.traits.stateful and self.residual == "coordinator"

    @property
    def worker_residual(self) -> bool:
        """Whether each worker keeps its clients' residuals (error feedback, ``residual =
        "worker"``): clients are pinned to workers and nothing of a residual travels."""
        return self.traits.stateful and self.residual == "worker"

    def request(self, raw: Collection[str] = ()) -> dict[str, Any]:
        """A fit request's ``compress`` field: which compressor, and the keys sent whole."""
        return {"name": self.name, "options": dict(self.options), "raw": sorted(raw)}


def check_compression(plan: CompressionPlan, *, where: str, private_client_clip: bool,
                      secure: SecureAggregationTraits | None) -> None:
    """Refuse what a compressor's traits cannot compose with (module docstring).

    ``secure`` is the run's secure-aggregation scheme's traits (None: no
    ``[secure_aggregation]``).
    """
    traits = plan.traits
    if secure is not None and plan.broadcast:
        raise RefusedError(
            f"{where}: [compression] broadcast = true with [secure_aggregation]: the secure "
            f"round hands each client the model through its own protocol, and sending it as "
            f"a delta is not built into that round. Drop broadcast (uploads are still "
            f"compressed), or drop [secure_aggregation]")
    if secure is not None:
        why = None
        if traits.sparse:
            why = ("a sparse payload names the coordinates each client moved, and secure "
                   "aggregation would reveal them (the trait CompressionTraits.sparse)")
        elif not traits.integer_field:
            why = ("a secure round sums codes on one grid every client shares, and this "
                   "compressor's codes are on a grid of its own (it lacks the trait "
                   "CompressionTraits.integer_field; quantize has it, without rotate)")
        elif not secure.integer_inputs:
            why = ("the scheme masks only updates it quantised itself (it lacks the trait "
                   "SecureAggregationTraits.integer_inputs)")
        if why is not None:
            raise RefusedError(
                f"{where}: [compression] name = {plan.name!r} with [secure_aggregation]: "
                f"{why}. Use [compression] name = \"quantize\" (rotate = false), or drop one "
                f"of the two tables; secure aggregation alone sends modulus_bits per "
                f"coordinate")
    if plan.clip_range is not None:
        why = None
        if secure is not None:
            why = ("a secure round's grid is [secure_aggregation] clip_range; set the range "
                   "there")
        elif traits.sparse or not traits.integer_field:
            why = ("a worker sums its clients' codes only when they are dense integers on one "
                   "grid (the traits CompressionTraits.integer_field, not sparse; quantize has "
                   "them, without rotate)")
        elif traits.stateful:
            why = ("a residual is kept per client, and a worker's sum has none to give back "
                   "(the trait CompressionTraits.stateful)")
        if why is not None:
            raise RefusedError(
                f"{where}: [compression] clip_range with name = {plan.name!r}: {why}. Drop "
                f"clip_range (each client's payload then travels on its own grid)")
    if plan.residual == "worker" and not traits.stateful:
        raise RefusedError(
            f"{where}: [compression] residual = \"worker\" with name = {plan.name!r}: it says "
            f"where error feedback keeps each client's residual, and this compressor keeps "
            f"none (it lacks the trait CompressionTraits.stateful). Drop residual, or use a "
            f"compressor with error feedback (top-k, error_feedback = true)")
    if private_client_clip and not traits.contractive:
        raise RefusedError(
            f"{where}: [compression] name = {plan.name!r} with [privacy] clip = \"client\": "
            f"the client's clip bound must hold for what it sends, and this compressor can "
            f"send a longer vector than it was given (it lacks the trait "
            f"CompressionTraits.contractive). Use clip = \"coordinator\" (the coordinator "
            f"clips the decoded update, so the bound holds), or a contractive compressor "
            f"(top-k without error feedback)")


def upload_estimate(plan: CompressionPlan, state: Mapping[str, Any],
                    raw: Collection[str] = ()) -> dict[str, Any]:
    """What one client's compressed update of ``state`` carries (``meshkit check``): the
    payload's bits per compressed coordinate (float32: 32), the keys sent whole, the
    residual error feedback keeps (bytes) and where (``residual_kept``), and whether the model goes down the same
    way (``broadcast``). Encoded for real, from a seeded update."""
    keys = compressed_keys(state, raw)
    start = {k: np.asarray(state[k]) for k in keys}
    rng = np.random.default_rng(0)
    fitted = {k: v + rng.standard_normal(v.shape).astype(v.dtype) * 1e-2
              for k, v in start.items()}
    payload, residual = encode_update(plan.compressor, start, fitted, seed=0)
    coordinates = sum(int(v.size) for v in start.values())
    sent = sum(int(v.nbytes) for k, v in payload.items() if not is_residual(k))
    return {"name": plan.name, "coordinates": coordinates, "payload_bytes": sent,
            "bits_per_coordinate": 8 * sent / coordinates if coordinates else 0.0,
            "whole": sorted(k for k in state if k not in set(keys)),
            "residual_bytes": sum(int(v.nbytes) for v in residual.values()),
            "residual_kept": plan.residual,
            "broadcast": plan.broadcast}
