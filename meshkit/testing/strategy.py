"""The strategy contract suite.

Subclass :class:`StrategyContract` and point it at your strategy::

    class TestMyLoop(StrategyContract):
        component = "my-loop"
        options = {"rounds": 2}     # keep it short: every test runs the loop
        workers = 2

Each test drives the strategy through a real
:class:`meshkit.StrategyContext` whose workers are in-process trainers
(:class:`meshkit.train.LocalPool`) running ``task`` (the shipped ``digits``
task by default), so no process or socket is involved.

What it checks: ``run(ctx)`` returns the final state after reporting every
round once, in order, with a JSON-serialisable report; the same seed gives
the same model bit for bit, and so does any order in which the workers'
answers arrive (``LocalPool(order=...)`` shuffles them); a stop request ends
the run between rounds with :class:`meshkit.train.RunStopped`; a worker that
stops answering is declared dead in the pool's ledger and never sent
anything again, the run completing without it (every folded client served
by a live worker) or stopping with a :class:`meshkit.MeshError` naming it;
with many workers the coordinator never holds more than a few whole
contributions at once (``max_held``: the round engine's window plus what the
fold and the round's own state keep); the final state is a valid meshkit
state.
"""

from __future__ import annotations

import json
from typing import Any, Callable, ClassVar, Mapping

import numpy as np
import pytest

from meshkit import plugins
from meshkit.errors import MeshError
from meshkit.testing import make_plugin_set
from meshkit.testing.support import ContractBase, assert_states_identical, json_leaves_ok
from meshkit.train import DEFAULT_WINDOW, LocalPool, RunStopped, StrategyContext

__all__ = ["StrategyContract"]


class _Recorder:
    """``on_round`` that keeps every report (``ctx.on_round.reports``)."""

    def __init__(self, then: Callable[[Any, Mapping[str, Any]], None] | None) -> None:
        self.reports: list[Any] = []
        self._then = then

    def __call__(self, report: Any, state: Mapping[str, Any]) -> None:
        self.reports.append(report)
        if self._then is not None:
            self._then(report, state)


def _reports(ctx: Any) -> list[Any]:
    return ctx.on_round.reports


