"""Where each stage runs: :func:`place` (and :func:`place_training` for a training job).

Every placement rule (listed in :mod:`meshkit.pipeline`) is checked here,
before any job or activation moves, each refusal a
:class:`~meshkit.PlacementError` naming the stage and the ranks present.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import attrs

from meshkit.errors import PlacementError
from meshkit.node import NodeCaps
from meshkit.pipeline._stages import Stage

__all__ = ["Placement", "place", "place_training"]


@attrs.frozen
class Placement:
    """Which rank runs which stage, in pipeline order."""

    stages: tuple[Stage, ...]
    ranks: tuple[int, ...]

    def route(self, index: int) -> tuple[int, int]:
        """(prev, next) ranks of stage ``index``; 0 is the coordinator at both ends."""
        prev = self.ranks[index - 1] if index > 0 else 0
        nxt = self.ranks[index + 1] if index + 1 < len(self.ranks) else 0
        return prev, nxt

    def describe(self) -> str:
        return ", ".join(f"{s.describe()} -> rank {r}" for s, r in zip(self.stages, self.ranks))


def _caps_by_rank(caps: Iterable[NodeCaps]) -> dict[int, NodeCaps]:
    by_rank: dict[int, NodeCaps] = {}
    for c in caps:
        if c.rank in by_rank:
            raise PlacementError(f"two capability records claim rank {c.rank}")
        by_rank[c.rank] = c
    return by_rank


def _boards(by_rank: Mapping[int, NodeCaps]) -> str:
    boards = [f"rank {r} implements [{c.fixed_function.stage_id}]"
              for r, c in sorted(by_rank.items()) if c.fixed_function is not None]
    return "; ".join(boards) if boards else "no fixed-function rank joined"


def place(stages: Sequence[Stage], caps: Iterable[NodeCaps],
          ranks: Sequence[int] | None = None) -> Placement:
    """Assign each stage a rank whose caps accept it, or raise :class:`PlacementError`.

    One stage per rank. With ``ranks`` (one per stage) the assignment is
    checked instead of chosen.
    """
    stages = tuple(stages)
    if not stages:
        raise PlacementError("a pipeline needs at least one stage")
    by_rank = _caps_by_rank(caps)
    if ranks is not None:
        ranks = tuple(ranks)
        if len(ranks) != len(stages):
            raise PlacementError(
                f"ranks: got {len(ranks)} for {len(stages)} stages; give one rank per stage")
        if len(set(ranks)) != len(ranks):
            raise PlacementError(f"ranks: each rank runs one stage, got {list(ranks)}")
        for stage, rank in zip(stages, ranks):
            node = by_rank.get(rank)
            if node is None:
                raise PlacementError(
                    f"{stage.describe()} was placed on rank {rank}, which has not announced "
                    f"its capabilities (known ranks: {sorted(by_rank)})")
            node.check(stage)
            if stage.op is None and node.fixed_function is None:
                raise PlacementError(
                    f"{stage.describe()} was placed on rank {rank}, a worker: it runs only "
                    f"on a fixed-function rank implementing it ({_boards(by_rank)})")
        return Placement(stages, ranks)

    free = dict(sorted(by_rank.items()))
    chosen: list[int] = []
    for stage in stages:
        if stage.op is None:
            match = [r for r, c in free.items()
                     if c.fixed_function is not None and c.accepts(stage)]
            if not match:
                taken = [r for r in chosen if by_rank[r].accepts(stage)
                         and by_rank[r].fixed_function is not None]
                extra = (f"; rank(s) {taken} implementing it already run an earlier stage"
                         if taken else "")
                raise PlacementError(
                    f"no rank can run board stage [{stage.stage_id}]: no fixed-function "
                    f"rank implements it ({_boards(by_rank)}){extra}. Start a node with a "
                    f"board implementing [{stage.stage_id}], or give the stage an op a "
                    f"worker can run")
        else:
            match = [r for r, c in free.items() if c.fixed_function is None]
            if not match:
                raise PlacementError(
                    f"no free worker rank for {stage.describe()} (stage {len(chosen) + 1} of "
                    f"{len(stages)}): {len(by_rank)} rank(s) joined, fixed-function ranks "
                    f"run only their own stage; start more workers")
        chosen.append(match[0])
        del free[match[0]]
    return Placement(stages, tuple(chosen))


def place_training(caps: Iterable[NodeCaps], ranks: Sequence[int] | None = None) -> list[int]:
    """The ranks of a training job, refusing any that cannot train.

    Every rank in ``ranks`` (all announced ranks when None) must pass
    :meth:`NodeCaps.check_train`; the first that does not is a
    :class:`PlacementError` saying why. This runs before any spec is sent.
    """
    by_rank = _caps_by_rank(caps)
    chosen = sorted(by_rank) if ranks is None else list(ranks)
    for rank in chosen:
        node = by_rank.get(rank)
        if node is None:
            raise PlacementError(
                f"training job includes rank {rank}, which has not announced its "
                f"capabilities (known ranks: {sorted(by_rank)})")
        node.check_train()
    return chosen
