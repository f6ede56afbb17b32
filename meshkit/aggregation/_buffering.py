"""The buffering fold: how an aggregator without ``begin()`` still folds, at O(contributors x model).

:func:`begin` gives a fold for *any* aggregator: the aggregator's own when it
has ``begin()``, else a :class:`BufferingFold` that keeps the contributions
and calls ``aggregate`` at ``result()``. :func:`streaming` gives the same
choice as an aggregator with ``begin()``, for code that takes a streaming
aggregator.

An aggregator that declares ``uses_reference`` is given the round's
reference (:mod:`meshkit.aggregation._contract`) by both: ``begin(agg,
reference=ref)`` passes it to the aggregator's own ``begin`` or to the
``aggregate`` call a buffering fold makes.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from meshkit.aggregation._contract import Fold, check_weight, default_source, uses_reference
from meshkit.errors import AggregationError
from meshkit.state import State

# A default label (see default_source), not followed by more digits.
_CONTRIBUTOR = re.compile(r"\bcontributor #(\d+)(?!\d)")


def streaming(aggregator: Any) -> Any:
    """``aggregator`` with a ``begin()``: its own, or one that buffers (:class:`BufferingFold`)."""
    if callable(getattr(aggregator, "begin", None)):
        return aggregator
    if not callable(getattr(aggregator, "aggregate", None)):
        raise TypeError(f"{aggregator!r} is not an aggregator: it has neither aggregate() "
                        f"nor begin()")
    return _Buffered(aggregator)


def begin(aggregator: Any, *, reference: State | None = None) -> Fold:
    """A fold for ``aggregator``: its own streaming fold, or a buffering adapter.

    ``reference`` (the round's global state) reaches an aggregator that
    declares ``uses_reference``; others never see it.
    """
    if uses_reference(aggregator):
        if callable(getattr(aggregator, "begin", None)):
            fold: Fold = aggregator.begin(reference=reference)
            return fold
        return BufferingFold(aggregator, reference=reference)
    return streaming(aggregator).begin()


def holds_every_contribution(aggregator: Any) -> bool:
    """Whether a round of ``aggregator`` keeps every contribution (no streaming ``begin()``).

    Such a round holds O(contributors x model) on the coordinator; a
    streaming one O(model).
    """
    return not callable(getattr(aggregator, "begin", None))


class _Buffered:
    """An aggregator without ``begin()``, given one that buffers the round."""

    def __init__(self, aggregator: Any) -> None:
        self.aggregator = aggregator
        self.name = _name_of(aggregator)

    def begin(self) -> BufferingFold:
        return BufferingFold(self.aggregator)

    def aggregate(self, states: Sequence[State],
                  weights: Sequence[float] | None = None) -> dict[str, Any]:
        return dict(self.aggregator.aggregate(states, weights))

    def __repr__(self) -> str:
        return f"streaming({self.aggregator!r})"


class BufferingFold:
    """The kernel's fold for an aggregator without ``begin()``.

    Keeps every contribution (O(contributors x model) memory) and hands them
    to ``aggregate(states, weights)`` at :meth:`result`. Contributions are
    held by reference: do not mutate a state after adding it.
    """

    def __init__(self, aggregator: Any, *, reference: State | None = None) -> None:
        self._aggregator = aggregator
        self._reference = reference
        self._states: list[State] = []
        self._weights: list[float] = []
        self.sources: list[str] = []
        self._done = False

    def add(self, state: State, weight: float = 1.0, *, source: str | None = None) -> None:
        if self._done:
            raise AggregationError("this fold already produced its result; begin a new one")
        label = source or default_source(len(self._states))
        self._weights.append(check_weight(weight, label, name=_name_of(self._aggregator)))
        self._states.append(state)
        self.sources.append(label)

    def result(self) -> dict[str, Any]:
        if self._done:
            raise AggregationError("this fold already produced its result; begin a new one")
        self._done = True
        states, weights = self._states, self._weights
        self._states, self._weights = [], []
        try:
            if uses_reference(self._aggregator):
                return dict(self._aggregator.aggregate(states, weights,
                                                       reference=self._reference))
            return dict(self._aggregator.aggregate(states, weights))
        except AggregationError as exc:
            raise self._relabel(exc) from exc

    def _relabel(self, exc: AggregationError) -> AggregationError:
        """``exc`` with ``contributor #i`` replaced by the i-th ``source``.

        ``aggregate`` only sees a list, so it can only name positions; the
        user needs the labels the caller gave to ``add`` ("rank 3").
        """
        sources = self.sources

        def label(i: str) -> str:
            index = int(i)
            return sources[index] if index < len(sources) else default_source(index)

        def swap(match: re.Match[str]) -> str:
            return label(match.group(1))

        message = _CONTRIBUTOR.sub(swap, str(exc))
        if message == str(exc):
            return exc
        error = AggregationError(message)
        for attr in ("key", "contributors"):
            if hasattr(exc, attr):
                value = getattr(exc, attr)
                if attr == "contributors" and isinstance(value, list):
                    value = [_CONTRIBUTOR.sub(swap, c) if isinstance(c, str) else c
                             for c in value]
                setattr(error, attr, value)
        return error


def _name_of(aggregator: Any) -> str:
    return getattr(aggregator, "name", None) or type(aggregator).__name__
