"""Options (the ``[strategy]`` keys) of the built-in strategies: attrs only."""

from __future__ import annotations

from typing import Any

import attrs

__all__ = [
    "LocalOptions",
    "DataParallelOptions",
    "FederatedOptions",
    "PartitionOptions",
    "BoardOptions",
    "ModelParallelOptions",
    "FedBuffOptions",
    "DiLoCoOptions",
]


#: ``[strategy] evaluate`` values of ``federated``.
EVALUATE = ("coordinator", "clients", "both")
#: ``[strategy] sampling`` values of ``federated``.
SAMPLING = ("fixed", "poisson")


def _on_nonfinite() -> Any:
    """An ``on_nonfinite`` key: a round whose new global model holds a NaN or an
    infinity stops the run (``"stop"``) or keeps the previous model (``"skip-round"``)."""
    return attrs.field(default="stop", validator=attrs.validators.in_(("stop", "skip-round")))


def _accept_failures() -> Any:
    """An ``accept_failures`` key (as Flower's): a member's failure (an error reply, a
    breach, a non-finite contribution, a stall) drops that member for the round (true),
    or stops the run (false: debugging a trusted cluster). docs/strategies.md."""
    return attrs.field(default=True, validator=attrs.validators.instance_of(bool))


def _at_least(low: int) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value < low:
            raise ValueError(f"{attribute.name} must be at least {low}, got {value}")
    return check


def _rounds(default: int) -> Any:
    """A ``rounds`` key: 0 is an evaluation-only run (the runner evaluates the
    model it would start from, as round 0, and starts no worker)."""
    return attrs.field(default=default, validator=_at_least(0))


