"""The round engine through host relays, in-process: the flat result, order, lost relays.

Each relay here is the kernel's relay side (``answer_relay_request``, what
``meshkit relay`` runs) over a :class:`LocalPool` of its ranks, reached
through a pool that answers relay requests in a chosen order; the network
legs are tested in
tests/transport/test_tcp_host_relay.py and tests/train/rounds/test_host_relay_rounds.py.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np
import pytest

import meshkit.plugins
from meshkit.train import LocalPool, Reply, StrategyContext, Trainer, Work, client_seed, decode
from meshkit.train import DivergedFit, encode
from meshkit import MeshError, ProtocolError
from meshkit.train import answer_relay_request, broadcast, fold_round, parse_relay_request
from meshkit.train._messages.relay import FanoutRequest, FoldAnswer, FoldRequest, RelayFailure
from meshkit.train._messages.relay import parse_fold_answer
from meshkit.train._rounds.relayed import relay_weight
from meshkit.train._messages import MAX_ERROR, MAX_NAME, field_table
from tests.support import protocol_doc

SYNTHETIC = {"params": 4096, "arrays": 2, "rows": 256}
LAYOUT = {"hostA": [1, 2], "hostB": [3, 4]}


def synthetic():
    return meshkit.plugins.create("task", "synthetic", SYNTHETIC)


class RelayedPool:
    """The coordinator's pool with every worker behind an in-process relay."""

    def __init__(self, layout=LAYOUT, *, order=None, lose=(), direct=False, beside=(),
                 corrupt=None):
        self.layout = layout
        self.direct = direct
        #: Ranks that dialed the coordinator directly, beside the relays.
        self.beside = LocalPool.of(synthetic, beside) if beside else None
        self.sent_direct: list[int] = []
        #: relay name -> a function that spoils its first answer (a buggy or hostile relay).
        self.corrupt = dict(corrupt or {})
        self.order = order
        self.lose = set(lose)
        self.gone: set[str] = set()
        self.asked: list[str] = []
        self._dead: dict[int, str] = {}
        self._relays = {}
        for name, ranks in layout.items():
            self._relays[name] = LocalPool.of(synthetic, ranks)
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

    def abandon(self, ticket):
        raise AssertionError("no round deadline here")

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
            answer = answer_relay_request(self._relays[name], frozenset(self.layout[name]), name,
                                          decode(encode(request)))
            spoil = self.corrupt.pop(name, None)
            if spoil is not None:
                spoil(answer)
            self._answers.append(Reply(self.layout[name][0], decode(encode(answer)), None,
                                       self._seq))
        return self._seq

    def send(self, rank, request, timeout):
        if self.beside is not None and rank in self.beside.trainers:
            self._seq += 1
            self.sent_direct.append(rank)
            self.beside.send(rank, request, timeout)
            reply = self.beside.receive()
            self._answers.append(Reply(rank, reply.payload, reply.error, self._seq))
            return self._seq
        # One rank's own request (data-parallel's read-back) goes through its relay.
        if not self.direct:
            raise AssertionError("a relayed round sends nothing to a rank directly")
        self._seq += 1
        local = next(p for n, p in self._relays.items() if rank in self.layout[n])
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
    # The flat star's round-robin plan and float32 fold, which relays follow
    # (a batched round plans contiguous batches and sums exactly).
    return fold_round(ctx, fits(clients), state=state, batch=False)


def test_two_relays_fold_to_the_flat_weighted_mean_whatever_order_they_answer_in():
    state = synthetic().init_state(0)
    flat = flat_result(state)
    results = []
    for shuffle in range(4):
        pool = RelayedPool(order=np.random.default_rng(shuffle))
        folded = fold_round(context(pool), fits(8), state=state)
        assert sorted(pool.asked) == ["hostA:fold", "hostB:fold"], "one request per relay"
        # Every client served, each on one of its relay's ranks (which one depends on
        # who finished first: a worker done with its plan takes over a busy one's last key).
        assert sorted(folded.served) == sorted(flat.served) == list(range(8))
        assert all((c % 4 < 2) == (rank < 3) for c, rank in folded.served.items())
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


