"""``[strategy] trainable`` on the worker (set_state merges the trainable keys into the model it
holds; a fit answers with only them) and on the coordinator (who is sent the whole model)."""

from __future__ import annotations

import numpy as np

from meshkit.task import FitResult
from meshkit.train import Trainable, Trainer


class TwoLayers:
    """A fit moves every key: 'fc.w' and 'body.w' both by +1, so a reply shows which travelled."""

    def init_state(self, seed):
        return {"body.w": np.zeros(3, np.float32), "fc.w": np.zeros(2, np.float32)}

    def train_data(self):
        return np.zeros((4, 1)), np.zeros(4)

    def fit(self, state, x, y, seed=0):
        return FitResult({k: v + np.float32(1) for k, v in state.items()}, len(y), {"loss": 1.0})

    def evaluate(self, state, x=None, y=None):
        return {"loss": 0.0}


def _fit(trainer):
    return trainer.handle({"op": "fit", "seq": 2, "shard": 0, "shards": 1, "seed": 0})


def test_set_state_merges_the_trainable_keys_and_a_fit_answers_with_only_them():
    trainer = Trainer(TwoLayers())
    whole = {"body.w": np.full(3, 5, np.float32), "fc.w": np.zeros(2, np.float32)}
    assert "error" not in trainer.handle({"op": "set_state", "seq": 1, "state": whole,
                                          "trainable": ["fc.w"]})
    reply = _fit(trainer)
    assert set(reply["state"]) == {"fc.w"}
    assert np.array_equal(reply["state"]["fc.w"], np.ones(2, np.float32))
    # The next round sends only the trainable key; the frozen one stays as first sent.
    assert "error" not in trainer.handle({"op": "set_state", "seq": 3, "trainable": ["fc.w"],
                                          "state": {"fc.w": np.full(2, 7, np.float32)}})
    assert trainer.state is not None
    assert np.array_equal(trainer.state["body.w"], np.full(3, 5, np.float32))
    assert np.array_equal(trainer.state["fc.w"], np.full(2, 7, np.float32))
    # A plain set_state (no trainable) replaces the model and fits answer whole again.
    trainer.handle({"op": "set_state", "seq": 4, "state": whole})
    assert set(_fit(trainer)["state"]) == {"body.w", "fc.w"}


def test_a_worker_holding_no_model_refuses_only_the_trainable_keys():
    trainer = Trainer(TwoLayers())
    reply = trainer.handle({"op": "set_state", "seq": 1, "trainable": ["fc.w"],
                            "state": {"fc.w": np.zeros(2, np.float32)}})
    assert "holds no model to merge them into" in reply["error"]


def test_a_set_state_naming_keys_it_does_not_carry_is_refused():
    trainer = Trainer(TwoLayers())
    reply = trainer.handle({"op": "set_state", "seq": 1, "trainable": ["fc.w", "nope"],
                            "state": {"fc.w": np.zeros(2, np.float32)}})
    assert "'nope'" in reply["error"]
    reply = trainer.handle({"op": "set_state", "seq": 2, "trainable": [],
                            "state": {"fc.w": np.zeros(2, np.float32)}})
    assert reply["error"].startswith("protocol error"), reply


def test_the_coordinator_sends_the_whole_model_once_per_rank_and_again_after_a_failure():
    state = {"body.w": np.zeros(3), "fc.w": np.ones(2)}
    trainable = Trainable(frozenset({"fc.w"}))
    assert set(trainable.set_state(1, state)["state"]) == {"body.w", "fc.w"}
    assert set(trainable.set_state(1, state)["state"]) == {"fc.w"}
    assert set(trainable.set_state(2, state)["state"]) == {"body.w", "fc.w"}
    trainable.forget([1])
    assert set(trainable.set_state(1, state)["state"]) == {"body.w", "fc.w"}
    trainable.keep_only([1])  # rank 2 died: it may come back as a fresh process
    assert set(trainable.set_state(2, state)["state"]) == {"body.w", "fc.w"}
    assert trainable.set_state(2, state)["trainable"] == ["fc.w"]


def test_a_restarted_worker_is_sent_the_whole_model_and_every_round_is_served():
    """A run over a LocalPool where rank 2 comes back as a fresh process (no model)
    before round 3: it is sent the whole model (run_rounds hands an admitted rank the
    model; a set_state of only the trainable keys then merges), serves, and the frozen
    key stays put."""
    import meshkit.plugins
    from meshkit.train import LocalPool, StrategyContext

    pool = LocalPool.of(TwoLayers, [1, 2])
    reports = []
    rounds_started = []

    def admit():
        rounds_started.append(1)
        if len(rounds_started) == 3:
            pool.trainers[2] = Trainer(TwoLayers())  # a restarted process holds nothing
            return [2]
        return []

    ctx = StrategyContext(task=TwoLayers(), aggregator=meshkit.plugins.create("aggregator", "fedavg"),
                          pool=pool, workers=[1, 2], rng=np.random.default_rng(0),
                          outer=meshkit.plugins.create("outer_optimizer", "average"),
                          on_round=lambda report, state: reports.append((report, dict(state))))
    ctx.admit = admit
    strategy = meshkit.plugins.create("strategy", "federated", {
        "rounds": 4, "clients": 2, "trainable": ["fc.*"]})
    result = strategy.run(ctx)
    assert [sorted(r.answered) for r, _ in reports] == [[1, 2]] * 4
    assert np.array_equal(result.state["body.w"], np.zeros(3, np.float32))
    assert np.array_equal(result.state["fc.w"], np.full(2, 4, np.float32))
