"""A ``federated`` round under ``[privacy]``: sample, clip, noise once, account, or stop on budget.

Rules (docs/privacy.md):

* The cohort: with ``[strategy] sampling = "poisson"`` each client is in a
  round independently with probability q = ``fraction`` (from the run
  seed); the accountant composes the sampled Gaussian with that q. With
  ``sampling = "fixed"`` only ``fraction = 1`` is accepted (every client
  every round, accounted with q = 1, no amplification): a fixed-size cohort
  drawn without replacement is not the Poisson sampling the accountant's
  amplification assumes, and accounting it as such would understate ε.
* The denominator is the expected cohort m = q·N, fixed before the round:
  replies dropped (a lost worker, a round deadline) leave fewer updates in
  the sum and the noise as calibrated, which keeps the guarantee (a client
  that did not answer is a client that was not sampled, and ε only shrinks
  with q) and costs accuracy, never privacy.
* Every client counts once: the aggregator's weights are not used.
* ``target_epsilon``: before each round, the ε it would bring the run to is
  computed; if that exceeds the target the run stops there, cleanly (the
  last checkpoint is the previous round's), saying why.
* Each round's metrics carry ``epsilon`` (at the mechanism's δ), the clip
  norm used and the cohort size.
"""

from __future__ import annotations

from typing import Any, Mapping

from meshkit import ConfigError, RefusedError
from meshkit.train import Folded, RoundOutcome, StrategyContext, Work
from meshkit.train import client_seed, fold_round, once, poisson_clients

from meshkit_strategies._shared import require_served

__all__ = ["check_private", "check_budget", "play_private_round", "BudgetReached"]


class BudgetReached(Exception):
    """The next round would take ε past ``target_epsilon``: stop before it (not an error)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def check_private(opts: Any, privacy: Any, clients: int) -> None:
    """Refuse the federated options a private round cannot honour."""
    if opts.sampling == "fixed" and opts.fraction < 1.0:
        raise RefusedError(
            f"[privacy] with [strategy] sampling = \"fixed\" and fraction = {opts.fraction:g}: "
            f"a fixed-size cohort is not Poisson sampling, and meshkit's accountant would "
            f"understate ε for it. Use sampling = \"poisson\" (each client with probability "
            f"fraction), or fraction = 1 (every client every round, no amplification)")
    if opts.evaluate != "coordinator":
        raise RefusedError(
            f"[privacy] with [strategy] evaluate = {opts.evaluate!r}: each client's own "
            f"metrics would be published in metrics.jsonl with no noise, outside what ε "
            f"covers. Use evaluate = \"coordinator\" (the coordinator's held-out data)")
    if opts.sampling == "poisson" and opts.fraction * clients < 1.0:
        raise ConfigError(
            f"[strategy] fraction = {opts.fraction:g} of {clients} clients expects fewer than "
            f"one client per round; raise fraction or the number of clients")


def sampling_rate(opts: Any) -> float:
    """The q the accountant composes each round."""
    return opts.fraction if opts.sampling == "poisson" else 1.0


def check_budget(privacy: Any, q: float, rnd: int) -> float:
    """The ε round ``rnd`` brings the run to; :class:`BudgetReached` past ``target_epsilon``."""
    epsilon = float(privacy.epsilon_after(q))
    if privacy.target_epsilon and epsilon > privacy.target_epsilon:
        raise BudgetReached(
            f"privacy budget: round {rnd} would take epsilon to {epsilon:.4g} > target_epsilon "
            f"= {privacy.target_epsilon:g} (delta = {privacy.delta:g}); stopped after round "
            f"{rnd - 1} at epsilon {privacy.epsilon():.4g}")
    return epsilon


def play_private_round(opts: Any, ctx: StrategyContext, rnd: int, state: Mapping[str, Any],
                       clients: int, pinned: list[int] | None) -> RoundOutcome:
    """One DP-FedAvg round (module docstring); ``pinned[c]`` is client c's rank with local data."""
    privacy = ctx.privacy
    q = sampling_rate(opts)
    expected = q * clients
    epsilon = check_budget(privacy, q, rnd)
    sampled = (poisson_clients(ctx.seed, rnd, clients, q) if opts.sampling == "poisson"
               else list(range(clients)))
    clip = privacy.clip_norm
    extra: dict[str, Any] = {"time_budget": opts.time_budget} if opts.time_budget else {}
    if privacy.placement == "client":
        extra["clip_norm"] = clip
    work = [Work(c, {"op": "fit", "shard": c, "shards": clients,
                     "seed": client_seed(ctx.seed, rnd, c), **extra},
                 rank=None if pinned is None else pinned[c]) for c in sampled]
    fold = privacy.begin(state, expected=expected, seed=ctx.seed, round_=rnd)
    folded = (fold_round(ctx, work, state=state, weight=once, window=opts.window, fold=fold,
                         deadline=opts.round_timeout or None)
              if work else Folded(None, {}, {}, {}))
    require_served(rnd, folded, sampled, opts.min_clients, ctx.resume_advice())
    # The noise goes on even when no client answered: the release must not
    # reveal that.
    consensus = folded.result if folded.result is not None else fold.result()
    unclipped = None
    if privacy.placement == "client":
        # Each client's report is one bit; anything else (a hostile or broken
        # client's -1e9) counts as "not within" -- never more than one client.
        unclipped = sum(_one_bit(r.get("metrics", {}).get("unclipped", 0))
                        for r in folded.replies.values())
    privacy.finish(fold, q, unclipped=unclipped, seed=ctx.seed, round_=rnd)
    new_state = ctx.outer_step(state, consensus)  # parameters only: the kernel's rule
    metrics = dict(folded.train_loss())
    metrics.update(ctx.task.evaluate(new_state))
    metrics.update({"epsilon": epsilon, "clip_norm": clip, "cohort": float(len(sampled))})
    return folded.outcome(new_state, metrics)


def _one_bit(value: Any) -> int:
    """A client's ``unclipped`` report as the bit it must be: 1 only for exactly 1."""
    return 1 if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 1 \
        else 0
