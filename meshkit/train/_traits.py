"""What a strategy declares it is: :class:`StrategyTraits`, everything the kernel reads of a strategy.

Rule: the kernel reads a strategy's ``run(ctx)`` and its ``traits``, and
nothing else -- no attribute probed with a default, no option key read off
its options object, no strategy named (DESIGN §10). A third-party strategy
that declares no ``traits`` gets the safe reading, :data:`UNDECLARED`: it
has no clients, plays no private, secure, clocked or collective round, so
each of those tables is refused for it naming the trait it lacks, and it
runs with the defaults below.

A built-in declares its traits as a property, from its options::

    @property
    def traits(self) -> meshkit.StrategyTraits:
        return meshkit.StrategyTraits(partitioned=True, rounds=self.options.rounds, ...)
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import attrs

__all__ = ["StrategyTraits", "strategy_traits", "UNDECLARED_STRATEGY"]


def _flag(_: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"StrategyTraits.{attribute.name} must be True or False, got "
                        f"{value!r} ({type(value).__name__})")


def _optional_callable(_: Any, attribute: Any, value: Any) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"StrategyTraits.{attribute.name} must be a callable or None, got "
                        f"{value!r}")


def _tuple_of_str(value: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in value)


def _reasons(value: Mapping[str, str]) -> dict[str, str]:
    return {str(k): str(v) for k, v in value.items()}


def _extra_ranks(value: Any) -> tuple[tuple[str, dict[str, Any]], ...]:
    return tuple((str(stage), dict(options)) for stage, options in value)


@attrs.frozen(kw_only=True)
class StrategyTraits:
    """The declared properties of a strategy (frozen; the kernel's only reading of one).

    What it plays (each refused, naming the trait, for a strategy that lacks it):

    * ``partitioned``: splits the training set into clients (``[partitioner]``,
      ``[attack]``, the clients ``meshkit check`` prints);
    * ``private``: plays ``[privacy]`` rounds (clip, noise, account);
    * ``secure``: plays ``[secure_aggregation]`` rounds (only the cohort's sum);
    * ``clocked``: orders arrivals by the virtual clock (``[simulation]``);
    * ``collective``: plays torchrun's spmd rounds (every rank folds its slice of
      the cohort through :func:`meshkit.train.fold_round`; one sum a round);
    * ``compressed``: its clients' fits go through :func:`meshkit.train.fold_round`,
      which compresses what they upload (``[compression]``);
    * ``broadcast``: it hands each worker the round's model through
      :func:`meshkit.train.fold_round`'s ``send_state``, so ``[compression] broadcast``
      can send it as a compressed delta (:mod:`meshkit.train._broadcast`).

    What its options say that the kernel reads (``[strategy]`` keys):

    * ``rounds``: rounds to run (None: the strategy has no rounds option;
      0: evaluate the initial model only);
    * ``clients``: clients as configured (0: not set);
    * ``evaluate``: ``"coordinator"``, ``"clients"`` or ``"both"``;
    * ``local_keys``: FedBN's glob patterns kept per client;
    * ``trainable``: the glob patterns (or ``"@group"``) of the only keys that travel
      and are aggregated (empty: every key); a secure round refuses them;
    * ``round_timeout``: seconds (0: no deadline);
    * ``device``: the coordinator's device for the task ("": default);
    * ``accept_failures``: the strategy's ``[strategy] accept_failures`` (a member's
      failure costs that member, ``meshkit.train._failures``), ``None`` when it has no
      such key; ``meshkit check`` states what a failure costs from it;
    * ``sampling``, ``fraction``, ``min_clients``: how a round's cohort is drawn
      (``"fixed"``: ``max(min_clients, ceil(fraction * clients))`` clients;
      ``"poisson"``: each client with probability ``fraction``, so a round may
      draw every client); ``meshkit check`` sizes a secure round's cohort from them.

    What it computes for the kernel (None: it has none):

    * ``count_clients(workers, partitioner[, task])``: how many clients a run
      has (``task`` only for a population; None: one per worker);
    * ``sampling_rate(clients)``: a private round's Poisson rate q;
    * ``cohort(clients)``: the clients one round (or server step) folds, out
      of the run's ``clients`` -- what an aggregator that holds every
      contribution holds at once (``meshkit check``'s aggregation line; the
      expected count under Poisson sampling). None: every client, every round;
    * ``check(task=, outer_name=, workers=, ...)``: the strategy's own start-up
      refusals (a ``ConfigError`` or ``RefusedError``); it may also take
      ``partitioner``, ``privacy``, ``speeds``, ``aggregator`` (the built
      aggregator, whose ``traits`` it reads), ``attack`` (the run's
      :class:`meshkit.train.AttackPlan`) and ``compression`` (the run's
      :class:`meshkit.compression.CompressionPlan`, or None) by naming them;
    * ``extra_ranks``: ``(stage_id, board options)`` for each fixed-function
      rank the run needs beyond ``[mesh] workers``;
    * ``loaded_state()``: the model an evaluation-only run evaluates instead
      of the task's initial one (None: the initial one).

    ``why_not`` maps a trait the strategy lacks (``"private"``, ``"secure"``,
    ...) to its own reason, which the kernel's refusal quotes.
    """

    partitioned: bool = attrs.field(default=False, validator=_flag)
    private: bool = attrs.field(default=False, validator=_flag)
    secure: bool = attrs.field(default=False, validator=_flag)
    clocked: bool = attrs.field(default=False, validator=_flag)
    compressed: bool = attrs.field(default=False, validator=_flag)
    broadcast: bool = attrs.field(default=False, validator=_flag)
    collective: bool = attrs.field(default=False, validator=_flag)
    rounds: int | None = None
    clients: int = 0
    evaluate: str = "coordinator"
    local_keys: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_str)
    trainable: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_str)
    round_timeout: float = 0.0
    device: str = ""
    accept_failures: bool | None = None
    sampling: str = attrs.field(default="fixed", validator=attrs.validators.in_(
        ("fixed", "poisson")))
    fraction: float = attrs.field(default=1.0, converter=float,
                                  validator=[attrs.validators.gt(0.0), attrs.validators.le(1.0)])
    min_clients: int = attrs.field(default=1, validator=[attrs.validators.instance_of(int),
                                                         attrs.validators.ge(1)])
    count_clients: Callable[..., int] | None = attrs.field(
        default=None, validator=_optional_callable, eq=False, repr=False)
    sampling_rate: Callable[[int], float] | None = attrs.field(
        default=None, validator=_optional_callable, eq=False, repr=False)
    cohort: Callable[[int], int] | None = attrs.field(
        default=None, validator=_optional_callable, eq=False, repr=False)
    check: Callable[..., None] | None = attrs.field(
        default=None, validator=_optional_callable, eq=False, repr=False)
    extra_ranks: tuple[tuple[str, dict[str, Any]], ...] = attrs.field(
        default=(), converter=_extra_ranks, eq=False, repr=False)
    loaded_state: Callable[[], Mapping[str, Any] | None] | None = attrs.field(
        default=None, validator=_optional_callable, eq=False, repr=False)
    why_not: Mapping[str, str] = attrs.field(factory=dict, converter=_reasons, eq=False,
                                           repr=False)

    def lacks(self, trait: str) -> str:
        """Words for a refusal: ``lacks the trait StrategyTraits.<trait>``, and the
        strategy's own reason when it gives one (``why_not``)."""
        why = self.why_not.get(trait)
        return (f"it lacks the trait StrategyTraits.{trait}"
                + (f" ({why})" if why else ""))


#: What a strategy that declares no ``traits`` is taken to be.
UNDECLARED_STRATEGY = StrategyTraits()


def strategy_traits(strategy: Any) -> StrategyTraits:
    """``strategy.traits``, or the safe reading :data:`UNDECLARED_STRATEGY` when it declares none.

    A value that is not a :class:`StrategyTraits` is a mistake its author must see.
    """
    traits = getattr(strategy, "traits", UNDECLARED_STRATEGY)
    if not isinstance(traits, StrategyTraits):
        raise TypeError(f"{type(strategy).__name__}.traits is {traits!r}; declare it as "
                        f"meshkit.StrategyTraits(...)")
    return traits
