"""The message boundary: every trainer request and reply checked against its schema.

Three levels: the schema itself (every reply field missing, wrong-typed, out
of range or oversized is a ProtocolError and nothing else); a worker sending
such a reply into the real round engine (only that rank is dropped, named
with the reason, and the run finishes with the others); and the same from a
real worker process.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import meshkit
import meshkit.plugins
from meshkit.node import NodeCaps
from meshkit.train import LocalPool, Runner, StrategyContext, Trainer, decode, read_metrics
from meshkit.train import _messages as messages
from meshkit.train._messages.trainer import FitReply
from meshkit.train._messages import REPLIES, REQUESTS, check_reply, check_request
from meshkit_secagg import SEALED_SIZE, SHARE_SIZE

from tests.support import protocol_doc
from tests.support.configs import write_config

# -- the schema --------------------------------------------------------------------------

#: A SHA-256 digest as replicas send it (``replica_*``, ``inner``).
DIGEST = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

#: A well-formed reply to each op (with keep where the engine sends it).
GOOD: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "set_state": ({"op": "set_state"}, {"seq": 5}),
    "fit": ({"op": "fit", "keep": 3},
            {"seq": 5, "examples": 10, "metrics": {"train_loss": 0.5}, "kept": 3}),
    "grads": ({"op": "grads"}, {"seq": 5, "examples": 4, "metrics": {},
                                "gradients": {"w": np.zeros(3, np.float32)}}),
    "step": ({"op": "step"}, {"seq": 5, "examples": 4, "metrics": {"train_loss": 1.0}}),
    "take": ({"op": "take"}, {"seq": 5, "state": {"w": np.zeros(3, np.float32)}}),
    "apply": ({"op": "apply"}, {"seq": 5}),
    "get_state": ({"op": "get_state"}, {"seq": 5, "state": {"w": np.ones(2)}}),
    "held_out": ({"op": "held_out"}, {"seq": 5, "examples": 7}),
    "evaluate": ({"op": "evaluate"}, {"seq": 5, "examples": 7, "metrics": {"accuracy": 0.9}}),
    "stage": ({"op": "stage"}, {"seq": 5, "x": np.zeros((2, 2))}),
    "fit_batch": ({"op": "fit_batch", "keys": [4, 2]},
                  {"seq": 5, "results": [{"key": 4, "examples": 3, "metrics": {}},
                                         {"key": 2, "examples": 1, "metrics": {"loss": 1.0},
                                          "attacked": "sign-flip"}]}),
    "take_partial": ({"op": "take_partial"},
                     {"seq": 5, "partial": {"fraction_bits": 32, "mass": 1 << 32, "count": 1,
                                            "f:w": np.zeros(3, np.int64), "t:w": "float32"}}),
    "secagg_keys": ({"op": "secagg_keys"}, {"seq": 5, "clients": [0, 2],
                                            "adverts": np.zeros((2, 96), np.uint8)}),
    "secagg_share": ({"op": "secagg_share"},
                     {"seq": 5, "senders": [0, 0], "recipients": [1, 2],
                      "sealed": np.zeros((2, SEALED_SIZE), np.uint8)}),
    "secagg_open": ({"op": "secagg_open"}, {"seq": 5, "senders": [1], "recipients": [0]}),
    "secagg_reveal": ({"op": "secagg_reveal"}, {"seq": 5, "keys": np.zeros((1, 32), np.uint8)}),
    "secagg_mask": ({"op": "secagg_mask"}, {"seq": 5, "clients": [0, 2],
                                            "vector": np.zeros(4, np.uint32)}),
    "secagg_confirm": ({"op": "secagg_confirm"},
                       {"seq": 5, "clients": [0, 2], "signer": np.zeros((1, 32), np.uint8),
                        "signatures": np.zeros((2, 64), np.uint8)}),
    "secagg_unmask": ({"op": "secagg_unmask"},
                      {"seq": 5, "holders": [0], "owners": [1], "kinds": [0],
                       "shares": np.zeros((1, SHARE_SIZE), np.uint8)}),
    "replica_init": ({"op": "replica_init"}, {"seq": 5, "digest": DIGEST}),
    "inner": ({"op": "inner"}, {"seq": 5, "examples": 64, "metrics": {"train_loss": 1.5},
                                "digest": DIGEST}),
    "replica_get": ({"op": "replica_get"},
                    {"seq": 5, "anchor": {"w": np.zeros(2)}, "local": {"w": np.ones(2)},
                     "optimizer": {}, "snapshot": {}, "pending": [1], "inner_steps": 40,
                     "digest": DIGEST, "replica_digest": DIGEST}),
    "replica_put": ({"op": "replica_put"},
                    {"seq": 5, "digest": DIGEST, "replica_digest": DIGEST}),
}

#: Values of the wrong type for any field (each field's own type is filtered out below).
ANY_VALUE = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True),
                      st.text(max_size=8), st.lists(st.integers(), max_size=3),
                      st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


#: Fields a reply may leave out: null there is the same as absent (docs/protocol.md §7).
OPTIONAL = {"kept", "state", "gradients"}


def _wrong_type(field: str, good: Any) -> st.SearchStrategy[Any]:
    if field in OPTIONAL:
        return _wrong_type("", good).filter(lambda v: v is not None)
    if isinstance(good, bool) or isinstance(good, int):
        return ANY_VALUE.filter(lambda v: isinstance(v, bool) or not isinstance(v, int))
    if isinstance(good, dict):
        return ANY_VALUE.filter(lambda v: not isinstance(v, dict))
    if isinstance(good, list):  # client ids: a list of the wrong things, or no list
        return st.one_of(ANY_VALUE.filter(lambda v: not isinstance(v, list)),
                         st.lists(st.one_of(st.text(max_size=2), st.floats(), st.none()),
                                  min_size=1, max_size=3),
                         st.lists(st.integers(max_value=-1), min_size=1, max_size=3))
    if isinstance(good, np.ndarray):
        return st.one_of(st.none(), st.text(max_size=4), st.dictionaries(st.text(), st.none()))
    return ANY_VALUE


def _out_of_range(field: str, good: Any) -> st.SearchStrategy[Any]:
    if field in ("examples", "seq", "kept"):
        return st.one_of(st.integers(max_value=-1),
                         st.integers(min_value=messages.MAX_SEQ + 1, max_value=2 ** 70))
    if field == "metrics":
        return st.sampled_from([math.nan, math.inf, -math.inf]).map(lambda v: {"loss": v})
    if field in ("state", "gradients", "partial"):
        return st.sampled_from([{"": np.zeros(1)}, {"w": object()}, {5: np.zeros(1)}])
    if field == "results":  # a key it was not asked for, or a broken result
        return st.sampled_from([[{"key": 4, "examples": 3, "metrics": {}}],
                                [{"key": 4, "examples": -1, "metrics": {}},
                                 {"key": 2, "examples": 1, "metrics": {}}],
                                [{"key": 4, "examples": 3, "metrics": {}},
                                 {"key": 9, "examples": 1, "metrics": {}}]])
    return st.nothing()


def _oversized(field: str, good: Any) -> st.SearchStrategy[Any]:
    if field == "metrics":
        return st.just({f"m{i}": 1.0 for i in range(messages.MAX_METRICS + 1)})
    if field in ("state", "gradients", "partial"):
        return st.just({"k" * (messages.MAX_NAME + 1): np.zeros(1)})
    if field == "examples":
        return st.just(messages.MAX_EXAMPLES + 1)
    return st.nothing()


HOWS = {"missing": lambda field, good: st.just(None), "wrong type": _wrong_type,
        "out of range": _out_of_range, "oversized": _oversized}
APPLIES = {
    "out of range": {"examples", "seq", "kept", "metrics", "state", "gradients", "partial",
                     "results"},
    "oversized": {"metrics", "state", "gradients", "examples", "partial"},
}


@st.composite
def breaches(draw: Callable[..., Any], ops: tuple[str, ...] = tuple(GOOD)
             ) -> tuple[str, str, str, Any]:
    """(op, field, how, value): one reply field broken one way."""
    op = draw(st.sampled_from(ops))
    field = draw(st.sampled_from(sorted(GOOD[op][1])))
    how = draw(st.sampled_from([h for h in sorted(HOWS) if field in APPLIES.get(h, {field})]))
    value = draw(HOWS[how](field, GOOD[op][1][field]))
    return op, field, how, value


def broken(reply: dict[str, Any], field: str, how: str, value: Any) -> dict[str, Any]:
    out = dict(reply)
    if how == "missing":
        del out[field]
    else:
        out[field] = value
    return out


def test_every_well_formed_reply_fits():
    for op, (request, reply) in GOOD.items():
        assert check_reply(request, reply, 5) is reply, op
    assert set(GOOD) == set(REPLIES), "every op with a reply has a case here"


@settings(max_examples=200, deadline=None)
@given(breaches(), st.sampled_from(["extra", "none"]))
def test_a_broken_reply_is_a_protocol_error_and_nothing_else(case, extra):
    op, field, how, value = case
    request, reply = GOOD[op]
    bad = broken(reply, field, how, value)
    if extra == "extra":
        bad["surprise"] = 1
    with pytest.raises(meshkit.ProtocolError) as caught:
        check_reply(request, bad, 5)
    # The reason names what is wrong, for the ledger and the user.
    assert field in str(caught.value) or "surprise" in str(caught.value) or \
        "kept" in str(caught.value) or "answers keys" in str(caught.value), str(caught.value)


FRAME_KEYS = st.one_of(st.sampled_from(["seq", "examples", "metrics", "kept", "state",
                                         "gradients", "#state", "#gradients", "state/w",
                                         "gradients/w", "x", "error", "relay"]),
                       st.text(max_size=6))
FRAME_VALUES = st.one_of(ANY_VALUE, st.just(np.zeros(2, np.float32)),
                         st.dictionaries(st.text(max_size=3), ANY_VALUE, max_size=3))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(REPLIES)), st.dictionaries(FRAME_KEYS, FRAME_VALUES, max_size=6))
def test_any_frame_at_all_is_a_reply_or_a_protocol_error(op, frame):
    try:
        check_reply({"op": op}, decode(frame))
    except meshkit.ProtocolError:
        pass  # anything else (TypeError, KeyError, ...) fails the test


REQUEST_KEYS = st.one_of(st.sampled_from(["op", "seq", "shard", "shards", "seed", "keep",
                                           "key", "state", "#state", "state/w", "ranks",
                                           "nodes", "x", "time_budget"]), st.text(max_size=6))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(REQUESTS)), st.dictionaries(REQUEST_KEYS, FRAME_VALUES, max_size=6))
def test_a_worker_answers_any_request_frame_and_serves_on(op, frame):
    trainer = Trainer(meshkit.plugins.create("task", "synthetic", {"params": 8, "rows": 8}))
    try:
        request = decode({"op": op, **frame})
    except meshkit.ProtocolError:
        return  # serve_trainer answers it with the error (test_worker_pool)
    reply = trainer.handle(request)
    assert "seq" in reply
    # The worker is still whole: it serves a good request next.
    assert trainer.handle({"op": "set_state", "seq": 1, "state": {"w": np.zeros(1)}}) == {
        "seq": 1}


def test_a_reply_must_echo_its_seq_and_its_keep():
    with pytest.raises(meshkit.ProtocolError, match="echoes seq 5, not 6"):
        check_reply(*GOOD["apply"], 6)
    request, reply = GOOD["fit"]
    with pytest.raises(meshkit.ProtocolError, match="kept = 3"):
        check_reply(request, {**reply, "kept": 4}, 5)
    with pytest.raises(meshkit.ProtocolError, match="without keep must carry 'state'"):
        check_reply({"op": "fit"}, reply, 5)
    with pytest.raises(meshkit.ProtocolError, match="no 'state'"):
        check_reply(request, {**reply, "state": {}}, 5)


def test_an_error_reply_fits_any_op_but_is_bounded():
    assert check_reply({"op": "take"}, {"seq": 1, "error": "boom"}, 1)
    with pytest.raises(meshkit.ProtocolError, match="error has 65537 characters"):
        check_reply({"op": "take"}, {"seq": 1, "error": "x" * (messages.MAX_ERROR + 1)}, 1)


def test_a_protocol_error_is_a_wire_error_and_public():
    assert issubclass(meshkit.ProtocolError, meshkit.WireError)
    assert "ProtocolError" in meshkit.__all__


GOOD_REQUESTS = {
    "set_state": {"state": {"w": np.zeros(2)}},
    "fit": {"shard": 1, "shards": 4, "seed": 2 ** 40, "keep": 1, "time_budget": 2.5},
    "grads": {"shard": 0, "shards": 1, "seed": 0, "batch_size": 8},
    "step": {"shard": 0, "shards": 2, "seed": 0, "ranks": [1, 2]},
    "take": {"key": 0},
    "apply": {"gradients": {"w": np.zeros(2)}},
    "get_state": {},
    "held_out": {},
    "evaluate": {"shard": 0, "shards": 1},
    "stage": {"nodes": ["a"], "x": np.zeros(3)},
    "stop": {},
    "fit_batch": {"fits": [{"key": 3, "shard": 1, "shards": 4, "seed": 0},
                           {"key": 5, "shard": 2, "shards": 4, "seed": 1, "time_budget": 1.0}],
                  "weight": "examples", "fraction_bits": 32, "label": "client"},
    "take_partial": {},
    "secagg_keys": {"round": 1, "clients": [0, 1], "cohort": 4, "degree": 0, "threshold": 2,
                    "clip_range": 1.0, "modulus_bits": 32,
                    "round_seed": np.zeros((1, 32), np.uint8), "length": 8},
    "secagg_share": {"members": [0, 1], "adverts": np.zeros((2, 96), np.uint8)},
    "secagg_open": {"clients": [0], "senders": [1], "recipients": [0],
                    "sealed": np.zeros((1, SEALED_SIZE), np.uint8)},
    "secagg_reveal": {"senders": [0], "recipients": [1]},
    "secagg_mask": {"clients": [0], "seeds": [3], "shards": 2, "excluded": [4]},
    "secagg_confirm": {"clients": [0], "survivors": [0, 1], "dropped": [2]},
    "secagg_unmask": {"clients": [0], "survivors": [0, 1], "dropped": [2],
                      "confirmed": [0, 1], "confirm_signers": np.zeros((2, 32), np.uint8),
                      "confirm_signatures": np.zeros((2, 64), np.uint8)},
    "replica_init": {"state": {"w": np.zeros(2)}, "fragments": 2, "bits": 8},
    "inner": {"steps": 10, "shard": 0, "shards": 4, "batch_size": 8, "seed": 7, "step": 20,
              "updated": [1], "update_codes": {"w": np.zeros(2, np.int8)},
              "update_scales": {"w": np.ones(1, np.float32)}, "send": 0},
    "replica_get": {},
    "replica_put": {"anchor": {"w": np.zeros(2)}, "local": {"w": np.ones(2)},
                    "optimizer": {"w/step": 3.0}, "snapshot": {}, "pending": [],
                    "inner_steps": 40, "fragments": 1, "bits": 32},
}


def test_every_well_formed_request_fits():
    assert set(GOOD_REQUESTS) == set(REQUESTS)
    for op, fields in GOOD_REQUESTS.items():
        check_request({"op": op, "seq": 3, **fields})


@pytest.mark.parametrize("request_, why", [
    ({"op": "fit", "shard": 4, "shards": 4, "seed": 0}, "shard must be below shards"),
    ({"op": "fit", "shard": "0", "shards": 4, "seed": 0}, "shard: expected an integer"),
    ({"op": "fit", "shard": 0, "shards": 4, "seed": -1}, "seed = -1 is out of range"),
    ({"op": "fit", "shard": 0, "shards": 4, "seed": 0, "time_budget": math.inf},
     "time_budget = inf is out of range"),
    ({"op": "fit", "shard": 0, "shards": 4, "seed": 0, "state": [1]}, "expected a state"),
    ({"op": "step", "shard": 0, "shards": 1, "seed": 0, "ranks": [0]}, "distinct worker ranks"),
    ({"op": "take"}, "key: missing"),
    ({"op": "take", "key": 1, "keep": 2}, "unknown field(s) 'keep'"),
    ({"op": "launch"}, "unknown trainer request op 'launch'"),
    ({"op": "fit_batch", "fits": [], "weight": "once", "fraction_bits": 32, "label": "c"},
     "fits holds 0 fits"),
    ({"op": "fit_batch", "fits": [{"key": 1, "shard": 0, "shards": 2, "seed": 0}] * 2,
      "weight": "once", "fraction_bits": 32, "label": "c"}, "names a key twice"),
    ({"op": "fit_batch", "fits": [{"key": 1, "shard": 0, "shards": 2, "seed": 0,
                                   "state": {}}],
      "weight": "once", "fraction_bits": 32, "label": "c"}, "unknown field(s) 'state'"),
    ({"op": "fit_batch", "fits": [{"key": 1, "shard": 0, "shards": 2, "seed": 0}],
      "weight": "twice", "fraction_bits": 32, "label": "c"}, "weight"),
    ({"op": "secagg_unmask", "clients": [3], "survivors": [0, 1], "dropped": [2]},
     "clients must be survivors"),
    ({"op": "secagg_unmask", "clients": [1], "survivors": [0, 1], "dropped": [1]},
     "both a survivor and dropped"),
    ({"op": "secagg_share", "members": [0, 1], "adverts": np.zeros((2, 0), np.uint8)},
     "adverts rows are 0 bytes wide; they must be 1 to 65536"),
    ({"op": "secagg_share", "members": [0, 1], "adverts": np.zeros((2, 96), np.uint8),
      "signers": np.zeros((2, 32), np.uint8)},
     "signers and signatures are given together or not at all"),
    ({"op": "secagg_share", "members": [0, 1], "adverts": np.zeros((2, 96), np.uint8),
      "signers": np.zeros((2, 32), np.uint8), "signatures": np.zeros((1, 64), np.uint8)},
     "signatures has 1 rows for 2 entries"),
    ({"op": "secagg_unmask", "clients": [0], "survivors": [0, 1], "dropped": [2],
      "confirmed": [0, 2], "confirm_signers": np.zeros((2, 32), np.uint8),
      "confirm_signatures": np.zeros((2, 64), np.uint8)},
     "a confirmation from a client that is not a survivor"),
    ({"op": "secagg_unmask", "clients": [0], "survivors": [0, 1], "dropped": [2],
      "confirmed": [0, 1]}, "confirmed and confirm_signers are given together"),
    ({"op": "secagg_mask", "clients": [1, 0], "seeds": [0, 0], "shards": 2, "senders": [],
      "recipients": [], "sealed": np.zeros((0, SEALED_SIZE), np.uint8)},
     "clients: client ids must be distinct"),
])
def test_a_bad_request_is_refused_by_the_worker_which_serves_on(request_, why):
    trainer = Trainer(meshkit.plugins.create("task", "synthetic", {"params": 8, "rows": 8}))
    reply = trainer.handle({**request_, "seq": 9})
    assert reply["seq"] == 9 and reply["error"].startswith("protocol error: ")
    assert why in reply["error"]
    # Nothing changed, and the next request is served.
    assert trainer.state is None
    assert trainer.handle({"op": "set_state", "state": {"w": np.zeros(2)}, "seq": 10}) == {
        "seq": 10}


# -- the boundary in a run (the real round engine, in-process workers) ------------------


class HeldOut:
    """The synthetic task with held-out data, so clients can evaluate."""

    def __init__(self) -> None:
        self.inner = meshkit.plugins.create("task", "synthetic",
                                            {"params": 64, "arrays": 2, "rows": 64})

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def test_data(self) -> tuple[Any, Any]:
        return self.inner.train_data()

    def evaluate(self, state: Any, x: Any = None, y: Any = None) -> dict[str, float]:
        return self.inner.evaluate(state)


@attrs.define
class Breaching(Trainer):
    """A worker whose first reply to ``op`` is broken by ``breach``; honest otherwise."""

    op: str = ""
    breach: Callable[[dict[str, Any]], dict[str, Any]] = dict
    breached: bool = False

    def handle(self, request: Any) -> dict[str, Any]:
        reply = super().handle(request)
        if request.get("op") == self.op and not self.breached:
            self.breached = True
            reply = self.breach(reply)
        return reply


BAD = 1  # the breaching rank (data-parallel reads the model back from the first)


def run(strategy: str, options: dict[str, Any], op: str = "",
        breach: Callable[[dict[str, Any]], dict[str, Any]] = dict) -> tuple[Any, list[Any], Any]:
    ranks = [1, 2, 3]
    trainers = {r: (Breaching(HeldOut(), op=op, breach=breach) if r == BAD
                    else Trainer(HeldOut())) for r in ranks}
    reports: list[Any] = []
    ctx = StrategyContext(
        task=HeldOut(), aggregator=meshkit.plugins.create("aggregator", "fedavg"),
        pool=LocalPool(trainers), workers=ranks, rng=np.random.default_rng(0), seed=3,
        outer=meshkit.plugins.create("outer_optimizer", "average"), timeout=30.0,
        on_round=lambda report, state: reports.append(report))
    if op == "take":
        # A small model's results come back with their fits (meshkit.train.INLINE_BYTES):
        # none is kept, so none is taken. Here every result is kept and taken.
        ctx.inline_bytes = 0
    result = meshkit.plugins.create("strategy", strategy, options).run(ctx)
    return result, reports, ctx


FEDERATED = {"rounds": 2, "clients": 6, "evaluate": "both"}
#: A round deadline plays the flat (per-client) engine: fit with keep, then take.
FLAT = {**FEDERATED, "round_timeout": 600}
DATA_PARALLEL = {"rounds": 2, "steps": 1}
#: Which strategy sends each op (step and stage: below, through ctx.call).
SENDS = {"set_state": ("federated", FEDERATED), "fit": ("federated", FLAT),
         "take": ("federated", FLAT), "held_out": ("federated", FEDERATED),
         "fit_batch": ("federated", FEDERATED), "take_partial": ("federated", FEDERATED),
         "evaluate": ("federated", FEDERATED), "grads": ("data-parallel", DATA_PARALLEL),
         "apply": ("data-parallel", DATA_PARALLEL),
         "get_state": ("data-parallel", DATA_PARALLEL)}

_HONEST: dict[str, Any] = {}


def honest(strategy: str, options: dict[str, Any]) -> Any:
    key = repr((strategy, sorted(options.items())))
    if key not in _HONEST:
        _HONEST[key] = run(strategy, options)
    return _HONEST[key]


@pytest.mark.parametrize("op", sorted(SENDS))
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_a_worker_breaking_any_reply_costs_only_its_own_rank(op, data):
    _, field, how, value = data.draw(breaches((op,)))
    if op in ("take", "get_state", "take_partial", "grads") and how == "out of range":
        # Out of range for a model: not the round's keys, shapes or dtypes. (The wire
        # writes a key as a string, so an integer key arrives as an unknown name.)
        value = {"w0": np.zeros(3, np.float16)}
        how = "wrong model"
    strategy, options = SENDS[op]
    result, reports, ctx = run(strategy, options, op,
                               lambda reply: broken(reply, field, how, value)
                               if field in reply or how != "missing" else {"seq": -1})
    if (op, field) in (("take", "state"), ("grads", "gradients")) and how == "wrong model":
        # A contribution that does not match the model may be its client's (or its
        # shard's) fault: the rank sits out each round it sends one (named in `failed`),
        # never dead before quarantine (meshkit.train._failures).
        assert ctx.dead == {}, ctx.dead
        failed = [r.failed for r in reports if r.failed]
        assert failed and all(list(f) == [BAD] and f[BAD].startswith("protocol error")
                              for f in failed), failed
    else:
        # Only the breaching rank was dropped, named with a protocol error.
        assert list(ctx.dead) == [BAD], (op, field, how, ctx.dead)
        assert ctx.dead[BAD].startswith("protocol error"), ctx.dead
        assert sum(r.dropped == (BAD,) for r in reports) == 1
    # The run finished with the others, every client of every round served...
    assert [r.round for r in reports] == [1, 2]
    for report in reports:
        assert report.not_served == {}
        assert BAD not in report.served.values() or report.round == 1 or not ctx.dead
    reference = honest(strategy, options)[0].state
    assert result.state.keys() == reference.keys()
    if strategy == "federated":
        # ... to the very model an honest run gives (a fit is a pure function
        # of the client, whoever serves it; data-parallel shards over the
        # survivors, so its later steps differ).
        for key in reference:
            np.testing.assert_array_equal(result.state[key], reference[key])


def test_a_take_without_state_and_examples_many_are_each_one_dropped_rank():
    # The two crashes issue 21 reports, by name.
    for op, breach in (("take", lambda reply: {"seq": reply["seq"]}),
                       ("fit", lambda reply: {**reply, "examples": "many"})):
        result, reports, ctx = run("federated", FLAT, op, breach)
        assert list(ctx.dead) == [BAD] and "protocol error" in ctx.dead[BAD]
        assert ("state: missing" if op == "take" else "examples: expected an integer") in \
            ctx.dead[BAD]
        assert reports[-1].round == 2 and not reports[-1].not_served


@pytest.mark.parametrize("op, request_", [
    ("step", {"op": "step", "shard": 0, "shards": 1, "seed": 0, "ranks": [2]}),
    ("stage", {"op": "stage", "nodes": ["a"], "x": np.zeros(2)}),
])
def test_a_broken_step_or_stage_reply_is_a_lost_rank_not_a_crash(op, request_):
    class Canned(Trainer):
        def handle(self, request: Any) -> dict[str, Any]:
            return {"seq": request["seq"], "x": "not an array"} if op == "stage" else {
                "seq": request["seq"], "examples": -3, "metrics": {}}

    ctx = StrategyContext(task=None, aggregator=None, pool=LocalPool({2: Canned(None)}),
                          workers=[2], rng=None)
    (reply,) = ctx.call([(2, request_)])
    assert not reply.ok and reply.error.startswith("protocol error")
    assert ctx.dead == {2: reply.error}
    assert ("x: expected an activation" if op == "stage" else "examples = -3") in reply.error


# -- the boundary with real worker processes ---------------------------------------------

ROGUE = '''
import sys

import meshkit.plugins
from meshkit.task import FitResult


class Rogue:
    """The synthetic task, except that on rank 2 every fit returns a model of other shapes."""

    def __init__(self):
        self.inner = meshkit.plugins.create("task", "synthetic", {"params": 256, "rows": 64})
        argv = sys.argv  # the worker process is `meshkit node --rank N ...`
        self.rank = int(argv[argv.index("--rank") + 1]) if "--rank" in argv else 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def fit(self, state, x, y, seed):
        result = self.inner.fit(state, x, y, seed=seed)
        if self.rank == 2:
            return FitResult({k: v[:-1] for k, v in result.state.items()}, result.examples,
                             result.metrics)
        return result
'''


@pytest.mark.slow
def test_a_real_worker_sending_a_model_of_other_shapes_is_dropped_and_named(tmp_path,
                                                                           monkeypatch):
    (tmp_path / "rogue_task.py").write_text(ROGUE)
    monkeypatch.chdir(tmp_path)  # workers import "module:attribute" from here
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.toml", out, workers=3, rounds=2, task="rogue_task:Rogue",
                          extra="clients = 6\nmin_clients = 6", timeout=30.0)
    report = Runner(str(config)).run()
    assert report.ok, report
    # Its fits are checked where it folds them (a batched round), so the rank sits
    # each round out, named, rather than being declared dead (issue 34: a wrong shape
    # may be its client's fault; a rank failing in 3 rounds would be quarantined).
    assert list(report.dropped) == []
    rows = read_metrics(out)
    assert [r["round"] for r in rows] == [1, 2]
    for row in rows:
        assert sorted(map(int, row["served"])) == list(range(6)) and row["not_served"] == {}
        assert 2 not in row["served"].values() and row["dropped"] == []
        assert list(row["failed"]) == ["2"] and "ProtocolError" in row["failed"]["2"]
        assert "where the model has an array float32" in row["failed"]["2"]
    summary = json.loads((out / "summary.json").read_text())
    assert [entry.split(":")[0] for entry in summary["failed"]["2"]] == ["round 1", "round 2"]


# -- docs/protocol.md is the schema --------------------------------------------------------

def documented_tables() -> dict[tuple[str, str], list[tuple[str, ...]]]:
    """§7.1's tables: (op, "request" | "reply") -> rows of (field, type, required, meaning)."""
    return protocol_doc.documented_tables("### 7.1 Every message", "## 8. ",
                                          r"#### `(\w+)` (request|reply)")


