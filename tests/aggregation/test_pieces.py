"""A contribution folded piece by piece gives the very bits of the whole-contribution fold that
sums one contribution at a time (``retain = 0``; issues 39 and 36), and holds no copy of one."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from meshkit.aggregation import MeanFold
from meshkit.aggregation._pieces import PieceFold, float_layout, one_at_a_time, piece_plan
from meshkit.errors import AggregationError
from meshkit.state import BFLOAT16


def model(seed: int, scale: float = 1.0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w": (rng.standard_normal((37, 11)) * scale).astype(np.float32),
        "b": (rng.standard_normal(5) * scale).astype(np.float32),
        "d": (rng.standard_normal(130) * scale).astype(np.float64),
        "h": (rng.standard_normal(70) * scale).astype(np.float32).astype(BFLOAT16),
        "steps": np.array([3, 4], dtype=np.int64),
        "meta": {"lr": 0.1 * (seed + 1), "name": "m"},
    }


def cut(state: dict, plan: list) -> list[dict]:
    floats = {k for k, _, _ in float_layout(state)}
    pieces = []
    for i, piece in enumerate(plan):
        parts = {key: np.asarray(state[key]).reshape(-1)[lo:hi] for key, lo, hi in piece}
        if i == 0:
            parts.update({k: v for k, v in state.items() if k not in floats})
        pieces.append(parts)
    return pieces


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k, x in a.items():
        y = b[k]
        if isinstance(x, np.ndarray):
            if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
                return False
        elif x != y:
            return False
    return True


def by_pieces(states, weights, piece_bytes, **options):
    fold = MeanFold(**options)
    plan = piece_plan(float_layout(states[0]), piece_bytes)
    pieces = PieceFold(fold, states[0], plan)
    for i, (state, w) in enumerate(zip(states, weights)):
        pieces.begin(w, f"c{i}")
        for j, parts in enumerate(cut(state, plan)):
            pieces.piece(j, parts)
        pieces.end()
    return pieces.result(), len(plan)


def whole(states, weights, **options):
    """The whole-contribution fold; by default one at a time, as a fold in pieces sums."""
    fold = MeanFold(**{"retain": 0, **options})
    for i, (state, w) in enumerate(zip(states, weights)):
        fold.add(state, w, source=f"c{i}")
    return fold.result()


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("piece_bytes", [4, 100, 1000, 1 << 20])
@pytest.mark.parametrize("options", [{}, {"wide": True}, {"retain": 0}, {"weighted": False}])
def test_pieces_give_the_whole_folds_bits(count, piece_bytes, options):
    states = [model(i) for i in range(count)]
    weights = [1.0] * count if options.get("weighted") is False else [
        float(3 + 2 * i) for i in range(count)]
    got, pieces = by_pieces(states, weights, piece_bytes, **options)
    assert same(got, whole(states, weights, **{**options, "retain": 0}))
    if piece_bytes == 100:
        assert pieces > 10, "boundaries fall inside arrays"


def test_equal_weights_take_the_plain_add_path_and_still_match():
    states = [model(i) for i in range(6)]
    got, _ = by_pieces(states, [2.0] * 6, 96)
    assert same(got, whole(states, [2.0] * 6))


def test_the_test_can_fail_a_different_pairing_gives_other_bits():
    states = [model(i) for i in range(4)]
    pairs = whole(states, [1.0, 3.0, 5.0, 7.0], retain=1)
    one_by_one = whole(states, [1.0, 3.0, 5.0, 7.0])
    assert not same(pairs, one_by_one)
    got, _ = by_pieces(states, [1.0, 3.0, 5.0, 7.0], 200)  # a retain = 1 fold, in pieces
    assert same(got, one_by_one) and not same(got, pairs)


def test_a_fold_in_pieces_holds_no_copy_of_a_contribution():
    """Issue 36: the pairs' buffer (a later pair's first member, copied: its pieces' buffers
    are reused) was one model copy of coordinator memory. Measured by allocation: a round
    of five contributions in pieces allocates the sum and cache-sized scratch, nothing
    model-sized besides -- with the buffer it allocated a second model (this fails)."""
    size = 1 << 20  # 4 MiB of float32
    rng = np.random.default_rng(3)
    states = [{"w": rng.standard_normal(size, dtype=np.float32)} for _ in range(5)]
    plan = piece_plan(float_layout(states[0]), 256 << 10)
    tracemalloc.start()
    try:
        pieces = PieceFold(MeanFold(), states[0], plan)  # retain = 1, the default
        for i, state in enumerate(states):
            pieces.begin(float(i + 1), f"c{i}")
            for j, parts in enumerate(cut(state, plan)):  # views: no allocation
                pieces.piece(j, parts)
            pieces.end()
        result = pieces.result()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    model_bytes = 4 * size
    assert peak < model_bytes + model_bytes // 2, f"{peak} bytes at the peak"
    assert same(result, whole(states, [1.0, 2.0, 3.0, 4.0, 5.0]))


def test_a_fold_that_groups_more_is_refused_in_pieces():
    state = model(0)
    plan = piece_plan(float_layout(state), 200)
    for retain in (2, None):
        with pytest.raises(ValueError, match="one contribution at a time"):
            PieceFold(MeanFold(retain=retain), state, plan)
    started = MeanFold()
    started.add(state, 1.0)
    with pytest.raises(ValueError):
        one_at_a_time(started)


def test_a_plan_cuts_inside_arrays_and_keeps_every_piece_within_its_bytes():
    layout = float_layout(model(0))
    plan = piece_plan(layout, 100)
    sizes = {k: n for k, _, n in layout}
    seen = {k: 0 for k in sizes}
    itemsize = {k: s for k, s, _ in layout}
    for piece in plan:
        assert sum((hi - lo) * itemsize[k] for k, lo, hi in piece) <= 100
        for key, lo, hi in piece:
            assert lo == seen[key] and hi > lo
            seen[key] = hi
    assert seen == sizes
    assert any(lo > 0 for piece in plan for _, lo, _ in piece)


def test_a_contribution_given_up_before_the_sum_holds_it_leaves_no_trace():
    states = [model(i) for i in range(5)]
    weights = [1.0, 2.0, 3.0, 4.0, 5.0]
    fold = MeanFold()
    plan = piece_plan(float_layout(states[0]), 200)
    pieces = PieceFold(fold, states[0], plan)
    junk = model(99, scale=7.0)
    for i, (state, w) in enumerate(zip(states, weights)):
        if i == 0:  # the first of the round: nothing of it is in the sum until it is whole
            pieces.begin(9.0, "lost")
            for j, parts in enumerate(cut(junk, plan)[:2]):
                pieces.piece(j, parts)
            assert pieces.abort() is True
        pieces.begin(w, f"c{i}")
        for j, parts in enumerate(cut(state, plan)):
            pieces.piece(j, parts)
        pieces.end()
    assert same(pieces.result(), whole(states, weights))


def test_a_contribution_given_up_after_part_of_it_was_summed_breaks_the_fold():
    states = [model(i) for i in range(2)]
    fold = MeanFold()
    plan = piece_plan(float_layout(states[0]), 200)
    pieces = PieceFold(fold, states[0], plan)
    pieces.begin(1.0, "c0")
    for j, parts in enumerate(cut(states[0], plan)):
        pieces.piece(j, parts)
    pieces.end()
    pieces.begin(1.0, "c1")
    pieces.piece(0, cut(states[1], plan)[0])
    assert pieces.abort() is False
    with pytest.raises(AggregationError, match="given up half-way"):
        pieces.result()


@pytest.mark.parametrize("bad", [np.nan, np.inf, 1e30])
def test_non_finite_and_out_of_range_values_are_refused_naming_the_sender(bad):
    states = [model(i) for i in range(3)]
    states[1]["w"] = states[1]["w"].copy()
    states[1]["w"][20, 3] = bad
    with pytest.raises(AggregationError) as whole_error:
        whole(states, [1.0, 2.0, 3.0])
    with pytest.raises(AggregationError) as piece_error:
        by_pieces(states, [1.0, 2.0, 3.0], 256)
    assert "c1" in str(piece_error.value) and piece_error.value.key == "w"
    assert piece_error.value.contributors == whole_error.value.contributors == ["c1"]


def test_a_piece_that_does_not_fit_the_plan_is_refused_before_anything_is_summed():
    states = [model(0), model(1)]
    plan = piece_plan(float_layout(states[0]), 200)
    pieces = PieceFold(MeanFold(), states[0], plan)
    pieces.begin(1.0, "c0")
    parts = cut(states[0], plan)
    with pytest.raises(AggregationError, match="planned arrays"):
        pieces.piece(0, {k: v for k, v in parts[0].items() if k != plan[0][0][0]})
    wrong = dict(parts[0])
    key = plan[0][0][0]
    wrong[key] = wrong[key].astype(np.float64 if wrong[key].dtype != np.float64 else np.float32)
    with pytest.raises(AggregationError, match="flat"):
        pieces.piece(0, wrong)
    with pytest.raises(AggregationError, match="other entries"):
        pieces.piece(0, {k: v for k, v in parts[0].items() if k != "meta"})


def test_weights_follow_the_means_own_rule_and_its_refusals():
    """The piece fold asks the mean for each contribution's factor (MeanFold._admit): a
    fold that is closed, a bad or (unweighted) unequal weight is refused in the mean's own
    words, and a weight the mean would rebase its sum onto is refused explicitly."""
    states = [model(0), model(1)]
    plan = piece_plan(float_layout(states[0]), 1024)

    unweighted = PieceFold(MeanFold(weighted=False), states[0], plan)
    unweighted.begin(2.0, "c0")
    for j, parts in enumerate(cut(states[0], plan)):
        unweighted.piece(j, parts)
    unweighted.end()
    with pytest.raises(AggregationError, match="c1 has weight 3 but c0 has 2; allreduce"):
        unweighted.begin(3.0, "c1")
    with pytest.raises(AggregationError, match="weight"):
        PieceFold(MeanFold(), states[0], plan).begin(-1.0, "c0")

    rebased = PieceFold(MeanFold(), states[0], plan)
    rebased.begin(1.0, "c0")
    for j, parts in enumerate(cut(states[0], plan)):
        rebased.piece(j, parts)
    rebased.end()
    with pytest.raises(AggregationError, match="rebased then, which needs whole"):
        rebased.begin(2.0 ** 41, "c1")
    # The whole-contribution fold takes the same weight (it rebases its sum).
    fold = MeanFold()
    fold.add(states[0], 1.0, source="c0")
    fold.add(states[1], 2.0 ** 41, source="c1")
    assert fold.count == 2
