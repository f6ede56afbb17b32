"""Built-in outer optimizers: how the global model steps from a round's consensus.

This module only declares records and options classes; the numerics load
when a factory runs, so listing plugins stays fast.
"""

from __future__ import annotations

from typing import Any, Iterable

import meshkit


def _average(options: Any = None) -> Any:
    from meshkit_outer.optimizers import Average

    return Average()


@meshkit.hookimpl
def meshkit_outer_optimizers() -> Iterable[meshkit.Component]:
    return [
        meshkit.Component(
            "average", _average,
            summary="adopt the consensus as the new global model (plain FedAvg)"),
    ]
