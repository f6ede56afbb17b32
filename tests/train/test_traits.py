"""``StrategyTraits``: the record the kernel reads of a strategy, its safe reading, and a
third-party strategy that declares what it needs (spmd, private rounds) or does not."""

from __future__ import annotations

import pytest

import meshkit
import meshkit.plugins
from meshkit.train import StrategyTraits, check_collective, strategy_traits


class Bare:
    """A third-party strategy that declares nothing."""

    def run(self, ctx):  # pragma: no cover - never run here
        raise AssertionError


class Declared(Bare):
    """A third-party strategy that says it plays spmd rounds over 12 clients."""

    traits = StrategyTraits(partitioned=True, collective=True, rounds=2, clients=12)


def test_a_strategy_that_declares_nothing_gets_the_safe_reading():
    traits = strategy_traits(Bare())
    assert traits == StrategyTraits()
    assert not (traits.partitioned or traits.private or traits.secure or traits.clocked
                or traits.collective)
    assert traits.rounds is None and traits.check is None and traits.extra_ranks == ()


def test_traits_that_are_not_a_strategytraits_are_the_authors_mistake():
    class Wrong(Bare):
        traits = {"collective": True}

    with pytest.raises(TypeError, match="declare it as meshkit.StrategyTraits"):
        strategy_traits(Wrong())
    with pytest.raises(TypeError, match="StrategyTraits.private must be True or False"):
        StrategyTraits(private=1)
    with pytest.raises(TypeError, match="StrategyTraits.check must be a callable or None"):
        StrategyTraits(check="yes")


def test_a_refusal_quotes_the_strategys_own_reason_for_a_trait_it_lacks():
    traits = StrategyTraits(why_not={"private": "no sampled rounds"})
    assert traits.lacks("private") == ("it lacks the trait StrategyTraits.private "
                                       "(no sampled rounds)")
    assert traits.lacks("secure") == "it lacks the trait StrategyTraits.secure"


def test_every_builtin_strategy_declares_its_traits_from_its_options():
    federated = meshkit.plugins.create("strategy", "federated",
                                       {"rounds": 3, "clients": 7, "round_timeout": 2.0})
    traits = strategy_traits(federated)
    assert (traits.partitioned, traits.private, traits.secure, traits.collective,
            traits.clocked) == (True, True, True, True, False)
    assert (traits.rounds, traits.clients, traits.round_timeout) == (3, 7, 2.0)
    assert traits.count_clients(2, None) == 7
    fedbuff = strategy_traits(meshkit.plugins.create("strategy", "fedbuff"))
    assert fedbuff.clocked and not (fedbuff.private or fedbuff.secure or fedbuff.collective)
    assert "amplification" in fedbuff.why_not["private"]
    for name in ("local", "data-parallel", "model-parallel"):
        traits = strategy_traits(meshkit.plugins.create("strategy", name))
        assert not (traits.partitioned or traits.private or traits.secure or traits.collective)
        assert traits.rounds is not None


def _spmd(strategy, aggregator="fedavg"):
    check_collective(strategy="third-party", aggregator=meshkit.plugins.create(
                         "aggregator", aggregator),
                     privacy=None, attack=None, partitioner_local=False,
                     traits=strategy_traits(strategy), where="job.toml")


def test_a_third_party_strategy_that_declares_collective_is_played_spmd():
    _spmd(Declared())  # nothing refused: collective, linear, clients set


def test_a_third_party_strategy_that_does_not_is_refused_spmd_naming_the_trait():
    with pytest.raises(meshkit.RefusedError) as caught:
        _spmd(Bare())
    assert "[strategy] name = 'third-party'" in str(caught.value)
    assert "lacks it" in str(caught.value) and "StrategyTraits.collective" in str(caught.value)


def test_spmd_reads_the_declared_clients_and_round_timeout():
    class NoClients(Bare):
        traits = StrategyTraits(collective=True)

    class Deadline(Bare):
        traits = StrategyTraits(collective=True, clients=4, round_timeout=5.0)

    with pytest.raises(meshkit.RefusedError, match=r"\[strategy\] clients is not set"):
        _spmd(NoClients())
    with pytest.raises(meshkit.RefusedError, match=r"\[strategy\] round_timeout is not played"):
        _spmd(Deadline())
