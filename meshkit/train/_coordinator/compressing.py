"""A run's ``[compression]`` table checked against its strategy, privacy and secure
aggregation before anything starts: the :class:`~meshkit.compression.CompressionPlan` the
round engine and the workers use, or a refusal naming the trait.

Rule: the coordinator's side of choosing a run's compression lives here; what a
compressor composes with is decided by its traits (:mod:`meshkit.compression._plan`).
"""

from __future__ import annotations

from typing import Any

from meshkit.compression import CompressionPlan, check_compression
from meshkit.errors import RefusedError
from meshkit.secure_aggregation import SchemeChoice
from meshkit.train._traits import strategy_traits

__all__ = ["compression_plan"]


def compression_plan(plan: Any, strategy: Any, privacy: Any,
                     scheme: SchemeChoice | None = None) -> CompressionPlan | None:
    """The run's ``[compression]`` (None without the table), refused where it cannot compose
    (:mod:`meshkit.compression._plan` decides by the compressor's traits and, under
    ``[secure_aggregation]``, ``scheme``'s)."""
    cfg = plan.config
    if cfg.compression is None:
        return None
    traits = strategy_traits(strategy)
    if not traits.compressed:
        raise RefusedError(
            f"{cfg.path}: [compression] name = {cfg.compression.name!r} with [strategy] name = "
            f"{cfg.strategy.name!r}: only a strategy whose client fits go through the round "
            f"engine can upload them compressed, and {traits.lacks('compressed')}. Use a "
            f"strategy that declares it (federated), or remove the [compression] table")
    broadcast = bool(cfg.compression_broadcast)
    if broadcast and not traits.broadcast:
        raise RefusedError(
            f"{cfg.path}: [compression] broadcast = true with [strategy] name = "
            f"{cfg.strategy.name!r}: only a strategy that hands each worker the round's model "
            f"through the round engine's set_state can send it as a delta, and "
            f"{traits.lacks('broadcast')}. Drop broadcast (uploads are still compressed), "
            f"or use a strategy that declares it (federated)")
    chosen = CompressionPlan(cfg.compression.name, dict(cfg.compression.options),
                             plan.create("compression"), broadcast=broadcast,
                             clip_range=cfg.compression_clip_range,
                             residual=cfg.compression_residual)
    check_compression(chosen, where=str(cfg.path),
                      private_client_clip=privacy is not None and privacy.placement == "client",
                      secure=None if scheme is None else scheme.traits)
    return chosen
