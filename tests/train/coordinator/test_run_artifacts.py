"""report.png: whole-number round ticks, and one round drawn as one labelled point on its tick."""

from __future__ import annotations

import json

import pytest

from meshkit.train._coordinator.artifacts import figure, plot

matplotlib = pytest.importorskip("matplotlib")


def rows(rounds, strategy="data-parallel"):
    return [{"round": r, "rounds": max(rounds), "strategy": strategy, "answered": [1],
             "dropped": [], "clients": [], "examples": 10, "seconds": 0.1,
             "loss": 1.0 / (r + 1), "accuracy": 0.5 + 0.1 * r} for r in rounds]


def visible_ticks(ax):
    low, high = ax.get_xlim()
    return [t for t in ax.get_xticks() if low <= t <= high]


@pytest.mark.parametrize("rounds", [[1, 2, 3], [1, 2], [4, 5, 6, 7, 8, 9, 10, 11, 12]])
def test_round_ticks_are_whole_numbers(rounds):
    fig = figure(rows(rounds))
    fig.canvas.draw()
    for ax in fig.axes:
        ticks = visible_ticks(ax)
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


@pytest.mark.parametrize("only", [1, 0])
def test_a_single_round_is_one_point_centred_on_its_own_tick(only):
    fig = figure(rows([only], strategy="model-parallel"))
    fig.canvas.draw()
    for ax in fig.axes:
        assert visible_ticks(ax) == [only]
        low, high = ax.get_xlim()
        assert low < only < high and (only - low) == pytest.approx(high - only)
        assert [t.get_text() for t in ax.texts], "the lone value is labelled"


def test_plot_writes_the_png_and_never_raises_on_bad_metrics(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows([1])))
    assert plot(tmp_path) == tmp_path / "report.png"
    assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "metrics.jsonl").write_bytes(b"\xff\xfe not utf-8\n")
    assert plot(tmp_path) is None  # logged; the run's own outcome is what the user sees
