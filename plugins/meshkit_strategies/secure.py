"""A ``federated`` round under ``[secure_aggregation]``: the coordinator learns the sum only.

Rules (docs/secure-aggregation.md, "Composition"):

* The cohort is sampled as a plain round samples it (``fraction``,
  ``sampling``); under ``[privacy]`` as a private round does (Poisson with
  probability q, or everyone), with the same budget check first.
* The round is :func:`meshkit.train.secure_sum` with the run's scheme
  (``[secure_aggregation] name``): the clients' updates (fitted minus
  global) are quantised by the scheme (SecAgg+: clipped coordinate-wise to
  ``clip_range``), masked and summed; the coordinator unmasks only the sum.
* Every client in the sum counts once (the aggregator's example weights
  would need each client's count in clear); the new model is the global
  plus the mean update, stepped by the outer optimizer as usual.
* Under ``[privacy]`` (``dp-fixed``, ``clip = "client"``) the clients clip
  their updates to the L2 norm S before quantising; the coordinator adds
  the Gaussian to the unmasked sum and divides by the expected cohort m, as
  a private round does.
* Under ``[privacy] placement = "distributed"`` the clients add the noise:
  once the round's field is planned, the mechanism sets the Skellam grid
  and each client's share of the noise (the budget is checked then, as if
  every sampled client survives); the clients noise their own updates
  before masking, the coordinator divides the unmasked (already noised) sum
  by m, and the round is accounted with the noise its contributors added.
  Its metrics carry ``epsilon`` (after the round, as accounted),
  ``round_epsilon`` (that round alone), ``noise_std`` and
  ``noise_multiplier_realized`` (lower when clients dropped).
* No per-client figure is reported: a secure round's metrics have no
  ``train_loss`` and its rows no examples per client.
"""

from __future__ import annotations

from typing import Any, Mapping

from meshkit import RefusedError
from meshkit.train import Folded, RoundOutcome, StrategyContext
from meshkit.train import client_seed, poisson_clients, sample_clients, secure_sum

from meshkit_strategies._shared import require_served
from meshkit_strategies.private import check_budget, sampling_rate

__all__ = ["play_secure_round"]


def play_secure_round(opts: Any, ctx: StrategyContext, rnd: int, state: Mapping[str, Any],
                      clients: int, pinned: list[int] | None) -> RoundOutcome:
    """One secure round (module docstring); ``pinned[c]`` is client c's rank with local data."""
    privacy = ctx.privacy
    q = sampling_rate(opts)
    distributed = getattr(privacy, "noise_placement", "central") == "distributed"
    epsilon = 0.0
    if privacy is not None:
        if not distributed:  # a distributed round checks once its grid is planned
            epsilon = check_budget(privacy, q, rnd)
        sampled = (poisson_clients(ctx.seed, rnd, clients, q) if opts.sampling == "poisson"
                   else list(range(clients)))
    else:
        sampled = (poisson_clients(ctx.seed, rnd, clients, opts.fraction)
                   if opts.sampling == "poisson"
                   else sample_clients(ctx.rng, clients, opts.fraction, opts.min_clients))
    fit: dict[str, Any] = {"time_budget": opts.time_budget} if opts.time_budget else {}
    if privacy is not None:
        fit["clip_norm"] = privacy.clip_norm
    noise: dict[str, Any] = {}
    if distributed:
        def plan(params: Any, length: int) -> Any:
            # The grid for every client, not this cohort: it must not tell who was sampled.
            grid = privacy.plan_round(cohort=params.clients, length=length,
                                      bits=params.modulus_bits, population=clients)
            check_budget(privacy, q, rnd)
            return grid

        noise = {"noise": plan, "noise_source": privacy.noise}
    try:
        revealed = secure_sum(ctx, sampled, state=state, scheme=ctx.secure_aggregation, rnd=rnd,
                              shards=clients, seeds={c: client_seed(ctx.seed, rnd, c)
                                                     for c in sampled}, fit=fit,
                              pinned=None if pinned is None else {c: pinned[c]
                                                                  for c in sampled},
                              accept_failures=opts.accept_failures, **noise)
    except RefusedError as exc:
        # Too few clients left to unmask without weakening the guarantee: the round has no
        # result, and is never passed off as the sum of fewer clients.
        why = str(exc).removeprefix("[secure_aggregation]: ")
        raise RefusedError(
            f"round {rnd}: [secure_aggregation]: {why}. Sample more clients, keep more "
            f"workers alive, or lower threshold. {ctx.resume_advice()}") from None
    folded = Folded(None, dict(revealed.served), dict(revealed.not_served),
                    {c: {"examples": 0, "metrics": {}} for c in revealed.served})
    require_served(rnd, folded, sampled, opts.min_clients, ctx.resume_advice())
    metrics: dict[str, float] = {"cohort": float(len(sampled)),
                                 "secure_sum_of": float(len(revealed.contributors))}
    if privacy is None:
        consensus = revealed.mean(state)
    elif distributed:
        consensus = privacy.release(state, revealed.sum, q * clients)
        metrics.update(privacy.finish_round(q, len(revealed.contributors)))
        metrics["clip_norm"] = privacy.clip_norm
    else:
        fold = privacy.begin(state, expected=q * clients, seed=ctx.seed, round_=rnd)
        fold.add_total(revealed.sum, len(revealed.contributors))
        consensus = fold.result()
        privacy.finish(fold, q, seed=ctx.seed, round_=rnd)
        metrics.update({"epsilon": epsilon, "clip_norm": privacy.clip_norm})
    new_state = ctx.outer_step(state, consensus)  # parameters only: the kernel's rule
    metrics.update(ctx.task.evaluate(new_state))
    return folded.outcome(new_state, metrics)
