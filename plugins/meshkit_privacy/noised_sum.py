"""The noised sum of DP-FedAvg: clip each update, sum, add Gaussian noise once, divide by m.

Rule (McMahan et al. 2018, user-level DP-FedAvg): a round releases

    global + (Σ_i clip(update_i, S) + N(0, σ²·I)) / m,   σ = z·S/m · m = z·S on the sum

where ``update_i`` is client i's model minus the round's global model, S the
clip norm, z the noise multiplier and m the *expected* cohort size (q·N with
Poisson sampling), never the realized count: dividing by the realized count
would make the denominator depend on who took part, and the sensitivity of
the released mean would no longer be S/m. The noise on the mean is therefore
σ = z·S/m per coordinate. Every client counts once (weight 1, user-level
privacy), whatever examples it trained on.

Only floating-point arrays are updates: integer arrays (counters such as
``num_batches_tracked``) and JSON leaves take the global model's value, so
nothing is released about them.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping

import numpy as np

from meshkit import AggregationError
from meshkit.aggregation import clip_update, squared_norm
from meshkit.privacy import float_keys

__all__ = ["NoisedSum"]

log = logging.getLogger(__name__)

#: How far past S a client-clipped update may come (rounding of global + update − global).
_SLACK = 1e-5


class NoisedSum:
    """A fold (``add``/``result``) computing one DP-FedAvg round's noised mean model.

    ``reference`` is the round's global model; ``clip_norm`` S; ``noise_std``
    the standard deviation added to each coordinate of the *sum* (z·S);
    ``expected`` the fixed denominator m; ``rng`` the noise generator;
    ``clipped_by_clients``: the updates come clipped (``clip = "client"``),
    and are clipped again here only to enforce the bound (a no-op for an
    honest client).
    """

    def __init__(self, reference: Mapping[str, Any], *, clip_norm: float, noise_std: float,
                 expected: float, rng: np.random.Generator,
                 clipped_by_clients: bool = False, name: str = "privacy") -> None:
        if not expected > 0:
            raise ValueError(f"the expected cohort size must be > 0, got {expected}")
        self.reference = reference
        self.keys = float_keys(reference)
        self.clip_norm = float(clip_norm)
        self.noise_std = float(noise_std)
        self.expected = float(expected)
        self.rng = rng
        self.clipped_by_clients = clipped_by_clients
        self.name = name
        self.sum = {k: np.zeros(reference[k].shape, np.float64) for k in self.keys}
        self._ref64 = {k: np.asarray(reference[k], np.float64) for k in self.keys}
        self._scratch = {k: np.empty(reference[k].shape, np.float64) for k in self.keys}
        #: Contributions folded, and those whose update was within S before clipping.
        self.count = 0
        self.unclipped = 0
        #: Each contribution's norm before clipping (coordinator placement) or as received.
        self.norms: list[float] = []
        #: Norms of the clipped updates actually summed (each <= S).
        self.clipped_norms: list[float] = []

    def add(self, state: Mapping[str, Any], weight: float = 1.0, *,
            source: str | None = None) -> None:
        who = source or f"contributor #{self.count}"
        total = 0.0
        for key in self.keys:  # the update, in float64 scratch buffers kept across adds
            if key not in state:
                raise AggregationError(f"{self.name}: {who} lacks key {key!r}")
            value = np.asarray(state[key])
            if value.shape != self._ref64[key].shape:
                raise AggregationError(
                    f"{self.name}: {who} key {key!r} has shape {value.shape}, the global "
                    f"model {self._ref64[key].shape}")
            delta = np.subtract(value, self._ref64[key], out=self._scratch[key],
                                dtype=np.float64)
            part = squared_norm(delta)
            if not math.isfinite(part):  # a NaN or an infinity (or a norm beyond float64)
                raise AggregationError(f"{self.name}: {who} key {key!r} is not finite")
            total += part
        norm = math.sqrt(total)
        # clip_update's rule (meshkit.aggregation), in place: one scale for every array
        scale = min(1.0, self.clip_norm / norm) if norm > 0 else 1.0
        if self.clipped_by_clients and norm > self.clip_norm * (1 + _SLACK):
            log.warning("%s: %s sent an update of norm %.6g with clip = \"client\" and S = "
                        "%.6g: clipped here to keep the guarantee", self.name, who, norm,
                        self.clip_norm)
        for key in self.keys:
            delta = self._scratch[key]
            if scale < 1.0:
                np.multiply(delta, scale, out=delta)
            self.sum[key] += delta
        self.norms.append(norm)
        self.clipped_norms.append(norm * scale)
        self.unclipped += norm <= self.clip_norm
        self.count += 1

    def add_total(self, total: Mapping[str, np.ndarray], count: int) -> None:
        """Fold in the sum of ``count`` updates the clients clipped themselves.

        What a secure round hands over (``[secure_aggregation]``): the
        coordinator never sees the individual updates, so their norms are
        neither checked nor recorded here; ``total`` maps every float key to
        the float64 sum of the updates (not of the models).
        """
        if not self.clipped_by_clients:
            raise AggregationError(f"{self.name}: a sum of updates can only be folded when "
                                   f"the clients clip them (clip = \"client\")")
        for key in self.keys:
            if key not in total or np.shape(total[key]) != self._ref64[key].shape:
                raise AggregationError(f"{self.name}: the summed updates lack key {key!r} of "
                                       f"shape {self._ref64[key].shape}")
            self.sum[key] += total[key]
        self.count += count

    def noised_sum(self) -> dict[str, np.ndarray]:
        """The sum plus the noise, drawn key by key in sorted key order (float64)."""
        return {k: self.sum[k] + self.rng.normal(0.0, self.noise_std, self.sum[k].shape)
                for k in self.keys}

    def result(self) -> dict[str, Any]:
        """The round's new model: the global plus the noised sum over m (added once)."""
        released = self.noised_sum()
        out = dict(self.reference)
        for key in self.keys:
            ref = self.reference[key]
            out[key] = (self._ref64[key] + released[key] / self.expected).astype(ref.dtype)
        return out