def test_a_direct_worker_beside_relays_is_a_relay_of_one_and_the_mean_is_the_flat_one():
    state = synthetic().init_state(0)
    flat = flat_result(state)
    for shuffle in range(3):
        pool = RelayedPool({"hostA": [1, 2], "hostB": [3]}, beside=[4],
                           order=np.random.default_rng(shuffle))
        folded = fold_round(context(pool), fits(8), state=state)
        # Each relay still folds (one request each); only rank 4 is asked directly.
        assert sorted(pool.asked) == ["hostA:fold", "hostB:fold"]
        assert set(pool.sent_direct) == {4}
        assert folded.served == flat.served
        for key, value in flat.result.items():
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
    # With rank 4 beside the relays, each step still folds once per relay.
    pool = RelayedPool({"hostA": [1, 2], "hostB": [3]}, direct=True, beside=[4])
    mixed = run(pool)
    assert pool.asked.count("hostA:fold") == pool.asked.count("hostB:fold") == 4
    assert 4 in pool.sent_direct
    for key, value in flat.items():
        np.testing.assert_allclose(mixed[key], value, rtol=1e-6, atol=1e-7)


def a_fold_request(**change):
    request = {"op": "fold", "seq": 3, "work": [[0, {"op": "fit", "shard": 0, "shards": 2,
                                                      "seed": 1}]],
               "ranks": [1, 2], "weight": "examples", "weighted": True, "wide": False,
               "allow_nonfinite": False, "aggregator": "fedavg", "window": 1,
               "label": "client", "timeout": 5.0}
    request.update(change)
    return {k: v for k, v in request.items() if v is not ...}


@pytest.mark.parametrize("change, names", [
    ({"work": ...}, "work"),
    ({"work": [["0", {}]]}, "work"),
    ({"ranks": [1, "2"]}, "ranks"),
    ({"ranks": [0]}, "ranks"),
    ({"weight": "median"}, "weight"),
    ({"window": 0}, "window"),
    ({"weighted": 1}, "weighted"),
    ({"timeout": -1.0}, "timeout"),
    ({"extra": 1}, "extra"),
], ids=["missing", "key-not-int", "rank-not-int", "rank-0", "weight", "window", "bool",
        "timeout", "unknown-field"])
def test_a_malformed_relay_request_is_a_protocol_error_naming_the_field(change, names):
    with pytest.raises(ProtocolError, match=names):
        parse_relay_request(a_fold_request(**change))


def test_a_relay_answers_a_malformed_or_unknown_request_with_an_error_not_an_exception():
    pool = LocalPool.of(synthetic, [1, 2])
    answer = answer_relay_request(pool, frozenset({1, 2}), "hostA", a_fold_request(window="1"))
    assert "malformed host relay request 'fold'" in answer["error"]
    answer = answer_relay_request(pool, frozenset({1, 2}), "hostA", {"op": "mine"})
    assert "unknown host relay request 'mine'" in answer["error"]
    assert pool.log == []  # nothing reached a rank


