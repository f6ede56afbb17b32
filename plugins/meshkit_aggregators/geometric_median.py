"""``geometric-median``: the smoothed Weiszfeld geometric median of RFA (Pillutla,
Kakade, Harchaoui, *Robust Aggregation for Federated Learning*, IEEE TSP 2022).

The point ``z`` minimising ``sum_i max(nu, ||z - x_i||)`` over the
contributions ``x_i``, by the smoothed Weiszfeld iteration from the
coordinate-wise median::

    b_i = 1 / max(nu, ||z - x_i||);   z <- sum_i b_i x_i / sum_i b_i

until ``||z_new - z|| <= eps * max(1, ||z||)`` or ``max_iter`` iterations.
Defaults: ``eps = 1e-6``, ``max_iter = 100``, ``nu = 1e-6`` (the smoothing
that keeps the step finite when ``z`` lands on a contribution). The
geometric median is translation-equivariant, so contributions and updates
give the same result (no reference is needed).

Robust at every magnitude (breakdown point 1/2 at any finite value):

* **Equal weights.** Each contributor counts once, whatever example count
  it claims (RFA weighs by data; a claimed count is the contributor's own
  word, and 2^53 of them would buy the round). The weights still pass the
  kernel's strictness checks.
* **A robust start.** The iteration starts at the coordinate-wise median,
  inside the honest majority's range, not at the mean, which one value at
  1e100 drags out of reach of ``max_iter`` steps.
* **Scale-safe distances.** ``||z - x_i||`` is computed as a plain sum of
  squares and, where that overflows, underflows or passes 1e300, again as
  ``s * ||(z - x_i) / s||`` with ``s`` the largest ``|z - x_i|`` (as
  ``hypot`` does), so a contribution at 1e155 or 1e300 gets its true, huge
  distance and a vanishing weight instead of ``inf`` and ``NaN``.
"""

from __future__ import annotations

import numpy as np

from meshkit_aggregators._distances import distances_to
from meshkit_aggregators.robust import RobustRule

__all__ = ["GeometricMedian"]


class GeometricMedian(RobustRule):
    """RFA's smoothed Weiszfeld iteration (see the module docstring)."""

    name = "geometric-median"

    def __init__(self, eps: float = 1e-6, max_iter: int = 100, nu: float = 1e-6) -> None:
        if not eps > 0 or not nu > 0:
            raise ValueError(f"eps and nu must be > 0, got eps={eps!r}, nu={nu!r}")
        if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
            raise ValueError(f"max_iter must be an integer >= 1, got {max_iter!r}")
        self.eps, self.max_iter, self.nu = eps, max_iter, nu
        #: Iterations the last aggregate took (for tests and logs).
        self.iterations = 0

    def combine(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        # w (claimed work) passed the strictness checks and is not used: equal weights.
        z = np.median(x, axis=0)
        self.iterations = 0
        for step in range(1, self.max_iter + 1):
            b = 1.0 / np.maximum(self.nu, distances_to(x, z))
            # b_i x_i stays finite: a huge x_i has a weight of 1 / its own size.
            new = b @ x / b.sum()
            moved = float(distances_to(new[None, :], z)[0])
            size = float(distances_to(new[None, :], np.zeros_like(new))[0])
            z = new
            self.iterations = step
            if moved <= self.eps * max(1.0, size):
                break
        result: np.ndarray = z
        return result
