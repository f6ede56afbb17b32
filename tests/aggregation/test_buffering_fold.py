"""The buffering fold: a plain aggregator (aggregate() only) still folds, labels and all."""

from __future__ import annotations

import numpy as np
import pytest

import meshkit_aggregators
from meshkit.aggregation import (
    BufferingFold,
    MeanFold,
    StreamingAggregator,
    begin,
    check_contributions,
    streaming,
)
from meshkit.errors import AggregationError
from meshkit.plugins import build_manager


def fedavg():
    return build_manager([meshkit_aggregators], entry_points=False).create("aggregator", "fedavg")


def f64(*values):
    return np.array(values, dtype=np.float64)


class Median:
    """A third-party aggregator with only ``aggregate``."""

    def __init__(self):
        self.calls = []

    def aggregate(self, states, weights=None):
        self.calls.append(list(weights) if weights is not None else None)
        return {k: np.median([s[k] for s in states], axis=0) for k in states[0]}


def test_a_plain_aggregator_is_buffered_by_the_kernel():
    median = Median()
    fold = begin(median)
    assert isinstance(fold, BufferingFold)
    for i, v in enumerate([1.0, 7.0, 3.0]):
        fold.add({"w": f64(v)}, weight=i + 1, source=f"rank {i + 1}")
    assert fold.result()["w"].tolist() == [3.0]
    assert median.calls == [[1.0, 2.0, 3.0]]
    assert fold.sources == ["rank 1", "rank 2", "rank 3"]


def test_the_buffering_fold_checks_weights_and_gives_its_result_once():
    fold = begin(Median())
    with pytest.raises(AggregationError, match="rank 9 has negative weight"):
        fold.add({"w": f64(1)}, -2, source="rank 9")
    fold.add({"w": f64(1)})
    fold.result()
    with pytest.raises(AggregationError, match="already produced its result"):
        fold.result()


def test_begin_uses_the_aggregators_own_streaming_fold():
    assert isinstance(begin(fedavg()), MeanFold)


def test_begin_refuses_something_that_is_not_an_aggregator():
    with pytest.raises(TypeError, match="has neither aggregate\\(\\) nor begin\\(\\)"):
        begin(object())


def test_streaming_keeps_a_streaming_aggregator_and_gives_a_plain_one_a_buffering_begin():
    mean = fedavg()
    assert streaming(mean) is mean
    median = Median()
    wrapped = streaming(median)
    assert isinstance(wrapped, StreamingAggregator) and wrapped.name == "Median"
    fold = wrapped.begin()
    assert isinstance(fold, BufferingFold)
    fold.add({"w": f64(1.0)}, 1.0, source="rank 1")
    fold.add({"w": f64(5.0)}, 1.0, source="rank 2")
    assert fold.result()["w"].tolist() == [3.0]
    assert wrapped.aggregate([{"w": f64(2.0)}])["w"].tolist() == [2.0]
    assert median.calls == [[1.0, 1.0], None]
    with pytest.raises(TypeError, match="has neither aggregate\\(\\) nor begin\\(\\)"):
        streaming(object())


class StrictMedian:
    """A plain aggregator (no begin()) that applies the built-in strictness."""

    name = "median"

    def aggregate(self, states, weights=None):
        check_contributions(states, weights, name=self.name)
        return {k: np.median(np.stack([s[k] for s in states]), axis=0) for k in states[0]}


def test_the_buffering_fold_names_contributors_by_their_source():
    fold = begin(StrictMedian())
    for rank in (3, 5, 11):
        state = {"w": np.ones(2)} if rank != 11 else {"v": np.ones(2)}
        fold.add(state, 1.0, source=f"rank {rank}")
    with pytest.raises(AggregationError) as info:
        fold.result()
    message = str(info.value)
    assert "from rank 11, but rank 3 sent it" in message
    assert "contributor #" not in message


def test_the_buffering_fold_leaves_a_default_label_alone_and_maps_two_digit_ones():
    fold = begin(StrictMedian())
    for i in range(12):
        fold.add({"w": np.ones(2)} if i != 11 else {"w": np.ones(3)}, 1.0,
                 source=None if i < 11 else "rank 12")
    with pytest.raises(AggregationError, match="rank 12 sent shape"):
        fold.result()
