"""The round engine through host relays, in-process: the flat result, order, lost relays.

Each relay here is the real relay's fold (``HostRelay._fold``) over a
:class:`LocalPool` of its ranks, reached through a pool that answers relay
requests in a chosen order; the network legs are tested in
tests/transport/test_tcp_host_relay.py and tests/train/test_relay_rounds.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import meshkit.plugins
from meshkit.train import LocalPool, Reply, StrategyContext, Work, client_seed, decode, encode
from meshkit.train import fold_round
from meshkit_tcp.relay import HostRelay, RelayConfig

SYNTHETIC = {"params": 4096, "arrays": 2, "rows": 256}
LAYOUT = {"hostA": [1, 2], "hostB": [3, 4]}


def synthetic():
    return meshkit.plugins.create("task", "synthetic", SYNTHETIC)


class RelayedPool:
    """The coordinator's pool with every worker behind an in-process relay."""

    def __init__(self, layout=LAYOUT, *, order=None, lose=(), direct=False):
        self.layout = layout
        self.direct = direct
        self.order = order
        self.lose = set(lose)
        self.gone: set[str] = set()
        self.asked: list[str] = []
        self._dead: dict[int, str] = {}
        self._relays = {}
        for name, ranks in layout.items():
            relay = HostRelay(RelayConfig(coordinator="127.0.0.1:1", bind="127.0.0.1:0",
                                          world=5, ranks=tuple(ranks), secret=b"x" * 16,
                                          name=name))
            relay._pool = LocalPool.of(synthetic, ranks)
            self._relays[name] = relay
        self._answers: list[Reply] = []
        self._seq = 0

    @property
    def relays(self):
        return {n: [r for r in rs if r not in self._dead] for n, rs in self.layout.items()
                if n not in self.gone}

    @property
    def dead(self):
        return dict(self._dead)

    def live(self, ranks):
        return [r for r in ranks if r not in self._dead]

    def declare_dead(self, rank, reason):
        self._dead.setdefault(rank, reason)

    @property
    def pending(self):
        return len(self._answers)

    def send_relay(self, name, request, timeout):
        self._seq += 1
        self.asked.append(f"{name}:{request['op']}")
        if name in self.lose:
            # The relay dies with the request in flight: its ranks go with it.
            self.gone.add(name)
            for rank in self.layout[name]:
                self.declare_dead(rank, f"its host relay {name!r} was lost")
            self._answers.append(Reply(self.layout[name][0], None, "lost", self._seq))
        else:
            # Through the trainer protocol's encoding, as on the wire.
            relay, op = self._relays[name], request["op"]
            answer = (relay._fold if op == "fold" else relay._fanout)(decode(encode(request)))
            self._answers.append(Reply(self.layout[name][0], decode(encode(answer)), None,
                                       self._seq))
        return self._seq

    def send(self, rank, request, timeout):
        # One rank's own request (data-parallel's read-back) goes through its relay.
        if not self.direct:
            raise AssertionError("a relayed round sends nothing to a rank directly")
        self._seq += 1
        local = next(r for n, r in self._relays.items() if rank in self.layout[n])._pool
        local.send(rank, request, timeout)
        reply = local.receive()
        self._answers.append(Reply(rank, reply.payload, reply.error, self._seq))
        return self._seq

    def receive(self, block=True):
        pick = 0 if self.order is None else int(self.order.integers(len(self._answers)))
        return self._answers.pop(pick)


def context(pool, aggregator="fedavg"):
    ranks = [1, 2, 3, 4]
    return StrategyContext(task=synthetic(), aggregator=meshkit.plugins.create(
        "aggregator", aggregator), pool=pool, workers=ranks, rng=np.random.default_rng(0),
        timeout=30.0)


def fits(clients):
    return [Work(c, {"op": "fit", "shard": c, "shards": clients,
                     "seed": client_seed(7, 1, c)}) for c in range(clients)]


def flat_result(state, clients=8):
    ranks = [1, 2, 3, 4]
    ctx = StrategyContext(task=synthetic(), aggregator=meshkit.plugins.create(
        "aggregator", "fedavg"), pool=LocalPool.of(synthetic, ranks), workers=ranks,
        rng=np.random.default_rng(0), timeout=30.0)
    return fold_round(ctx, fits(clients), state=state)


