"""Built-in aggregators: how a round's contributions become one state.

``allreduce`` (element-wise mean, the gradient aggregator) and ``fedavg``
(mean weighted by realized work), plus the refusals ``fedprox``, ``fedyogi``
and ``parameter-server``, which raise :class:`meshkit.RefusedError` from
their factory (so ``meshkit check`` reports them before a run starts) while
``meshkit plugins`` still lists them.

Robust rules, one module each, each citing its paper and stating its
conventions: ``median``, ``trimmed-mean``, ``krum``, ``multi-krum``,
``bulyan``, ``geometric-median``, ``centered-clipping`` and ``norm-bound``
(docs/aggregators.md, "Robust aggregators").

This module only declares records and options classes; numpy loads when a
factory runs, so listing plugins stays fast.
"""

from __future__ import annotations

from typing import Any, Iterable

import attrs

import meshkit

from meshkit_aggregators.options import (
    BulyanOptions,
    CenteredClippingOptions,
    GeometricMedianOptions,
    KrumOptions,
    MultiKrumOptions,
    NormBoundOptions,
    TrimmedMeanOptions,
)

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


def _median() -> Any:
    from meshkit_aggregators.median import Median

    return Median()


def _trimmed_mean(options: TrimmedMeanOptions) -> Any:
    from meshkit_aggregators.trimmed_mean import TrimmedMean

    return TrimmedMean(beta=options.beta)


def _krum(options: KrumOptions) -> Any:
    from meshkit_aggregators.krum import Krum

    return Krum(f=options.f)


def _multi_krum(options: MultiKrumOptions) -> Any:
    from meshkit_aggregators.multi_krum import MultiKrum

    return MultiKrum(f=options.f, m=options.m)


def _bulyan(options: BulyanOptions) -> Any:
    from meshkit_aggregators.bulyan import Bulyan

    return Bulyan(f=options.f)


def _geometric_median(options: GeometricMedianOptions) -> Any:
    from meshkit_aggregators.geometric_median import GeometricMedian

    return GeometricMedian(eps=options.eps, max_iter=options.max_iter, nu=options.nu)


def _centered_clipping(options: CenteredClippingOptions) -> Any:
    from meshkit_aggregators.centered_clipping import CenteredClipping

    return CenteredClipping(tau=options.tau, iterations=options.iterations)


def _norm_bound(options: NormBoundOptions) -> Any:
    from meshkit_aggregators.norm_bound import NormBound

    return NormBound(max_norm=options.max_norm)


def _robust() -> list[meshkit.Component]:
    return [
        meshkit.Component("median", _median, also_known_as=("FedMedian",),
                          summary="coordinate-wise median (even count: mean of the two middle "
                                  "values); holds every contribution"),
        meshkit.Component("trimmed-mean", _trimmed_mean, TrimmedMeanOptions,
                          also_known_as=("FedTrimmedAvg",),
                          summary="coordinate-wise mean after cutting floor(beta*n) from each "
                                  "end (beta=0.2); holds every contribution"),
        meshkit.Component("krum", _krum, KrumOptions,
                          summary="the contribution nearest its n-f-2 neighbours (needs "
                                  "n >= 2f+3); holds every contribution"),
        meshkit.Component("multi-krum", _multi_krum, MultiKrumOptions,
                          also_known_as=("MultiKrum",),
                          summary="weighted mean of the m best Krum scores (m=0: n-f); holds "
                                  "every contribution"),
        meshkit.Component("bulyan", _bulyan, BulyanOptions,
                          summary="Krum selection then trimmed mean around the median (needs "
                                  "n >= 4f+3); holds every contribution"),
        meshkit.Component("geometric-median", _geometric_median, GeometricMedianOptions,
                          summary="RFA smoothed Weiszfeld geometric median, each "
                                  "contributor once; holds every contribution"),
        meshkit.Component("centered-clipping", _centered_clipping, CenteredClippingOptions,
                          summary="clipped steps around a centre carried across rounds "
                                  "(checkpointed); holds every contribution"),
        meshkit.Component("norm-bound", _norm_bound, NormBoundOptions,
                          summary="clip each update to max_norm, then the strict mean "
                                  "(streams)"),
    ]


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
        *_robust(),
    ]