def test_the_protocol_page_lists_every_message_field_by_field_as_the_schema_does():
    documented = documented_tables()
    declared = {**{(op, "request"): cls for op, cls in REQUESTS.items()},
                **{(op, "reply"): cls for op, cls in REPLIES.items()},
                ("error", "reply"): messages.ErrorReply}
    assert sorted(documented) == sorted(declared)
    for key, cls in declared.items():
        assert documented[key] == messages.field_table(cls), key


def test_the_protocol_page_would_catch_a_field_added_to_the_code():
    # The check above can fail: the doc's table lacks a field the code has.
    documented = documented_tables()[("fit", "reply")]
    changed = attrs.make_class("FitReply", {**{f.name: attrs.field(
        default=f.default, metadata=f.metadata) for f in attrs.fields(FitReply)},
        "clipped": attrs.field(default=None, metadata={"wire": "float", "doc": "x"})})
    assert documented != messages.field_table(changed)


def test_the_protocol_page_lists_every_capability_a_node_sends():
    text = protocol_doc.PROTOCOL.read_text()
    block = text[text.index("### 6.1"):text.index("### 6.2")]
    listed = set(re.findall(r'"(\w+)":', block.split("```")[1])) - {"caps"}
    assert listed == {f.name for f in attrs.fields(NodeCaps)}


def test_a_task_reporting_a_nan_metric_is_the_tasks_error_not_a_breach():
    class Diverged:
        def __init__(self) -> None:
            self.inner = meshkit.plugins.create("task", "synthetic", {"params": 8, "rows": 8})

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def fit(self, state: Any, x: Any, y: Any, seed: int) -> Any:
            result = self.inner.fit(state, x, y, seed=seed)
            return attrs.evolve(result, metrics={"train_loss": math.nan})

    trainer = Trainer(Diverged())
    trainer.handle({"op": "set_state", "seq": 1, "state": trainer.task.init_state(0)})
    reply = trainer.handle({"op": "fit", "seq": 2, "shard": 0, "shards": 1, "seed": 0})
    # The model's divergence (`reason = "nonfinite"`: the run's on_nonfinite decides),
    # not a reply that would cost this honest worker its rank.
    assert reply == {"error": "fit: the task's fit reported train_loss = nan; "
                              "metrics must be finite numbers (a diverged model? lower the "
                              "learning rate, or set [strategy] on_nonfinite = "
                              "\"skip-round\")", "reason": "nonfinite", "seq": 2}
    assert check_reply({"op": "fit"}, reply, 2) is reply
