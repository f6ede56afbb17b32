"""Built-in tasks: ``digits``, a small numpy classifier on a dataset shipped here,
``synthetic``, a model of any size whose fit costs next to nothing (for benchmarks and tests),
``synthetic-federated``, LEAF's synthetic(alpha, beta) population of any size (a client is a row),
and ``flower``, a Flower ``ClientApp`` or ``client_fn`` named by ``[task] app`` (extra ``flower``).

Only records and options are declared at import; numpy and the data load when
the task is built, so listing plugins stays fast.
"""

from __future__ import annotations

from typing import Any, Iterable

import meshkit
from meshkit.flower import AppOptions

from meshkit_tasks.options import DigitsOptions, SyntheticFederatedOptions, SyntheticOptions


def _digits(options: Any) -> Any:
    from meshkit_tasks.digits import DigitsTask

    return DigitsTask(options)


def _synthetic(options: Any) -> Any:
    from meshkit_tasks.synthetic import SyntheticTask

    return SyntheticTask(options)


def _synthetic_federated(options: Any) -> Any:
    from meshkit_tasks.synthetic_federated import SyntheticFederatedTask

    return SyntheticFederatedTask(options)


def _flower(options: AppOptions) -> Any:
    from meshkit.flower import app_task

    return app_task(options)


@meshkit.hookimpl
def meshkit_tasks() -> Iterable[meshkit.Component]:
    return [
        meshkit.Component(
            "digits", _digits, DigitsOptions,
            summary="numpy MLP on the 8x8 handwritten digits (1,797 images, shipped; "
                    "UCI via scikit-learn, CC BY 4.0 / BSD-3)"),
        meshkit.Component(
            "synthetic", _synthetic, SyntheticOptions,
            summary="a model of `params` parameters whose fit is a seeded perturbation "
                    "(for measuring the mesh, not learning)"),
        meshkit.Component(
            "synthetic-federated", _synthetic_federated, SyntheticFederatedOptions,
            summary="LEAF's synthetic(alpha, beta): `clients` clients, each its own model "
                    "and features, made from the seed on demand (a population)"),
        meshkit.Component(
            "flower", _flower, AppOptions,
            summary="a Flower ClientApp (Message API or client_fn) or client_fn ([task] app "
                    "= \"module:attribute\"), unchanged (extra flower)"),
    ]
