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
nothing is released about them. The clipped updates are summed exactly
(:class:`meshkit.privacy.ClippedSum`, in units of 2^-F): the sum is the
same bits whether the coordinator adds every update or merges one partial
per worker.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from meshkit import AggregationError
from meshkit.privacy import ClippedSum, common_normal

__all__ = ["NoisedSum"]


class NoisedSum(ClippedSum):
    """A fold (``add``/``result``) computing one DP-FedAvg round's noised mean model.

    ``reference`` is the round's global model; ``clip_norm`` S; ``noise_std``
    the standard deviation added to each coordinate of the *sum* (z·S);
    ``expected`` the fixed denominator m; ``rng`` the noise generator;
    ``clipped_by_clients``: the updates come clipped (``clip = "client"``),
    and are clipped again here only to enforce the bound (a no-op for an
    honest client). ``common`` (key, round): the paired benchmark's common random
    numbers (:func:`meshkit.privacy.common_normal`, set only for a seeded run by
    ``MESHKIT_BENCH_COMMON_NOISE``): the noise comes from them, not from ``rng``, still
    N(0, noise_std²) a coordinate. The clipping and the exact sum are meshkit's
    (:class:`meshkit.privacy.ClippedSum`): a batched round merges each
    worker's partial sum of its clients' clipped updates into this fold
    (:meth:`merge`), the same bits as adding every update here.
    """

    def __init__(self, reference: Mapping[str, Any], *, clip_norm: float, noise_std: float,
                 expected: float, rng: np.random.Generator,
                 clipped_by_clients: bool = False, name: str = "privacy",
                 common: tuple[int, int] | None = None) -> None:
        if not expected > 0:
            raise ValueError(f"the expected cohort size must be > 0, got {expected}")
        super().__init__(reference, clip_norm=clip_norm, clipped_by_clients=clipped_by_clients,
                         name=name)
        self.noise_std = float(noise_std)
        self.expected = float(expected)
        self.rng = rng
        self.common = common
        #: Sums of updates a secure round handed over whole (:meth:`add_total`), float64.
        self.totals = {k: np.zeros(reference[k].shape, np.float64) for k in self.keys}
        self._secure = 0

    @property
    def count(self) -> int:
        """Contributions folded: added, merged, or in a secure round's sum."""
        return self._count + self._secure

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
            self.totals[key] += total[key]
        self._secure += count

    def noised_sum(self) -> dict[str, np.ndarray]:
        """The sum plus the noise, drawn key by key in sorted key order (float64)."""
        summed = self.total()
        if self.common is None:
            return {k: (summed[k] + self.totals[k])
                    + self.rng.normal(0.0, self.noise_std, summed[k].shape) for k in self.keys}
        # The benchmark's common numbers: one vector over the keys in sorted order, the
        # worker's update order (a distributed client's share of coordinate i uses the same).
        sizes = [summed[k].size for k in self.keys]
        noise = common_normal(*self.common, self.count, sum(sizes)) * self.noise_std
        out, offset = {}, 0
        for key, size in zip(self.keys, sizes):
            out[key] = (summed[key] + self.totals[key]) + noise[offset:offset + size].reshape(
                summed[key].shape)
            offset += size
        return out

    def result(self) -> dict[str, Any]:
        """The round's new model: the global plus the noised sum over m (added once)."""
        released = self.noised_sum()
        out = dict(self.reference)
        for key in self.keys:
            ref = self.reference[key]
            out[key] = (self._ref64[key] + released[key] / self.expected).astype(ref.dtype)
        return out
