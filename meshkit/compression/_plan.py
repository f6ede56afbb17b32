"""A run's ``[compression]``: the built compressor, how a fit request names it, and what it
composes with (decided by :class:`CompressionTraits`, never by a compressor's name).

Rule: every decision about what compression composes with lives here.

Where compression sits (docs/compression.md has the argument):

* **the upload only**: the worker compresses its fit's update; the
  coordinator broadcasts the model whole (a downlink delta is not built);
* **after a client's clip** (``[privacy] clip = "client"``): the clip bound
  S must hold for what is *sent*, so only a ``contractive`` compressor is
  accepted there (‖C(x)‖ ≤ ‖x‖ ≤ S); the Gaussian noise is added by the
  coordinator to the sum of decoded, bounded updates, so its sensitivity
  is still S. With ``clip = "coordinator"`` (the default) the coordinator
  clips the *decoded* update, so every compressor composes: the released
  sum's sensitivity is S whatever the decoder produced;
* **before the fold**: each contribution is decoded as it is pulled, so
  robust rules see individual updates and a linear fold sums decoded
  updates in the engine's bounded window;
* **not with** secure aggregation, host relays' partial sums or the
  batched round: a secure round's clients mask their whole update (the
  refusal names the trait a compressor would need); relays and the batched
  round fold whole contributions on the worker side, so a compressed run
  plays its rounds flat instead (each contribution crosses the wire
  compressed, once).
"""

from __future__ import annotations

from typing import Any, Collection, Mapping

import attrs

import numpy as np

from meshkit.compression._contract import CompressionTraits, compression_traits
from meshkit.compression._payload import compressed_keys, encode_update, is_residual
from meshkit.errors import RefusedError

__all__ = ["CompressionPlan", "check_compression", "upload_estimate"]


@attrs.frozen
class CompressionPlan:
    """The run's compressor, by name and options (a worker builds the same one)."""

    name: str
    options: Mapping[str, Any]
    compressor: Any

    @property
    def traits(self) -> CompressionTraits:
        return compression_traits(self.compressor)

    def request(self, raw: Collection[str] = ()) -> dict[str, Any]:
        """A fit request's ``compress`` field: which compressor, and the keys sent whole."""
        return {"name": self.name, "options": dict(self.options), "raw": sorted(raw)}


def check_compression(plan: CompressionPlan, *, where: str, private_client_clip: bool,
                      secure: bool) -> None:
    """Refuse what a compressor's traits cannot compose with (module docstring)."""
    traits = plan.traits
    if secure:
        if traits.sparse:
            why = ("a sparse payload names the coordinates each client moved, and secure "
                   "aggregation would reveal them (the trait CompressionTraits.sparse)")
        else:
            why = ("a secure round's clients mask their whole update in the field; quantising "
                   "inside the masking field is not built yet (it needs "
                   "CompressionTraits.integer_field and the round driver's support)")
        raise RefusedError(
            f"{where}: [compression] name = {plan.name!r} with [secure_aggregation]: {why}. "
            f"Drop one of the two tables; secure aggregation alone already sends "
            f"modulus_bits per coordinate")
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
    payload's bits per compressed coordinate (float32: 32), the keys sent whole, and the
    residual error feedback sends back (bytes). Encoded for real, from a seeded update."""
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
            "residual_bytes": sum(int(v.nbytes) for v in residual.values())}
