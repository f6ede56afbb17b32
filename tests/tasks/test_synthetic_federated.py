"""``synthetic-federated``: LEAF's synthetic(alpha, beta), each client made alone from the seed."""

from __future__ import annotations

import numpy as np
import pytest

from meshkit import ConfigError
from meshkit.population import is_population
from meshkit.task import create_task


def _task(**options: object):
    return create_task("synthetic-federated", {"dim": 20, "classes": 5, **options})


def test_it_is_a_population_of_the_clients_it_is_given():
    task = _task(clients=1_000_000)
    assert is_population(task) and task.population() == 1_000_000


def test_a_client_far_down_the_population_is_made_alone_and_cheaply():
    task = _task(clients=1_000_000)
    x, y = task.client_data(999_999)
    again = _task(clients=10_000_000).client_data(999_999)
    # the same client whatever the population's size: it depends on (data_seed, client) only
    assert np.array_equal(x, again[0]) and np.array_equal(y, again[1])
    assert x.shape == (len(y), 20) and x.dtype == np.float32


def test_another_data_seed_is_another_population():
    a = _task(clients=10).client_data(3)[0]
    b = _task(clients=10, data_seed=1).client_data(3)[0]
    assert a.shape != b.shape or not np.array_equal(a, b)


def test_example_counts_follow_leafs_lognormal_draw():
    task = _task(clients=3000)
    counts = np.array([task.examples(c) for c in range(3000)])
    assert counts.min() >= 5 and counts.max() <= 1000
    # min(5 + floor(lognormal(3, 2)), 1000): median 5 + e^3 (about 25), a share at the cap
    assert 20 <= np.median(counts) <= 31
    share_at_cap = np.mean(counts == 1000)
    assert 0.012 < share_at_cap < 0.04  # P(lognormal(3, 2) >= 995) is about 0.026


def test_each_client_holds_out_its_last_tenth():
    task = _task(clients=50)
    for c in range(50):
        n = task.examples(c)
        train, test = task.client_data(c)[1], task.client_test_data(c)[1]
        assert len(train) + len(test) == n and len(train) >= 1
        assert len(test) == round(n * 0.1)


def _label_spread(task, clients: int) -> float:
    """The mean over clients of the share of a client's rows in its most common label."""
    shares = []
    for c in range(clients):
        y = task.client_data(c)[1]
        shares.append(np.bincount(y, minlength=5).max() / len(y))
    return float(np.mean(shares))


def test_alpha_and_beta_make_the_clients_differ():
    """synthetic(0, 0) clients share a model prior and feature prior; synthetic(1, 1) do not."""
    iid_like = _task(clients=300, alpha=0.0, beta=0.0)
    skewed = _task(clients=300, alpha=1.0, beta=1.0)
    means = [np.stack([t.client_data(c)[0].mean(axis=0) for c in range(300)])
             for t in (iid_like, skewed)]
    # B_k ~ N(0, beta^2): the feature means spread out with beta
    assert means[1].mean(axis=1).std() > 2 * means[0].mean(axis=1).std()
    assert _label_spread(skewed, 300) > _label_spread(iid_like, 300) - 0.05


def test_a_client_outside_the_population_is_refused_by_number():
    with pytest.raises(ConfigError, match="client 10 requested.*clients = 10"):
        _task(clients=10).client_data(10)


def test_min_samples_above_max_samples_is_refused():
    with pytest.raises(ConfigError, match="min_samples = 50 is more than max_samples = 10"):
        _task(min_samples=50, max_samples=10)


@pytest.mark.parametrize("options, words", [
    # numpy's "array is too big" from a client's true model, found by the check property test
    ({"classes": 2 ** 63 - 1}, r"\[task\] dim = 20, classes = 9223372036854775807: a client's "
                               r"true model would hold"),
    ({"max_samples": 10 ** 9}, r"\[task\] max_samples = 1000000000, dim = 20: a client's "
                               r"features"),
    ({"dim": 2 ** 20, "hidden": 2 ** 12}, r"\[task\] dim = 1048576, hidden = 4096: the first "
                                          r"layer"),
    ({"dim": 1, "hidden": 2 ** 30}, r"\[task\] hidden = 1073741824, classes = 5: the second layer"),
])
def test_a_size_no_array_can_hold_is_refused_naming_the_keys(options, words):
    with pytest.raises(ConfigError, match=words + r".*more than the 2,147,483,648"):
        _task(**{"max_samples": 1000, **options})


@pytest.mark.parametrize("key", ["alpha", "beta"])
def test_a_heterogeneity_past_what_float32_features_hold_is_refused(key):
    # alpha = 1e300 made every client's features inf and its labels garbage; check said
    # ok (found by the check property test, issue 34).
    with pytest.raises(ConfigError, match=rf"{key}.*must be at most 1e\+06"):
        _task(**{key: 1e300})


def test_the_largest_size_allowed_is_built_without_allocating_it():
    # 2^31 elements exactly is allowed; building the task allocates nothing that size.
    task = _task(dim=2 ** 21, max_samples=2 ** 10, hidden=0, classes=2)
    assert task.options.dim * task.options.max_samples == 2 ** 31


def test_logistic_regression_is_hidden_zero():
    state = _task(clients=10, hidden=0).init_state(0)
    assert {k: v.shape for k, v in state.items()} == {"w": (20, 5), "b": (5,)}


def test_fits_learn_a_clients_own_model():
    task = _task(clients=10, hidden=8)
    x, y = task.client_data(3)
    state = start = task.init_state(0)
    for epoch in range(20):
        state = task.fit(state, x, y, seed=epoch).state
    before, after = task.evaluate(start, x, y), task.evaluate(state, x, y)
    assert after["loss"] < before["loss"] / 3 and after["accuracy"] > 0.8


def test_federated_averaging_learns_fedprox_s_thirty_clients():
    """FedProx's setting: 30 clients of synthetic(1, 1), all in every round, evaluated on
    their own held-out rows (clients share no labelling rule, so it is theirs it learns)."""
    task = create_task("synthetic-federated", {"clients": 30, "eval_clients": 30})
    state = task.init_state(0)
    assert task.evaluate(state)["accuracy"] < 0.2
    for rnd in range(10):
        fits = [task.fit(state, *task.client_data(c), seed=rnd * 100 + c) for c in range(30)]
        total = sum(f.examples for f in fits)
        state = {k: (sum(f.state[k].astype(np.float64) * f.examples for f in fits)
                     / total).astype(np.float32) for k in state}
    assert task.evaluate(state)["accuracy"] > 0.55  # 0.70 after 10 rounds, 0.86 after 60
