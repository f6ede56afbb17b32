"""Options of the built-in tasks (cheap to import: attrs only)."""

from __future__ import annotations

from typing import Any

import attrs

from meshkit.options import count_at_least, non_negative, positive

__all__ = ["DigitsOptions", "SyntheticOptions", "SyntheticFederatedOptions"]


def _fraction(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not 0.0 < value < 1.0:
        raise ValueError(f"{attribute.name} must be between 0 and 1 (exclusive), got {value}")


def _cpu(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in ("cpu", "auto"):
        raise ValueError(
            f"{attribute.name} = {value!r}: digits is a numpy task and runs on the cpu only; "
            f"use 'cpu' (run a torch task for {value!r})")


@attrs.frozen
class DigitsOptions:
    """``[task]`` keys for ``digits``."""

    #: Width of the hidden layer.
    hidden: int = attrs.field(default=32, validator=positive)
    #: SGD learning rate (client-side fit and data-parallel apply).
    lr: float = attrs.field(default=0.1, validator=positive)
    #: Passes over the shard per federated fit.
    epochs: int = attrs.field(default=1, validator=positive)
    batch_size: int = attrs.field(default=32, validator=positive)
    #: FedProx proximal coefficient: adds ``mu/2 * ||w - w_global||^2`` to the
    #: client loss, so clients are pulled towards the model they started from.
    proximal_mu: float = attrs.field(default=0.0, validator=non_negative)
    #: Share of the images held out for evaluation (never trained on).
    test_fraction: float = attrs.field(default=0.2, validator=_fraction)
    #: Seed of the train/test split (fixed, so every node agrees on it).
    split_seed: int = attrs.field(default=0, validator=count_at_least(0))
    #: A CSV file of this node's own training images (64 pixel values 0..16, then
    #: the label, comma-separated, one image a line, no header; ``.gz`` read as
    #: gzip). Empty: the shipped images' training split. Read when the data is
    #: first needed, never when the task is built.
    train_csv: str = ""
    #: The same for held-out images. Empty: the shipped images' held-out split,
    #: unless ``train_csv`` is set (then this node has no held-out data).
    test_csv: str = ""
    #: Where the model runs; numpy runs on the cpu, so only "cpu" (or "auto").
    #: A node's --device reaches the task here (docs/federating-real-data.md).
    device: str = attrs.field(default="cpu", validator=_cpu)
    #: Seconds every fit waits after training, as a slower device would take
    #: longer (0: none). Set on one node (``--task-option fit_delay=0.25``) to
    #: have a real straggler on one machine (docs/async.md).
    fit_delay: float = attrs.field(default=0.0, validator=non_negative)


@attrs.frozen
class SyntheticOptions:
    """``[task]`` keys for ``synthetic`` (a model of any size, for measuring the mesh)."""

    #: Float parameters in the model.
    params: int = attrs.field(default=1_000_000, validator=positive)
    #: The model's dtype: float16, bfloat16, float32 or float64.
    dtype: str = "float32"
    #: Arrays the parameters are split over (as evenly as they go).
    arrays: int = attrs.field(default=1, validator=positive)
    #: Training rows (each client's shard is a block of them).
    rows: int = attrs.field(default=1024, validator=positive)
    #: Scale of a fit's seeded perturbation (0: a free fit, the state returned as given).
    noise: float = attrs.field(default=0.01, validator=non_negative)
    #: Step size of data-parallel ``apply``.
    lr: float = attrs.field(default=0.1, validator=positive)


#: The largest alpha / beta of synthetic-federated: the features are float32, and a
#: client's mean drawn at a standard deviation past this overflows them (inf, then NaN
#: data and labels), so a population of garbage must not pass check.
MAX_HETEROGENEITY = 1e6


def _heterogeneity(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    non_negative(instance, attribute, value)
    if not value <= MAX_HETEROGENEITY:
        raise ValueError(f"{attribute.name} must be at most {MAX_HETEROGENEITY:g} (the "
                         f"features are float32; LEAF's runs use 0..1), got {value}")


def _probability(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{attribute.name} must be at least 0 and below 1, got {value}")


@attrs.frozen
class SyntheticFederatedOptions:
    """``[task]`` keys for ``synthetic-federated`` (LEAF's / FedProx's synthetic(alpha, beta))."""

    #: Model heterogeneity: client k's model mean u_k ~ N(0, alpha^2) (0: one model for all).
    alpha: float = attrs.field(default=1.0, validator=_heterogeneity)
    #: Feature heterogeneity: client k's feature mean B_k ~ N(0, beta^2) (0: one distribution).
    beta: float = attrs.field(default=1.0, validator=_heterogeneity)
    #: How many clients the population has (any number: each is made on demand).
    clients: int = attrs.field(default=1000, validator=positive)
    #: Input features.
    dim: int = attrs.field(default=60, validator=positive)
    #: Classes (labels 0..classes-1).
    classes: int = attrs.field(default=10, validator=positive)
    #: Seed of the population (every client's model, features and count); apart
    #: from [run] seed, which seeds the model's initialisation and the sampling.
    data_seed: int = attrs.field(default=0, validator=count_at_least(0))
    #: A client's examples: min(min_samples + floor(lognormal(3, 2)), max_samples), as LEAF draws them.
    min_samples: int = attrs.field(default=5, validator=positive)
    max_samples: int = attrs.field(default=1000, validator=positive)
    #: Share of each client's examples held out (its last rows; LEAF keeps 10%).
    test_fraction: float = attrs.field(default=0.1, validator=_probability)
    #: Hidden units of the MLP (0: multinomial logistic regression, FedProx's model).
    hidden: int = attrs.field(default=32, validator=non_negative)
    #: SGD learning rate, passes over a client's rows per fit, rows per step.
    lr: float = attrs.field(default=0.05, validator=positive)
    epochs: int = attrs.field(default=1, validator=positive)
    batch_size: int = attrs.field(default=32, validator=positive)
    #: The clients (0..eval_clients-1) whose rows train_data() and test_data() pool:
    #: what the coordinator evaluates on, and what local / data-parallel train on.
    eval_clients: int = attrs.field(default=20, validator=positive)