@pytest.mark.parametrize("spoil", [
    lambda a: a.update(mass="lots"),
    lambda a: a.update(served=[[0, 3]]),  # a rank hostA does not carry
    lambda a: a.update(served=[[0, 1], [0, 1]]),
    lambda a: a.pop("state"),
    lambda a: a.update(replies=[[0, "many", {}]]),
], ids=["mass", "foreign-rank", "key-twice", "no-state", "examples"])
def test_a_relay_whose_answer_does_not_fit_loses_its_ranks_and_the_round_completes(spoil):
    state = synthetic().init_state(0)
    pool = RelayedPool(corrupt={"hostA": spoil})
    folded = fold_round(context(pool), fits(8), state=state)
    assert sorted(pool.dead) == [1, 2]
    assert all("host relay 'hostA' broke the protocol" in why for why in pool.dead.values())
    # hostA's clients, served again by hostB in the same round: the flat mean.
    assert sorted(folded.served) == list(range(8)) and set(folded.served.values()) == {3, 4}
    for key, value in flat_result(state).result.items():
        np.testing.assert_allclose(folded.result[key], value, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("answers", [
    "all fine", [[1, True]], [[1, True, None], [5, True, None]], [[1, True, None]] * 2,
    [[1, "yes", None], [2, True, None]],
], ids=["not-a-list", "short", "foreign-rank", "repeated", "ok-not-bool"])
def test_a_relay_whose_fanout_answer_does_not_fit_loses_its_ranks_only(answers):
    pool = RelayedPool(corrupt={"hostA": lambda a: a.update(answers=answers)})
    state = synthetic().init_state(0)
    replies = broadcast(pool, [1, 2, 3, 4], {"op": "set_state", "state": state}, 30.0)
    assert [r.ok for r in replies] == [False, False, True, True]
    assert sorted(pool.dead) == [1, 2]
    assert all("protocol error: host relay 'hostA'" in why for why in pool.dead.values())


def test_a_rank_the_relay_lost_during_a_broadcast_is_declared_dead_as_a_direct_one_is():
    # A relay's fanout answer [rank, false, why]: the rank was lost behind it. The pool's
    # ledger now says so (GroupPool declares a rank lost on a direct link dead).
    pool = RelayedPool(corrupt={"hostA": lambda a: a.update(
        answers=[[1, False, "stalled: no reply within 30 s"], [2, True, None]])})
    state = synthetic().init_state(0)
    replies = broadcast(pool, [1, 2, 3, 4], {"op": "set_state", "state": state}, 30.0)
    assert [r.ok for r in replies] == [False, True, True, True]
    assert replies[0].error == "stalled: no reply within 30 s"
    assert pool.dead == {1: "lost behind host relay 'hostA': stalled: no reply within 30 s"}


def test_a_weight_that_reads_only_examples_folds_at_the_relays():
    def by_examples(reply):
        return float(reply["examples"])

    assert relay_weight(by_examples, by_examples) == "examples"
    assert relay_weight(lambda r: 2.0 * r["examples"] / 2.0, by_examples) == "examples"
    assert relay_weight(lambda r: 1.0, by_examples) == "once"


def test_a_weight_that_reads_metrics_folds_flat_quietly(caplog):
    with caplog.at_level("DEBUG", logger="meshkit.train._rounds.relayed"):
        assert relay_weight(lambda r: r["metrics"]["loss"], lambda r: 0.0) is None
    assert "reads 'loss', which a relay cannot see" in caplog.text
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_a_weight_function_bug_is_logged_not_hidden_in_the_fold_plan(caplog):
    # Before, any exception meant "fold flat" without a word: a weight that
    # divides by zero changed how relayed rounds fold and nobody was told.
    def buggy(reply):
        return reply["examples"] / 0

    with caplog.at_level("WARNING", logger="meshkit.train._rounds.relayed"):
        assert relay_weight(buggy, lambda r: 0.0) is None
    assert "weight function raised ZeroDivisionError: division by zero" in caplog.text


def test_a_node_attack_behind_a_relay_is_still_recorded():
    pool = RelayedPool()
    attacker = pool._relays["hostB"].trainers[4]
    attacker.attack = meshkit.plugins.create("attack", "sign-flip", {"factor": 2.0})
    attacker.attack_name = "sign-flip"
    folded = fold_round(context(pool), fits(8), state=synthetic().init_state(0))
    assert sorted(pool.asked) == ["hostA:fold", "hostB:fold"], "it went through the relays"
    by_attacker = tuple(sorted(k for k, r in folded.served.items() if r == 4))
    assert by_attacker and folded.attacked == by_attacker


class _Ranks:
    """A host relay's ranks as RelayPool sees them: links that record what was sent."""

    def __init__(self, ranks):
        self.joined = set(ranks)
        self._dead = {}
        self.sent = []
        self.lost_event = __import__("threading").Event()

    @property
    def dead(self):
        return dict(self._dead)

    def lost(self, rank, reason):
        self._dead.setdefault(rank, reason)
        self.lost_event.set()

    def send_down(self, rank, tag, state):
        self.sent.append((rank, decode(dict(state))))


@pytest.mark.parametrize("reply", [
    {"metrics": {}},                          # no examples
    {"examples": "many", "metrics": {}},     # wrong type
    {"examples": -1, "metrics": {}},         # out of range
], ids=["missing", "wrong-type", "out-of-range"])
def test_a_relays_rank_whose_reply_does_not_fit_is_dropped_by_the_relay(reply):
    from meshkit.train import RelayPool
    ranks = _Ranks([1, 2])
    pool = RelayPool(ranks)
    request = {"op": "fit", "shard": 0, "shards": 2, "seed": 1, "keep": 7}
    seq = pool.send(1, request, 30.0)
    pool.deliver(1, {**reply, "seq": seq, "kept": 7})
    answer = pool.receive()
    assert answer.rank == 1 and answer.payload is None
    assert "protocol error" in answer.error
    assert ranks.lost_event.wait(10)
    assert "protocol error" in ranks.dead[1]
    # A good reply from the other rank still goes through.
    seq = pool.send(2, request, 30.0)
    pool.deliver(2, {"examples": 5, "metrics": {}, "seq": seq, "kept": 7})
    good = pool.receive()
    assert good.rank == 2 and good.payload["examples"] == 5


# -- docs/protocol.md §4.1 is the relay messages' schema -------------------------------------

RELAY_SCHEMAS = {("fold", "request"): FoldRequest, ("fold", "answer"): FoldAnswer,
                 ("fanout", "request"): FanoutRequest, ("error", "answer"): RelayFailure}


def relay_tables() -> dict[tuple[str, str], list[tuple[str, ...]]]:
    return protocol_doc.documented_tables("### 4.1 Host relays", "## 5. ",
                                          r"#### `(\w+)` relay (request|answer)")


def test_the_protocol_page_lists_every_relay_message_field_by_field_as_the_schema_does():
    documented = relay_tables()
    assert sorted(documented) == sorted(RELAY_SCHEMAS)
    for key, cls in RELAY_SCHEMAS.items():
        assert documented[key] == field_table(cls), key


_LONG_NAME, _LONG_TEXT = "x" * MAX_NAME, "x" * MAX_ERROR
_KEYS = (0, 2 ** 63 - 1)

#: Each documented type -> (values the schema must take, values it must refuse). A
#: type a table gains without probes here fails the test below: add its probes.
PROBES: dict[str, tuple[list, list]] = {
    "list of [key, request], 1 or more, keys distinct (key: int 0..2^63-1)": (
        [[[k, {}]] for k in _KEYS],
        [[], [[-1, {}]], [[2 ** 63, {}]], [[0, {}], [0, {}]], [["0", {}]], [[0.0, {}]]]),
    "list of int 1..2^31-1, distinct, 1 or more": (
        [[1], [2, 2 ** 31 - 1]], [[], [0], [2 ** 31], [1, 1], [True], ["1"]]),
    '"examples" or "once"': (["examples", "once"], ["median", 1, None]),
    "bool": ([True, False], [1, "true", None]),
    "str, up to 1024 chars, or null": ([None, "", _LONG_NAME], [_LONG_NAME + "x", 1]),
    "int 1..2^31": ([1, 2 ** 31], [0, 2 ** 31 + 1, 1.0, True]),
    "str, up to 1024 chars": (["", _LONG_NAME], [_LONG_NAME + "x", None, 3]),
    "float > 0, or null": ([None, 1e-9, 5], [0, -1.0, math.inf, math.nan, "5"]),
    "state": ([{"w": np.zeros(2, np.float32)}],
              [[1.0], {"": 1}, {_LONG_NAME + "x": 1}, {"w": {1, 2}}]),
    "str, 1..1024 chars": (["a", _LONG_NAME], ["", _LONG_NAME + "x", 1]),
    '"fold"': (["fold"], ["fanout", None]),
    "float, finite, >= 0": ([0, 2.5], [-1e-9, math.inf, math.nan, "1", True]),
    "int 0..2^31": ([0, 2 ** 31], [-1, 2 ** 31 + 1, 1.5]),
    "list of [key, rank] (key: int 0..2^63-1, rank one the relay carries)": (
        [[[0, 1]], [[0, 2]]], [[[-1, 1]], [[2 ** 63, 1]], [[0, 0]], [[0, 2 ** 31]], [["0", 1]],
                               [[0, 3]]]),
    "list of [key, why] (key: int 0..2^63-1, why: str up to 65536 chars)": (
        [[], [[1, ""]], [[1, _LONG_TEXT]]], [[[1, _LONG_TEXT + "x"]], [[1, 3]], [[-1, "x"]],
                                            [[5, "x"]]]),
    "list of [key, examples, metrics] (key: int 0..2^63-1, examples: int 0..2^53), served "
    "keys only": (
        [[], [[0, 0, {}]], [[0, 2 ** 53, {"loss": 1.0}]]],
        [[[0, -1, {}]], [[0, 2 ** 53 + 1, {}]], [[0, 1, {"loss": math.nan}]],
         [[0, 1, {"loss": "low"}]], [[0, "many", {}]], [[1, 1, {}]]]),
    "list of keys (key: int 0..2^63-1), served keys only": ([[], [0]], [[-1], ["0"], [1]]),
    "list of [rank, why] (rank one the relay carries, why: str up to 65536 chars)": (
        [[], [[1, ""]], [[2, _LONG_TEXT]]], [[[3, "x"]], [[0, "x"]], [["1", "x"]], [[1, 3]],
                                            [[1, _LONG_TEXT + "x"]]]),
    "list of keys (key: int 0..2^63-1), not-served keys only": ([[], [1]],
                                                                 [[-1], ["1"], [0]]),
    "str, 1..65536 chars": (["x", _LONG_TEXT], ["", _LONG_TEXT + "x", 1]),
    '"aggregation", "nonfinite", or null': ([None, "aggregation", "nonfinite"], ["other", 1]),
    "int 1..2^31-1, or null": ([None, 1, 2 ** 31 - 1], [0, 2 ** 31, "1"]),
}

#: A valid message of each kind, to change one field of: the fold answer answers
#: keys 0 and 1 for a relay carrying ranks 1 and 2.
_VALID = {
    ("fold", "request"): {k: v for k, v in a_fold_request().items() if k not in ("op", "seq")},
    ("fold", "answer"): {"op": "fold", "mass": 5.0, "count": 1, "served": [[0, 1]],
                         "not_served": [[1, "lost"]], "replies": [[0, 5, {}]],
                         "state": {"w": np.ones(2, np.float32)}, "attacked": []},
    ("fanout", "request"): {"inner": "apply", "ranks": [1, 2], "timeout": 5.0},
    ("error", "answer"): {"error": "it broke"},
}


def _parse(which: tuple[str, str], message: dict) -> Any:
    if which[1] == "request":
        return parse_relay_request({"op": which[0], "seq": 3, **message})
    return parse_fold_answer({"relay": "hostA", "seq": 3, **message}, keys=[0, 1], carried=[1, 2])


def _probed_fields() -> list[Any]:
    # `...` (fanout's inner fields) is the inner op's: each rank checks it (§7).
    return [pytest.param(which, field, kind, required, id=f"{which[0]}-{which[1]}-{field}")
            for which, rows in sorted(relay_tables().items())
            for field, kind, required, _ in rows if field != "..."]


@pytest.mark.parametrize("which, field, kind, required", _probed_fields())
def test_each_relay_field_takes_and_refuses_what_its_documented_type_says(which, field, kind,
                                                                          required):
    assert kind in PROBES, f"no probes for the documented type {kind!r}: add them to PROBES"
    good, bad = PROBES[kind]
    for value in good:
        _parse(which, {**_VALID[which], field: value})
    for value in bad:
        with pytest.raises(ProtocolError):
            _parse(which, {**_VALID[which], field: value})
    left_out = {k: v for k, v in _VALID[which].items() if k != field}
    if required == "yes":
        # Without `error` an answer is read as a fold answer, which it is not either.
        with pytest.raises(ProtocolError, match=field if field != "error" else "fold"):
            _parse(which, left_out)
    elif field != "state" or which != ("fold", "answer"):  # a served key needs its state
        _parse(which, left_out)


def test_a_relay_cuts_its_own_error_to_the_bound_the_coordinator_checks():
    pool = LocalPool.of(synthetic, [1, 2])
    answer = answer_relay_request(pool, frozenset({1, 2}), "hostA",
                                  {"op": "fold", "seq": 3, "label": "x" * (3 * MAX_ERROR)})
    assert 0 < len(answer["error"]) <= MAX_ERROR
    assert isinstance(parse_fold_answer(answer, keys=[0], carried=[1, 2]), RelayFailure)


class _Refusing(Trainer):
    """A rank whose every fit is an ``error`` reply (a broken or hostile node)."""

    def _fit(self, request: Any) -> Any:
        raise RuntimeError("this node refuses")


def test_a_failing_rank_behind_a_relay_sits_the_round_out_and_is_named_upstream():
    state = synthetic().init_state(0)
    pool = RelayedPool()
    pool._relays["hostB"].trainers[4] = _Refusing(synthetic())
    ctx = context(pool)
    folded = fold_round(ctx, fits(8), state=state)
    assert folded.failed == {4: "host relay 'hostB': error: fit: RuntimeError: this node "
                                "refuses"}
    assert folded.not_served == {} and 4 not in folded.served.values()
    assert ctx.dead == {} and ctx.strikes == {4: 1}  # counted upstream, towards quarantine
    for key, value in flat_result(state).result.items():
        np.testing.assert_allclose(folded.result[key], value, rtol=1e-6, atol=1e-7)


def test_a_clients_own_failure_behind_a_relay_is_not_served_again_elsewhere():
    class BrokenShard(Trainer):
        def _fit(self, request: Any) -> Any:
            if request.get("shard") == 5:
                raise RuntimeError("client 5 breaks")
            return super()._fit(request)

    pool = RelayedPool()
    for name in ("hostA", "hostB"):
        for rank in pool.layout[name]:
            pool._relays[name].trainers[rank] = BrokenShard(synthetic())
    folded = fold_round(context(pool), fits(8), state=synthetic().init_state(0))
    assert list(folded.not_served) == [5] and "failed on 2 ranks" in folded.not_served[5]
    assert sorted(pool.asked) == ["hostA:fold", "hostB:fold"]  # not a second wave for it
    assert folded.failed == {}


def test_a_relay_answering_an_error_sits_the_round_out_with_its_ranks():
    def fail(answer: dict) -> None:
        answer.clear()
        answer["error"] = "the relay's disk is full"

    state = synthetic().init_state(0)
    pool = RelayedPool(corrupt={"hostA": fail})
    folded = fold_round(context(pool), fits(8), state=state)
    assert pool.asked == ["hostA:fold", "hostB:fold", "hostB:fold"]  # hostA not asked again
    why = "host relay 'hostA' failed: the relay's disk is full"
    assert folded.failed == {1: why, 2: why} and folded.not_served == {}
    assert set(folded.served.values()) == {3, 4}
    ctx = context(RelayedPool(corrupt={"hostA": fail}))
    ctx.accept_failures = False
    with pytest.raises(MeshError, match="host relay 'hostA' failed: the relay's disk is full"):
        fold_round(ctx, fits(8), state=state)


def test_a_diverged_fit_behind_a_relay_is_the_models_not_the_relays():
    class Diverged:
        """synthetic, whose fits report a NaN loss (a diverged model)."""

        def __init__(self) -> None:
            self.inner = synthetic()

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def fit(self, state: Any, x: Any, y: Any, *, seed: int) -> Any:
            return attrs.evolve(self.inner.fit(state, x, y, seed=seed),
                                metrics={"train_loss": math.nan})

    pool = RelayedPool()
    pool._relays["hostB"].trainers[3] = Trainer(Diverged())
    with pytest.raises(DivergedFit, match="host relay 'hostB': .*train_loss = nan"):
        fold_round(context(pool), fits(8), state=synthetic().init_state(0))
