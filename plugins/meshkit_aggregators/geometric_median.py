"""``geometric-median``: the smoothed Weiszfeld geometric median of RFA (Pillutla,
Kakade, Harchaoui, *Robust Aggregation for Federated Learning*, IEEE TSP 2022).

The point ``z`` minimising ``sum_i a_i * max(nu, ||z - x_i||)`` over the
contributions ``x_i`` with weights ``a_i`` (realized work, as RFA weighs
clients by their data), by the smoothed Weiszfeld iteration from the
weighted mean::

    b_i = a_i / max(nu, ||z - x_i||);   z <- sum_i b_i x_i / sum_i b_i

until ``||z_new - z|| <= eps * max(1, ||z||)`` or ``max_iter`` iterations.
Defaults: ``eps = 1e-6``, ``max_iter = 100``, ``nu = 1e-6`` (the smoothing
that keeps the step finite when ``z`` lands on a contribution). The
geometric median is translation-equivariant, so contributions and updates
give the same result (no reference is needed).
"""

from __future__ import annotations

import numpy as np

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
        a = w / w.sum()
        z = a @ x
        self.iterations = 0
        for step in range(1, self.max_iter + 1):
            distance = np.sqrt(np.einsum("ij,ij->i", x - z, x - z))
            b = a / np.maximum(self.nu, distance)
            new = b @ x / b.sum()
            moved = float(np.linalg.norm(new - z))
            z = new
            self.iterations = step
            if moved <= self.eps * max(1.0, float(np.linalg.norm(z))):
                break
        result: np.ndarray = z
        return result