class StrategyContract(ContractBase):
    """Conformance tests every meshkit strategy must pass."""

    kind: ClassVar[str] = "strategy"

    #: The strategy's options; keep ``rounds`` small.
    options: ClassVar[Mapping[str, Any]] = {"rounds": 2}
    #: Worker ranks 1..workers serve the strategy.
    workers: ClassVar[int] = 2
    #: The task the workers train (a registered name) and its options.
    task: ClassVar[str] = "digits"
    task_options: ClassVar[Mapping[str, Any]] = {}
    #: Aggregator and outer optimizer handed to the strategy.
    aggregator: ClassVar[str] = "fedavg"
    outer_optimizer: ClassVar[str] = "average"
    seed: ClassVar[int] = 0
    #: Workers of the memory check, and the most whole states (client models,
    #: gradients) the coordinator may hold at once among their replies.
    memory_workers: ClassVar[int] = 8
    max_held: ClassVar[int] = DEFAULT_WINDOW + 2
    #: The virtual clock's durations handed to the strategy (a
    #: :class:`meshkit.simulation.Speeds`; None: real time). An asynchronous
    #: strategy is order-independent only on the clock.
    speeds: ClassVar[Any] = None

    # -- building a context --------------------------------------------------

    def _create(self, kind: str, name: str, options: Mapping[str, Any] | None = None) -> Any:
        if self.plugins is not None:
            return make_plugin_set(*self.plugins, entry_points=True).create(kind, name, options)
        return plugins.create(kind, name, options)

    def make_context(self, *, fail: Callable[[int, Mapping[str, Any]], str | None] | None = None,
                     on_round: Callable[[Any, Mapping[str, Any]], None] | None = None,
                     seed: int | None = None, order: Any = None,
                     workers: int | None = None) -> Any:
        """A StrategyContext over in-process workers.

        ``fail`` simulates lost workers, ``order`` (a ``numpy.random.Generator``)
        shuffles the order their answers arrive in, ``workers`` overrides the
        class's worker count.
        """
        seed = self.seed if seed is None else seed
        build_task = lambda: self._create("task", self.task, dict(self.task_options))  # noqa: E731
        ranks = list(range(1, (self.workers if workers is None else workers) + 1))
        ctx = StrategyContext(
            task=build_task(), aggregator=self._create("aggregator", self.aggregator),
            pool=LocalPool.of(build_task, ranks, fail=fail, order=order), workers=ranks,
            rng=np.random.default_rng(seed), seed=seed,
            outer=self._create("outer_optimizer", self.outer_optimizer),
            outer_name=self.outer_optimizer, strategy_name=self.component or "",
            timeout=30.0, on_round=_Recorder(on_round), speeds=self.speeds)
        return ctx

    @property
    def rounds(self) -> int:
        return int(self.options.get("rounds", 1))

    # -- tests -----------------------------------------------------------------

    def test_a_run_reports_every_round_once_in_order(self) -> None:
        ctx = self.make_context()
        result = self.make().run(ctx)
        numbers = [r.round for r in _reports(ctx)]
        assert numbers == list(range(1, self.rounds + 1)), (
            f"expected one report per round 1..{self.rounds}, got rounds {numbers}")
        for report in _reports(ctx):
            assert report.rounds == self.rounds, report
            assert set(report.answered) <= set(ctx.workers), (
                f"round {report.round}: answered {report.answered} are not workers")
        assert result.rounds == self.rounds
        assert isinstance(result.state, Mapping) and result.state, (
            f"run() must return the final state, got {result.state!r}")

    def test_round_reports_are_json_serialisable(self) -> None:
        ctx = self.make_context()
        self.make().run(ctx)
        for report in _reports(ctx):
            json.dumps(report.to_json(), allow_nan=False)

    def test_the_final_state_is_a_valid_state(self) -> None:
        result = self.make().run(self.make_context())
        problems = json_leaves_ok(dict(result.state), "final state")
        assert not problems, "; ".join(problems)

    def test_the_same_seed_gives_the_same_model(self) -> None:
        first = self.make().run(self.make_context())
        second = self.make().run(self.make_context())
        assert_states_identical(dict(second.state), dict(first.state),
                                what="two runs with the same seed")

    def test_the_order_answers_arrive_in_does_not_change_the_model(self) -> None:
        first = self.make().run(self.make_context())
        for shuffle in (1, 2, 3):
            again = self.make().run(self.make_context(order=np.random.default_rng(shuffle)))
            assert_states_identical(
                dict(again.state), dict(first.state),
                what=f"a run whose workers answered in shuffled order #{shuffle} (fold "
                     f"contributions in client order, not arrival order)")

    def test_the_coordinator_holds_a_bounded_number_of_contributions(self) -> None:
        ctx = self.make_context(workers=self.memory_workers)
        # Counted as for a large model: the round engine may hold a small model's results
        # beyond its window (meshkit.train.INLINE_BYTES), which is not what this checks.
        ctx.inline_bytes = 0
        self.make().run(ctx)
        assert ctx.pool.peak_held <= self.max_held, (
            f"with {self.memory_workers} workers the coordinator held "
            f"{ctx.pool.peak_held} whole states at once (at most {self.max_held} "
            f"allowed): fold contributions as they come (meshkit.train.fold_round) "
            f"instead of collecting every reply first")

    def test_a_stop_request_ends_the_run_between_rounds(self) -> None:
        if self.rounds < 2:
            pytest.skip("needs at least two rounds")
        holder: dict[str, Any] = {}
        ctx = self.make_context(on_round=lambda report, state: holder["ctx"].stop.set())
        holder["ctx"] = ctx
        with pytest.raises(RunStopped):
            self.make().run(ctx)
        assert [r.round for r in _reports(ctx)] == [1], (
            f"the stop was requested after round 1, but rounds "
            f"{[r.round for r in _reports(ctx)]} ran")

    def test_a_worker_that_stops_answering_is_dropped_or_stops_the_run(self) -> None:
        lost = self.workers
        died_at: list[int] = []

        def fail(rank: int, request: Mapping[str, Any]) -> str | None:
            if rank != lost:
                return None
            if not died_at:
                died_at.append(len(ctx.pool.log))
            return "vanished (contract test)"

        ctx = self.make_context(fail=fail)
        try:
            self.make().run(ctx)
        except MeshError as exc:
            assert "vanished" in str(exc) or str(lost) in str(exc), (
                f"the error should say which worker was lost and why: {exc}")
            return
        if not died_at:
            return  # the strategy never asked it (sampling), so nothing to drop
        assert lost in ctx.dead, (
            f"rank {lost} never answered, yet the run completed without the ledger "
            f"declaring it dead (dead: {ctx.dead})")
        after = [request.get("op") for rank, request in ctx.pool.log[died_at[0]:]
                 if rank == lost]
        assert not after, (
            f"rank {lost} was declared dead, yet it was sent {after} afterwards: hand "
            f"work only to ctx.live")
        for report in _reports(ctx):
            assert lost not in report.answered, (
                f"rank {lost} never answered but round {report.round} lists it as answered")
            assert lost not in report.served.values(), (
                f"round {report.round} says rank {lost} served {report.served}")
            if report.served:
                assert tuple(report.served) == tuple(report.clients), (
                    f"round {report.round}: served {report.served} does not match the "
                    f"clients folded {report.clients}")
