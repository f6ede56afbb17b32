"""Built-in partitioners: ``contiguous`` (the default), ``iid``, ``dirichlet``,
``pathological`` and ``local``.

Written as a third-party plugin would be: records and options here, the
splits (numpy) in :mod:`meshkit_partitioners.splits`, loaded when a factory
builds one, so listing plugins stays fast.
"""

from __future__ import annotations

from typing import Any, Iterable

import meshkit

from meshkit_partitioners.options import DirichletOptions, NoOptions, PathologicalOptions


def _build(name: str) -> Any:
    def factory(options: Any) -> Any:
        from meshkit_partitioners import splits

        return getattr(splits, name)(options)
    return factory


@meshkit.hookimpl
def meshkit_partitioners() -> Iterable[meshkit.Component]:
    return [
        meshkit.Component("contiguous", _build("Contiguous"), NoOptions,
                          summary="row blocks in the data's order (the default)"),
        meshkit.Component("iid", _build("Iid"), NoOptions,
                          summary="a seeded shuffle cut into equal parts"),
        meshkit.Component("dirichlet", _build("Dirichlet"), DirichletOptions,
                          summary="label skew: each label's rows spread over the clients by a "
                                  "seeded Dirichlet(alpha)"),
        meshkit.Component("pathological", _build("Pathological"), PathologicalOptions,
                          summary="each client holds only classes_per_client labels"),
        meshkit.Component("local", _build("Local"), NoOptions,
                          summary="no simulation: each node's own train_data() is one client"),
    ]
