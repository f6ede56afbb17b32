"""The built-in partitioners: the contract suite, their splits, and what each refuses."""

from __future__ import annotations

import numpy as np
import pytest

import meshkit
from meshkit import ConfigError
from meshkit.partitioner import check_split, label_counts, split_rows
from meshkit.testing import PartitionerContract
from meshkit.train import shard_bounds


class TestContiguous(PartitionerContract):
    component = "contiguous"
    seeded = False


class TestIid(PartitionerContract):
    component = "iid"


class TestDirichlet(PartitionerContract):
    component = "dirichlet"
    options = {"alpha": 1.0}


class TestPathological(PartitionerContract):
    component = "pathological"
    options = {"classes_per_client": 2}


class TestLocal(PartitionerContract):
    component = "local"
    seeded = False


def _digits_labels() -> np.ndarray:
    from meshkit_tasks.digits import DigitsTask

    return DigitsTask().train_data()[1]


def test_contiguous_gives_the_row_blocks_every_run_used_before():
    parts = meshkit.plugins.create("partitioner", "contiguous").split(np.zeros(103), 4, seed=9)
    assert [(int(p[0]), int(p[-1]) + 1) for p in parts] == shard_bounds(103, 4)


def test_dirichlet_split_of_digits_is_a_pure_function_of_the_seed():
    labels = _digits_labels()
    make = lambda: meshkit.plugins.create("partitioner", "dirichlet", {"alpha": 0.1})  # noqa: E731
    first = split_rows(make(), labels, 10, seed=0, name="dirichlet")
    again = split_rows(make(), labels.copy(), 10, seed=0, name="dirichlet")
    other = make().split(labels, 10, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert any(not np.array_equal(a, b) for a, b in zip(first, other))
    # alpha = 0.1 is strong label skew: most clients are dominated by few labels.
    top = [max(c.values()) / sum(c.values()) for c in label_counts(labels, first)]
    assert np.median(top) > 0.4


def test_pathological_clients_hold_only_their_classes():
    labels = _digits_labels()
    parts = split_rows(meshkit.plugins.create("partitioner", "pathological",
                                              {"classes_per_client": 2}),
                       labels, 10, seed=0, name="pathological")
    assert all(len(c) == 2 for c in label_counts(labels, parts))


@pytest.mark.parametrize("alpha", [1e308, float("inf")])
def test_an_alpha_numpys_draw_cannot_split_with_is_refused(alpha):
    # Found by the check property test: alpha = 1e308 drew all-zero shares, inf NaN ones,
    # and check said ok to a split of garbage (issue 34).
    with pytest.raises(ConfigError, match=r"\[partitioner\].*alpha must be at most 1e\+06"):
        meshkit.plugins.create("partitioner", "dirichlet", {"alpha": alpha})


@pytest.mark.parametrize("alpha", [0, -1.0])
def test_alpha_not_above_zero_is_refused(alpha):
    with pytest.raises(ConfigError, match=r"\[partitioner\].*alpha must be greater than 0"):
        meshkit.plugins.create("partitioner", "dirichlet", {"alpha": alpha})


def test_more_clients_than_rows_is_refused():
    partitioner = meshkit.plugins.create("partitioner", "iid")
    with pytest.raises(ConfigError, match="cannot split 5 rows into 8 clients.*at most 5"):
        split_rows(partitioner, np.arange(5), 8, seed=0, name="iid")


def test_classes_per_client_out_of_range_is_refused():
    labels = np.repeat(np.arange(4), 10)
    too_many = meshkit.plugins.create("partitioner", "pathological", {"classes_per_client": 5})
    with pytest.raises(ConfigError, match="only 4 labels; use 1..4"):
        too_many.split(labels, 4, seed=0)
    with pytest.raises(ConfigError, match=r"cover only 2 of the 4 labels.*at least 4 clients"):
        meshkit.plugins.create("partitioner", "pathological",
                               {"classes_per_client": 1}).split(labels, 2, seed=0)
    with pytest.raises(ConfigError, match="classes_per_client must be at least 1"):
        meshkit.plugins.create("partitioner", "pathological", {"classes_per_client": 0})


def test_a_dirichlet_split_leaving_a_client_empty_says_what_to_do():
    labels = np.repeat(np.arange(3), 4)
    partitioner = meshkit.plugins.create("partitioner", "dirichlet", {"alpha": 0.01})
    with pytest.raises(ConfigError, match="gave client .* no rows.*alpha"):
        for seed in range(20):
            split_rows(partitioner, labels, 6, seed=seed, name="dirichlet")


def test_a_split_that_drops_or_repeats_rows_is_refused():
    with pytest.raises(ConfigError, match="more than one client"):
        check_split([np.array([0, 1]), np.array([1, 2])], 3, 2, name="bad")
    with pytest.raises(ConfigError, match="left 1 row"):
        check_split([np.array([0]), np.array([1])], 3, 2, name="bad")


def test_unknown_partitioner_key_and_name_are_refused_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"\[partitioner\].*alfa.*did you mean 'alpha'"):
        meshkit.plugins.create("partitioner", "dirichlet", {"alfa": 0.1})
    with pytest.raises(meshkit.UnknownComponentError, match="did you mean 'dirichlet'"):
        meshkit.plugins.default().registry.get("partitioner", "dirichelt")
