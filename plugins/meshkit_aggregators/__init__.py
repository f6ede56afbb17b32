"""Built-in aggregators: how a round's contributions become one state.

``allreduce`` (element-wise mean, the gradient aggregator) and ``fedavg``
(mean weighted by realized work), plus the refusals ``fedprox``, ``fedyogi``
and ``parameter-server``, which raise :class:`meshkit.RefusedError` from
their factory (so ``meshkit check`` reports them before a run starts) while
``meshkit plugins`` still lists them.

This module only declares records and options classes; numpy loads when a
factory runs, so listing plugins stays fast.
"""

from __future__ import annotations

from typing import Any, Iterable

import attrs

import meshkit

_ACCUMULATE = ("auto", "float64")


def _check_accumulate(instance: Any, attribute: Any, value: str) -> None:
    if value not in _ACCUMULATE:
        raise ValueError(f"accumulate must be one of {', '.join(map(repr, _ACCUMULATE))}, "
                         f"got {value!r}")


def _check_retain(instance: Any, attribute: Any, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"retain must be an integer >= 0, got {value!r}")


def _check_threads(instance: Any, attribute: Any, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
        raise ValueError(f"threads must be an integer from 1 to 64, got {value!r}")


@attrs.frozen
class MeanOptions:
    """Options of ``allreduce`` and ``fedavg`` (the ``[aggregator]`` config keys)."""

    #: Let NaN/inf through instead of refusing the contribution that has them.
    allow_nonfinite: bool = False
    #: "auto": float16/bfloat16/float32 sum in float32, float64 in float64;
    #: "float64": every float array sums in float64 (2x accumulator memory).
    accumulate: str = attrs.field(default="auto", validator=_check_accumulate)
    #: Contributions the streaming fold may hold (by reference) to fold them
    #: together with the next one: memory is the accumulator plus ``retain``
    #: model copies; the accumulator is read and written once per
    #: ``retain + 1`` contributions. 0 folds each contribution at once.
    retain: int = attrs.field(default=1, validator=_check_retain)
    #: Threads a fold of a million or more float elements is split across
    #: (contiguous shares, bit-identical to one thread); 1 keeps it on the
    #: calling thread.
    threads: int = attrs.field(default=2, validator=_check_threads)


#: What each refusal says: what it would need, and what works instead.
REFUSALS: dict[str, str] = {
    "fedprox": (
        "the fedprox aggregator is refused: FedProx needs the previous global model "
        "on every client to compute its proximal term mu/2 * ||w - w_global||^2 "
        "during local training, a client-side concern an aggregator never sees; "
        "aggregating the results is plain weighted averaging. Use aggregator "
        "\"fedavg\" (with the task's proximal option, if it has one)"),
    "fedyogi": (
        "the fedyogi aggregator is refused: FedYogi needs the optimizer moments "
        "carried between rounds (a server optimizer's state), and an aggregator is "
        "stateless; a plain mean under its name would be FedAvg wearing FedYogi's "
        "name. Use aggregator \"fedavg\" with [outer_optimizer] name = \"fedyogi\""),
    "parameter-server": (
        "the parameter-server aggregator is refused: a parameter server applies "
        "updates asynchronously to parameters it owns, which is not an element-wise "
        "reduce of one round's contributions. Use aggregator \"allreduce\" "
        "(synchronous data-parallel mean) or \"fedavg\""),
}


def _allreduce(options: MeanOptions) -> Any:
    from meshkit_aggregators.builtin import AllReduce

    return AllReduce(allow_nonfinite=options.allow_nonfinite,
                     wide=options.accumulate == "float64", retain=options.retain,
                     threads=options.threads)


def _fedavg(options: MeanOptions) -> Any:
    from meshkit_aggregators.builtin import FedAvg

    return FedAvg(allow_nonfinite=options.allow_nonfinite,
                  wide=options.accumulate == "float64", retain=options.retain,
                     threads=options.threads)


def _refusal(name: str) -> Any:
    def factory() -> Any:
        raise meshkit.RefusedError(REFUSALS[name])

    factory.__name__ = f"refuse_{name.replace('-', '_')}"
    return factory


@meshkit.hookimpl
def meshkit_aggregators() -> Iterable[meshkit.Component]:
    return [
        meshkit.Component(
            "allreduce", _allreduce, MeanOptions,
            summary="element-wise mean, every contributor counts once (the gradient "
                    "aggregator)"),
        meshkit.Component(
            "fedavg", _fedavg, MeanOptions,
            summary="mean weighted by realized work (examples seen), divided once by "
                    "the accepted mass"),
        meshkit.Component(
            "fedprox", _refusal("fedprox"),
            summary="refusal: needs the previous global model on the client; use fedavg"),
        meshkit.Component(
            "fedyogi", _refusal("fedyogi"),
            summary="refusal: needs moments carried between rounds; use the fedyogi "
                    "outer optimizer"),
        meshkit.Component(
            "parameter-server", _refusal("parameter-server"),
            summary="refusal: not an element-wise reduce; use allreduce or fedavg"),
    ]