def _seconds(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not 0.0 <= value < 1e9:
        raise ValueError(f"{attribute.name} must be a number of seconds >= 0 (0: none), "
                         f"got {value}")


def _device() -> Any:
    """A ``device`` key: training is placed only on ranks that advertise it
    (``cuda`` matches any ``cuda:N``); "" places anywhere."""
    return attrs.field(default="", validator=attrs.validators.instance_of(str))


def _fraction(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{attribute.name} must be in (0, 1], got {value}")


@attrs.frozen
class LocalOptions:
    rounds: int = _rounds(5)
    on_nonfinite: str = _on_nonfinite()


@attrs.frozen
class DataParallelOptions:
    rounds: int = _rounds(5)
    #: Synchronous steps per round (one aggregated gradient each).
    steps: int = attrs.field(default=20, validator=_at_least(1))
    #: Examples per replica per step (0: the replica's whole shard).
    batch_size: int = attrs.field(default=32, validator=_at_least(0))
    #: Fewest replicas a step may complete with after workers are dropped.
    min_workers: int = attrs.field(default=1, validator=_at_least(1))
    #: Whole gradients the coordinator holds at once while folding a step
    #: (the round engine's window; meshkit.train.DEFAULT_WINDOW).
    window: int = attrs.field(default=1, validator=_at_least(1))
    #: Train only on ranks that advertise this device ("" = any).
    device: str = _device()
    #: What a round whose new global model is not finite does: "stop" or "skip-round".
    on_nonfinite: str = _on_nonfinite()
    #: A member's failure drops that member for the round (true) or stops the run.
    accept_failures: bool = _accept_failures()


@attrs.frozen
class FederatedOptions:
    rounds: int = _rounds(5)
    #: How many clients (data shards); 0 means one per worker.
    clients: int = attrs.field(default=0, validator=_at_least(0))
    #: A round needs answers from at least this many clients, or the run stops.
    min_clients: int = attrs.field(default=1, validator=_at_least(1))
    #: Share of the clients sampled each round (seeded, so reproducible).
    fraction: float = attrs.field(default=1.0, validator=_fraction)
    #: Whole client models the coordinator holds at once while folding a round
    #: (the round engine's window; meshkit.train.DEFAULT_WINDOW).
    window: int = attrs.field(default=1, validator=_at_least(1))
    #: Who evaluates each round's new global model: the coordinator (on its
    #: task's held-out data), the sampled clients (each on its own), or both.
    evaluate: str = attrs.field(default="coordinator", validator=attrs.validators.in_(
        EVALUATE))
    #: Train only on ranks that advertise this device ("" = any).
    device: str = _device()
    #: Seconds each client fit may take (0: none): a client stops when it runs
    #: out and reports the examples it processed, which fedavg weighs by.
    time_budget: float = attrs.field(default=0.0, validator=_seconds)
    #: Seconds a round waits for client answers (0: no deadline): a later
    #: answer is dropped for that round (recorded late), its worker serves on.
    round_timeout: float = attrs.field(default=0.0, validator=_seconds)
    #: What a round whose new global model is not finite does: "stop" or "skip-round".
    on_nonfinite: str = _on_nonfinite()
    #: A member's failure drops that member for the round (true) or stops the run.
    accept_failures: bool = _accept_failures()
    #: State keys each client keeps for itself, never aggregated (FedBN): glob
    #: patterns, or a task's key group such as meshkit.torch's "@norm".
    local_keys: list[str] = attrs.field(factory=list, validator=attrs.validators.deep_iterable(
        attrs.validators.instance_of(str), attrs.validators.instance_of(list)))
    #: The only state keys that train, travel and are aggregated (glob patterns,
    #: or a task's key group such as meshkit.torch's "@lora"); empty: every key.
    #: The rest stays frozen on the workers after the first round.
    trainable: list[str] = attrs.field(factory=list, validator=attrs.validators.deep_iterable(
        attrs.validators.instance_of(str), attrs.validators.instance_of(list)))
    #: How a round's clients are drawn: "fixed" (ceil(fraction * clients) of
    #: them) or "poisson" (each independently with probability fraction, from
    #: the run seed: what a privacy accountant's amplification assumes).
    sampling: str = attrs.field(default="fixed", validator=attrs.validators.in_(SAMPLING))


@attrs.frozen
class PartitionOptions:
    """One ``[[strategy.partitions]]`` table: the nodes and where they run."""

    nodes: list[str]
    #: Pin to this worker rank ...
    rank: int | None = None
    #: ... or to the worker advertising this tag.
    tag: str | None = None

    def __attrs_post_init__(self) -> None:
        if (self.rank is None) == (self.tag is None):
            raise ValueError(
                f"partition {self.nodes}: give exactly one of rank = N or tag = \"...\"")


@attrs.frozen
class BoardOptions:
    """One ``[[strategy.boards]]`` table: a fixed-function rank a local launch starts.

    It joins as ``meshkit node --board BOARD --board-option K=V ...``; pin a
    partition to it with ``tag = STAGE_ID`` (its ``stage_id`` option).
    """

    options: dict[str, Any]
    board: str = "loopback"


@attrs.frozen
class ModelParallelOptions:
    partitions: list[PartitionOptions] = attrs.Factory(list)
    #: Fixed-function ranks to start alongside the workers (launch = "local").
    boards: list[BoardOptions] = attrs.Factory(list)
    #: Passes of the held-out set through the pipeline.
    rounds: int = _rounds(1)
    #: Rows per activation sent between stages.
    batch_size: int = attrs.field(default=128, validator=_at_least(1))
    #: A checkpoint file or run directory whose model to serve ("" = the initial model).
    state_from: str = ""


#: ``[strategy] staleness`` rules of ``fedbuff`` (meshkit_strategies.fedbuff).
STALENESS = ("sqrt", "poly", "hinge", "constant")


def _optional_at_least(low: float) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and not value >= low:
            raise ValueError(f"{attribute.name} must be at least {low:g}, got {value}")
    return check


@attrs.frozen
class FedBuffOptions:
    """``[strategy]`` keys of ``fedbuff`` (docs/strategies.md, "fedbuff")."""

    #: Server steps (one outer-optimizer step per ``buffer_size`` updates).
    rounds: int = _rounds(5)
    #: How many clients (data shards); 0 means one per worker.
    clients: int = attrs.field(default=0, validator=_at_least(0))
    #: K: updates folded into the buffer before each server step (1: FedAsync).
    buffer_size: int = attrs.field(default=10, validator=_at_least(1))
    #: Clients training at once, each on the model version it was sent.
    concurrency: int = attrs.field(default=20, validator=_at_least(1))
    #: How an update's weight falls with its staleness τ: "sqrt" 1/sqrt(1+τ),
    #: "poly" (1+τ)^-a, "hinge" 1 up to b then 1/(a(τ-b)+1), "constant" 1.
    staleness: str = attrs.field(default="sqrt", validator=attrs.validators.in_(STALENESS))
    #: a of "poly" (default 0.5) and "hinge" (default 10).
    staleness_a: float | None = attrs.field(default=None, validator=_optional_at_least(0.0))
    #: b of "hinge" (default 4): the staleness up to which an update counts fully.
    staleness_b: float | None = attrs.field(default=None, validator=_optional_at_least(0.0))
    #: Updates staler than this are dropped (recorded in the step's not_served); unset: none.
    max_staleness: int | None = attrs.field(default=None, validator=_optional_at_least(0))
    #: Who evaluates each new global model: only "coordinator" (others are refused).
    evaluate: str = attrs.field(default="coordinator", validator=attrs.validators.in_(
        EVALUATE))
    #: Train only on ranks that advertise this device ("" = any).
    device: str = _device()
    #: Seconds each client fit may take (0: none); fedavg weighs by the examples done.
    time_budget: float = attrs.field(default=0.0, validator=_seconds)
    #: What a step whose new global model is not finite does: "stop" or "skip-round".
    on_nonfinite: str = _on_nonfinite()
    #: A member's failure drops that member for the round (true) or stops the run.
    accept_failures: bool = _accept_failures()


#: ``[strategy] outer_bits`` values of ``diloco``: float32, or blockwise int8 / int4 codes.
OUTER_BITS = (32, 8, 4)


@attrs.frozen
class DiLoCoOptions:
    """``[strategy]`` keys of ``diloco`` (docs/strategies.md, "diloco")."""

    #: Outer steps (one round each: H inner steps per replica, then the outer step).
    rounds: int = _rounds(5)
    #: H: inner optimizer steps each replica runs between two outer steps.
    inner_steps: int = attrs.field(default=100, validator=_at_least(1))
    #: F: the model's float arrays cut into F fragments, one synced every H/F inner
    #: steps, its exchange overlapping the next H/F (Streaming DiLoCo); 1: plain DiLoCo.
    fragments: int = attrs.field(default=1, validator=_at_least(1))
    #: Width of the pseudo-gradients and outer updates on the wire: 32 (float32), 8 or 4.
    outer_bits: int = attrs.field(default=32, validator=attrs.validators.in_(OUTER_BITS))
    #: Fewest replicas whose pseudo-gradients an exchange needs, or the run stops.
    quorum: int = attrs.field(default=1, validator=_at_least(1))
    #: Where an exchange's pseudo-gradients are summed: "star" (the coordinator folds
    #: them and sends the outer update back) or "ring" (the replicas sum their codes
    #: exactly over the mesh ring and each steps the outer optimizer itself; needs
    #: ``[mesh] topology = "mesh"`` and outer_bits 8 or 4).
    exchange: str = attrs.field(default="star", validator=attrs.validators.in_(("star", "ring")))
    #: Rows of a replica's shard per inner step (0: the whole shard).
    batch_size: int = attrs.field(default=32, validator=_at_least(0))
    #: Seconds an ``inner`` request (H/F inner steps) may take before its replica is
    #: declared stalled (0: no limit).
    inner_timeout: float = attrs.field(default=600.0, validator=_seconds)
    #: Train only on ranks that advertise this device ("" = any).
    device: str = _device()
    #: A member's failure drops that member for the exchange (true) or stops the run.
    accept_failures: bool = _accept_failures()