def test_two_relays_fold_to_the_flat_weighted_mean_whatever_order_they_answer_in():
    state = synthetic().init_state(0)
    flat = flat_result(state)
    results = []
    for shuffle in range(4):
        pool = RelayedPool(order=np.random.default_rng(shuffle))
        folded = fold_round(context(pool), fits(8), state=state)
        assert sorted(pool.asked) == ["hostA:fold", "hostB:fold"], "one request per relay"
        assert folded.served == flat.served  # the same plan: client c on the same rank
        assert folded.examples == flat.examples
        for key, value in flat.result.items():
            np.testing.assert_allclose(folded.result[key], value, rtol=1e-6, atol=1e-7)
        results.append(folded.result)
    for other in results[1:]:
        assert all(np.array_equal(other[k], results[0][k]) for k in other), "bit-identical"


def test_a_relay_lost_mid_round_has_its_clients_served_by_the_other_relay():
    state = synthetic().init_state(0)
    pool = RelayedPool(lose={"hostA"})
    folded = fold_round(context(pool), fits(8), state=state)
    # The second wave: hostA's clients, to hostB.
    assert pool.asked == ["hostA:fold", "hostB:fold", "hostB:fold"]
    assert sorted(folded.served) == list(range(8)) and folded.not_served == {}
    assert set(folded.served.values()) == {3, 4}
    # Every client's fit is a pure function of (state, shard, seed): the mean is
    # the flat one, served by other ranks.
    for key, value in flat_result(state).result.items():
        np.testing.assert_allclose(folded.result[key], value, rtol=1e-6, atol=1e-7)


def test_every_relay_lost_leaves_every_client_not_served_with_the_reason():
    pool = RelayedPool(lose={"hostA", "hostB"})
    folded = fold_round(context(pool), fits(4), state=synthetic().init_state(0))
    assert folded.result is None and folded.served == {}
    assert sorted(folded.not_served) == [0, 1, 2, 3]
    assert all("no live host relay left" in why for why in folded.not_served.values())


def test_an_aggregator_that_is_not_the_mean_folds_flat():
    class Median:
        def aggregate(self, states, weights=None):
            return {k: np.median([s[k] for s in states], axis=0) for k in states[0]}

    pool = RelayedPool()
    ctx = context(pool)
    ctx.aggregator = Median()
    # Flat means per-rank requests, which this pool refuses: the relays are
    # not asked to fold what they cannot fold.
    with pytest.raises(AssertionError, match="sends nothing to a rank directly"):
        fold_round(ctx, fits(4), state=synthetic().init_state(0))
    assert pool.asked == []


def test_data_parallel_through_relays_reaches_the_flat_replicas_model():
    ranks = [1, 2, 3, 4]

    def run(pool):
        ctx = StrategyContext(task=synthetic(), aggregator=meshkit.plugins.create(
            "aggregator", "allreduce"), pool=pool, workers=ranks,
            rng=np.random.default_rng(0), timeout=30.0)
        strategy = meshkit.plugins.create("strategy", "data-parallel", {"rounds": 2,
                                                                        "steps": 2})
        return strategy.run(ctx).state

    flat = run(LocalPool.of(synthetic, ranks))
    pool = RelayedPool(direct=True)
    relayed = run(pool)
    # set_state and every apply cross once per relay; each step folds once per relay.
    assert pool.asked.count("hostA:fanout") == pool.asked.count("hostB:fanout") == 5
    assert pool.asked.count("hostA:fold") == pool.asked.count("hostB:fold") == 4
    for key, value in flat.items():
        np.testing.assert_allclose(relayed[key], value, rtol=1e-6, atol=1e-7)


def test_a_node_attack_behind_a_relay_is_still_recorded():
    pool = RelayedPool()
    attacker = pool._relays["hostB"]._pool.trainers[4]
    attacker.attack = meshkit.plugins.create("attack", "sign-flip", {"factor": 2.0})
    attacker.attack_name = "sign-flip"
    folded = fold_round(context(pool), fits(8), state=synthetic().init_state(0))
    assert sorted(pool.asked) == ["hostA:fold", "hostB:fold"], "it went through the relays"
    by_attacker = tuple(sorted(k for k, r in folded.served.items() if r == 4))
    assert by_attacker and folded.attacked == by_attacker
