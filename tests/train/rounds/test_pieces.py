"""The flat round pulling contributions in pieces (issue 39): the same bits, bounded pulls.

In-process (LocalPool); tests/train/rounds/test_pieces_processes.py has real workers.
"""

from __future__ import annotations

import numpy as np
import pytest

import meshkit.plugins

from meshkit.train import fold_round
from tests.support.rounds import fits, make_ctx, same_bytes

#: The synthetic task's model here: two float32 arrays of 2048 elements (16 KiB).
MODEL_BYTES = 4096 * 4


def played(clients: int, workers: int, piece_bytes: int, *, fail=None, order=None,
           aggregator: str = "fedavg", retain: int = 1):
    ctx = make_ctx(workers=workers, fail=fail, order=order, aggregator=aggregator)
    ctx.aggregator = meshkit.plugins.create("aggregator", aggregator, {"retain": retain})
    ctx.piece_bytes = piece_bytes
    folded = fold_round(ctx, fits(clients), state=ctx.task.init_state(0), batch=False)
    return ctx, folded


def takes(ctx) -> list[dict]:
    return [req for _, req in ctx.pool.log if req["op"] == "take"]


@pytest.mark.parametrize("clients", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("piece_bytes", [1000, 4096, MODEL_BYTES - 4])
def test_pieces_give_the_whole_contribution_rounds_bits(clients, piece_bytes):
    """The bits of the whole-contribution round that sums one at a time (``retain = 0``):
    a fold in pieces holds no contribution to pair it with the next (issue 36)."""
    _, whole = played(clients, 3, MODEL_BYTES, retain=0)
    ctx, pieces = played(clients, 3, piece_bytes, order=np.random.default_rng(clients))
    assert same_bytes(pieces.result, whole.result)
    assert pieces.served.keys() == whole.served.keys() and pieces.not_served == {}
    pulled = takes(ctx)
    assert pulled and all("piece" in req for req in pulled), "every result pulled in pieces"
    count = -(-MODEL_BYTES // piece_bytes)
    assert len(pulled) >= clients * count


def test_a_model_within_one_piece_plays_the_round_as_before():
    ctx, _ = played(3, 3, MODEL_BYTES)
    assert all("piece" not in req for req in takes(ctx))


def test_the_test_can_fail_a_fold_in_another_order_differs():
    _, whole = played(4, 2, MODEL_BYTES)
    ctx = make_ctx(workers=2)
    state = ctx.task.init_state(0)
    x = [ctx.task.fit(state, *ctx.task.train_data(), seed=s).state for s in range(4)]
    fold = ctx.aggregation_begin()
    for i in (3, 2, 1, 0):
        fold.add(x[i], 1.0)
    assert not same_bytes(fold.result(), whole.result)


def test_no_take_answer_is_larger_than_a_piece():
    ctx, _ = played(4, 2, 1000)
    for trainer in ctx.pool.trainers.values():
        assert not trainer.kept, "every piece was taken: nothing left on a worker"
    sizes = []
    original = ctx.pool

    class Watch(type(original)):
        def receive(self, block=True, until=None):
            reply = super().receive(block) if until is None else super().receive(until=until)
            if reply is not None and reply.payload and "state" in reply.payload:
                sizes.append(sum(v.nbytes for v in reply.payload["state"].values()
                                 if isinstance(v, np.ndarray)))
            return reply

    ctx2 = make_ctx(workers=2)
    ctx2.piece_bytes = 1000
    ctx2.pool = Watch({r: ctx2.pool.trainers[r] for r in (1, 2)})
    fold_round(ctx2, fits(4), state=ctx2.task.init_state(0), batch=False)
    assert sizes and max(sizes) <= 1000


def test_a_worker_lost_before_its_partial_reached_the_sum_is_dropped_and_its_key_served_again():
    key = 0  # the round's first contribution: none of it is in the sum until it is whole
    _, whole = played(4, 4, MODEL_BYTES, retain=0)

    killed = []

    def fail(rank, request):
        # The first worker asked for piece 3 of the contribution dies there.
        if request["op"] == "take" and request["key"] == key and request.get("piece") == 3 \
                and killed in ([], [rank]):
            killed[:] = [rank]
            return "killed"
        return None

    ctx, folded = played(4, 4, 1000, fail=fail)
    assert len(ctx.dead) == 1
    dead = next(iter(ctx.dead))
    assert folded.served[key] != dead and folded.not_served == {}
    assert same_bytes(folded.result, whole.result), "no partial in the result"
    assert [req.get("piece") for req in takes(ctx) if req["key"] == key][:4] == [0, 1, 2, 3]


@pytest.mark.parametrize("key", [1, 2])
def test_a_worker_lost_after_part_of_its_contribution_was_summed_replays_the_round_whole(
        caplog, key):
    """The replay sums one at a time too: the bits of the round in pieces (issue 36)."""
    _, whole = played(4, 4, MODEL_BYTES, retain=0)

    killed = []

    def fail(rank, request):
        if request["op"] == "take" and request["key"] == key and request.get("piece") == 3 \
                and killed in ([], [rank]):
            killed[:] = [rank]
            return "killed"
        return None

    ctx, folded = played(4, 4, 1000, fail=fail)
    assert len(ctx.dead) == 1 and folded.not_served == {}
    assert same_bytes(folded.result, whole.result), "no partial in the result"
    assert "after part of it was summed" in caplog.text and "played again" in caplog.text
    # The replay folds whole contributions: the window's result comes with its fit.
    assert any(req["op"] == "fit" and "keep" not in req for _, req in ctx.pool.log)


def test_a_piece_that_does_not_fit_the_model_costs_its_rank():
    _, whole = played(3, 3, MODEL_BYTES, retain=0)
    ctx = make_ctx(workers=3)
    ctx.piece_bytes = 1000
    # A worker whose results come back as float64: every piece's dtype is wrong.
    original = ctx.pool.trainers[3].task.fit

    def fit64(*args, **kw):
        result = original(*args, **kw)
        return type(result)(state={k: np.asarray(v, np.float64) for k, v in result.state.items()},
                            examples=result.examples, metrics=result.metrics)

    ctx.pool.trainers[3].task.fit = fit64
    folded = fold_round(ctx, fits(3), state=ctx.task.init_state(0), batch=False)
    assert 3 in folded.failed and 3 not in folded.served.values()
    assert same_bytes(folded.result, whole.result)


@pytest.mark.parametrize("value", ["100", "2.5", '"big"', str(1 << 41)])
def test_a_bad_piece_size_is_a_config_error_naming_the_file_table_and_key(tmp_path, value):
    from meshkit.config import load_config
    from meshkit.errors import ConfigError

    path = tmp_path / "run.toml"
    path.write_text(f'[run]\ntask = "meshkit_tasks.synthetic:SyntheticTask"\n\n'
                    f'[mesh]\nworkers = 2\npiece_bytes = {value}\n')
    with pytest.raises(ConfigError, match=r"run\.toml.*\[mesh\].*piece_bytes"):
        load_config(path)



@pytest.mark.parametrize("bad", [np.nan, 1e30])
def test_a_non_finite_or_out_of_range_piece_drops_its_sender_as_the_whole_round_does(bad):
    def hostile(piece_bytes):
        ctx = make_ctx(workers=3)
        # Whole contributions summed one at a time, as pieces (and their replay) are.
        ctx.aggregator = meshkit.plugins.create("aggregator", "fedavg", {"retain": 0})
        ctx.piece_bytes = piece_bytes
        original = ctx.pool.trainers[2].task.fit

        def fit(*args, **kw):
            result = original(*args, **kw)
            state = {k: np.array(v, copy=True) for k, v in result.state.items()}
            first = min(state)
            state[first][-5] = bad  # in a piece after the first
            return type(result)(state=state, examples=result.examples, metrics=result.metrics)

        ctx.pool.trainers[2].task.fit = fit
        return fold_round(ctx, fits(4), state=ctx.task.init_state(0), batch=False)

    whole, pieces = hostile(MODEL_BYTES), hostile(1000)
    assert 2 in whole.failed and 2 in pieces.failed
    assert pieces.served == whole.served and 2 not in pieces.served.values()
    assert same_bytes(pieces.result, whole.result)


def test_a_contribution_in_hundreds_of_pieces_is_not_cut_short_by_the_loops_bound():
    # The scheduler's loop bound counts replies: each piece is one (a 2 GB model is 57).
    _, whole = played(2, 2, MODEL_BYTES)
    ctx, pieces = played(2, 2, 64)
    assert len(takes(ctx)) == 2 * MODEL_BYTES // 64
    assert same_bytes(pieces.result, whole.result)


def test_the_next_piece_is_asked_for_before_the_one_that_arrived_is_folded(monkeypatch):
    # Two pieces of a contribution in flight (pieces.AHEAD), never more: a piece
    # travels while the one before it is folded, and the result is unchanged.
    from meshkit.train._pool import LocalPool
    from meshkit.train._rounds.pieces import AHEAD

    _, whole = played(3, 2, MODEL_BYTES)
    ctx = make_ctx(workers=2)
    ctx.piece_bytes = 1000
    in_flight: dict[int, int] = {}
    most: list[int] = [0]
    tickets: dict[int, int] = {}
    send, receive = LocalPool.send, LocalPool.receive

    def counted_send(self, rank, request, timeout):
        ticket = send(self, rank, request, timeout)
        if request["op"] == "take":
            tickets[ticket] = rank
            in_flight[rank] = in_flight.get(rank, 0) + 1
            most[0] = max(most[0], in_flight[rank])
        return ticket

    def counted_receive(self, *args, **kw):
        reply = receive(self, *args, **kw)
        if reply is not None and reply.seq in tickets:
            in_flight[tickets.pop(reply.seq)] -= 1
        return reply

    from meshkit.aggregation import PieceFold
    at_fold: list[tuple[int, int]] = []  # (piece, takes in flight when it is folded)
    fold_piece = PieceFold.piece

    def counted_piece(self, index, parts):
        at_fold.append((index, sum(in_flight.values())))
        return fold_piece(self, index, parts)

    monkeypatch.setattr(LocalPool, "send", counted_send)
    monkeypatch.setattr(LocalPool, "receive", counted_receive)
    monkeypatch.setattr(PieceFold, "piece", counted_piece)
    folded = fold_round(ctx, fits(3), state=ctx.task.init_state(0), batch=False)
    assert same_bytes(folded.result, whole.result)
    assert most[0] == AHEAD == 2
    # While piece k is folded, pieces k + 1 and k + 2 are already asked for (the last
    # pieces: as many as are left), not only k + 1.
    count = -(-MODEL_BYTES // 1000)
    assert at_fold and all(flying == min(AHEAD, count - 1 - index)
                           for index, flying in at_fold), at_fold
    pieces = -(-MODEL_BYTES // 1000)
    assert len(takes(ctx)) == 3 * pieces, "each piece asked for once"
