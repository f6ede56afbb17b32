"""The plugin manager and registry, with fixture-built plugin sets (no entry points)."""

from __future__ import annotations

import types

import attrs
import pytest

import meshkit
from meshkit import hookspecs
from meshkit.errors import ConfigError, PluginError, UnknownComponentError
from meshkit.plugins import build_manager


def _plugin(name: str, **hooks) -> types.SimpleNamespace:
    ns = types.SimpleNamespace(__name__=name)
    for hook, fn in hooks.items():
        setattr(ns, hook, meshkit.hookimpl(fn))
    return ns


@attrs.frozen
class DoubleOptions:
    scale: float = 2.0
    label: str = "x"


def _doubler_records():
    return [meshkit.Component("double", lambda opts: ("double", opts), DoubleOptions,
                              summary="doubles")]


def test_a_component_flows_from_hook_to_create():
    pset = build_manager([_plugin("mine", meshkit_aggregators=_doubler_records)],
                         entry_points=False)
    available = pset.available("aggregator")
    assert list(available) == ["double"]
    assert available["double"].provenance.plugin == "mine"
    built = pset.create("aggregator", "double", {"scale": 3})
    assert built == ("double", DoubleOptions(scale=3.0))


def test_create_with_no_options_uses_the_defaults():
    pset = build_manager([_plugin("mine", meshkit_aggregators=_doubler_records)],
                         entry_points=False)
    assert pset.create("aggregator", "double") == ("double", DoubleOptions())


def test_an_unknown_option_key_names_the_key():
    pset = build_manager([_plugin("mine", meshkit_aggregators=_doubler_records)],
                         entry_points=False)
    with pytest.raises(ConfigError, match=r"\[aggregator\] sclae: unknown key"):
        pset.create("aggregator", "double", {"sclae": 3})


def test_an_unknown_option_key_suggests_the_closest_known_key():
    pset = build_manager([_plugin("mine", meshkit_aggregators=_doubler_records)],
                         entry_points=False)
    with pytest.raises(ConfigError, match=r"\[aggregator\] sclae: unknown key "
                                          r"\(did you mean 'scale'\?\)"):
        pset.create("aggregator", "double", {"sclae": 3})
    with pytest.raises(ConfigError) as info:
        pset.create("aggregator", "double", {"momentum": 3})
    assert str(info.value) == "[aggregator] momentum: unknown key; the keys are scale, label"


def test_a_wrong_option_type_names_the_key():
    pset = build_manager([_plugin("mine", meshkit_aggregators=_doubler_records)],
                         entry_points=False)
    with pytest.raises(ConfigError, match=r"\[aggregator\] scale: expected a number, got 'big'"):
        pset.create("aggregator", "double", {"scale": "big"})


def test_options_for_a_component_without_options_are_refused():
    records = lambda: [meshkit.Component("plain", lambda: "plain")]  # noqa: E731
    pset = build_manager([_plugin("mine", meshkit_aggregators=records)], entry_points=False)
    assert pset.create("aggregator", "plain") == "plain"
    with pytest.raises(ConfigError, match="'plain' takes no options"):
        pset.create("aggregator", "plain", {"x": 1})


def test_an_unknown_name_lists_the_choices_and_hints_at_plugins():
    pset = build_manager([_plugin("mine", meshkit_aggregators=_doubler_records)],
                         entry_points=False)
    with pytest.raises(UnknownComponentError) as info:
        pset.create("aggregator", "triple")
    message = str(info.value)
    assert "no aggregator named 'triple'" in message
    assert "available: double" in message
    assert "Another plugin may provide it" in message


def _outer_records():
    return [meshkit.Component("fedadam", lambda opts: "adam", summary="an Adam step"),
            meshkit.Component("average", lambda opts: "avg", also_known_as=("FedAvg",))]


def test_a_name_of_another_kind_is_answered_with_its_kind_and_table():
    pset = build_manager([_plugin("mine", meshkit_aggregators=_doubler_records,
                                  meshkit_outer_optimizers=_outer_records)],
                         entry_points=False)
    with pytest.raises(UnknownComponentError) as info:
        pset.create("aggregator", "FedAdam")
    assert str(info.value) == (
        "no aggregator named 'FedAdam': 'FedAdam' is an outer_optimizer (an Adam step), not an "
        "aggregator; select it as [outer_optimizer] name = \"fedadam\"")


def test_another_frameworks_name_points_at_the_component_it_names():
    pset = build_manager([_plugin("mine", meshkit_aggregators=_doubler_records,
                                  meshkit_outer_optimizers=_outer_records)],
                         entry_points=False)
    with pytest.raises(UnknownComponentError,
                       match="'fedavg' is known here as the outer_optimizer 'average'; select "
                             "it as \\[outer_optimizer\\] name = \"average\""):
        pset.create("outer_optimizer", "fedavg")
    with pytest.raises(TypeError, match="also_known_as"):
        meshkit.Component("x", lambda: 1, also_known_as=("",))
    assert meshkit.Component("x", lambda: 1, also_known_as="X").also_known_as == ("X",)


def test_a_name_offered_twice_is_an_error_naming_both_providers():
    pset = build_manager({
        "first": _plugin("first", meshkit_aggregators=_doubler_records),
        "second": _plugin("second", meshkit_aggregators=_doubler_records),
    }, entry_points=False)
    # Neither provider wins: the name is listed as a conflict, not as a component.
    assert "double" not in pset.available("aggregator")
    (conflict,) = pset.conflicts("aggregator")
    assert [p.plugin for p in conflict.providers] == ["first", "second"]
    with pytest.raises(PluginError) as info:
        pset.create("aggregator", "double")
    message = str(info.value)
    assert "two plugins offer the aggregator 'double'" in message
    assert "'first'" in message and "'second'" in message


def test_a_misspelled_hook_names_the_plugin_and_suggests_the_real_hook():
    typo = _plugin("typo-plugin", meshkit_aggregator=lambda: [])
    with pytest.raises(PluginError) as info:
        build_manager([typo], entry_points=False)
    message = str(info.value)
    assert "typo-plugin" in message
    assert "unknown hook 'meshkit_aggregator'" in message
    assert "did you mean 'meshkit_aggregators'" in message


def test_a_hook_returning_something_else_than_components_names_the_plugin():
    bad = _plugin("bad", meshkit_tasks=lambda: ["not a component"])
    pset = build_manager([bad], entry_points=False)
    assert pset.available("task") == {}
    (failure,) = pset.failures
    assert failure.hook == "meshkit_tasks"
    assert "must return meshkit.Component records, got 'not a component'" in failure.error
    with pytest.raises(UnknownComponentError, match="plugin 'bad'.*must return meshkit.Component"):
        pset.create("task", "anything")


def test_a_hook_that_raises_names_the_plugin():
    def explode():
        raise RuntimeError("boom")

    pset = build_manager([_plugin("fragile", meshkit_boards=explode)], entry_points=False)
    assert pset.available("board") == {}
    with pytest.raises(UnknownComponentError, match="plugin 'fragile'.*RuntimeError: boom"):
        pset.create("board", "fpga")


def test_an_unknown_kind_is_refused():
    pset = build_manager([], entry_points=False)
    with pytest.raises(UnknownComponentError, match="unknown component kind 'widget'"):
        pset.available("widget")


def test_component_options_must_be_an_attrs_class():
    with pytest.raises(TypeError, match="must be an attrs class"):
        meshkit.Component("x", lambda o: o, options=dict)


@pytest.mark.parametrize("kind, hook", [
    ("transport", "meshkit_transports"), ("aggregator", "meshkit_aggregators"),
    ("outer_optimizer", "meshkit_outer_optimizers"), ("board", "meshkit_boards"),
    ("strategy", "meshkit_strategies"), ("task", "meshkit_tasks"),
    ("partitioner", "meshkit_partitioners"), ("attack", "meshkit_attacks"),
    ("observer", "meshkit_observers"), ("privacy", "meshkit_privacy"),
    ("exporter", "meshkit_exporters"), ("compression", "meshkit_compression"),

    ("exporter", "meshkit_exporters"), ("secure_aggregation", "meshkit_secure_aggregation"),
])
def test_every_component_hook_is_called(kind, hook):
    calls = []

    def records():
        calls.append(hook)
        return [meshkit.Component(f"{kind}-thing", lambda: kind)]

    pset = build_manager([_plugin("p", **{hook: records})], entry_points=False)
    assert pset.create(kind, f"{kind}-thing") == kind
    assert calls == [hook]


class _Observer:
    def __init__(self):
        self.seen = []

    @meshkit.hookimpl
    def meshkit_run_started(self, config):
        self.seen.append(("meshkit_run_started", config))

    @meshkit.hookimpl
    def meshkit_node_joined(self, caps):
        self.seen.append(("meshkit_node_joined", caps))

    @meshkit.hookimpl
    def meshkit_round_completed(self, report):
        self.seen.append(("meshkit_round_completed", report))

    @meshkit.hookimpl
    def meshkit_run_finished(self, report):
        self.seen.append(("meshkit_run_finished", report))


@pytest.mark.parametrize("hook, kwargs", [
    ("meshkit_run_started", {"config": "cfg"}),
    ("meshkit_node_joined", {"caps": "caps"}),
    ("meshkit_round_completed", {"report": "round"}),
    ("meshkit_run_finished", {"report": "final"}),
])
def test_every_event_hook_reaches_an_observer(hook, kwargs):
    observer = _Observer()
    pset = build_manager({"observer": observer}, entry_points=False)
    getattr(pset.hook, hook)(**kwargs)
    assert observer.seen == [(hook, *kwargs.values())]


def test_every_spec_in_hookspecs_is_tested_here():
    specs = {n for n in dir(hookspecs) if n.startswith("meshkit_")}
    assert specs == {
        "meshkit_transports", "meshkit_aggregators", "meshkit_outer_optimizers",
        "meshkit_boards", "meshkit_strategies", "meshkit_tasks", "meshkit_partitioners",
        "meshkit_attacks", "meshkit_observers", "meshkit_privacy", "meshkit_exporters",
        "meshkit_compression",
        "meshkit_secure_aggregation", "meshkit_run_started",
        "meshkit_node_joined", "meshkit_round_completed", "meshkit_run_finished"}


def test_the_allow_list_and_block_list_filter_entry_points():
    none = build_manager(environ={"MESHKIT_PLUGINS": ""})
    assert none.loaded == []
    only_outer = build_manager(environ={"MESHKIT_PLUGINS": "outer"})
    assert [p.name for p in only_outer.loaded] == ["outer"]
    assert "average" in only_outer.available("outer_optimizer")
    blocked = build_manager(environ={"MESHKIT_DISABLE_PLUGINS": "outer"})
    assert "outer" not in [p.name for p in blocked.loaded]
    assert "average" not in blocked.available("outer_optimizer")


def test_the_builtin_average_comes_through_the_public_api():
    component = meshkit.plugins.available("outer_optimizer")["average"]
    assert component.provenance.distribution == "meshkit"
    optimizer = meshkit.plugins.create("outer_optimizer", "average")
    assert optimizer.step({"w": 1.0}, {"w": 0.5}) == {"w": 0.5}


class _HalfDeaf:
    """An observer whose round hook lost its marker: pluggy registers the rest."""

    @meshkit.hookimpl
    def meshkit_run_started(self, config):
        pass

    def meshkit_round_completed(self, report):  # the mistake: no @meshkit.hookimpl
        pass

    def meshkit_helper(self):  # not a hook name at all
        pass


def test_a_hook_without_its_marker_is_a_warning_naming_plugin_and_method(caplog):
    with caplog.at_level("WARNING", logger="meshkit.plugins"):
        pset = build_manager({"tracker": _HalfDeaf()}, entry_points=False)
    assert pset.hooks_of("tracker") == ["meshkit_run_started"]
    helper, deaf = pset.unmarked_hooks
    assert deaf == ("plugin 'tracker': meshkit_round_completed() is not marked with "
                    "@meshkit.hookimpl; pluggy ignores it, so meshkit never calls it")
    assert "meshkit_helper()" in helper and "no hook has this name" in helper
    assert [r.getMessage() for r in caplog.records] == [helper, deaf]


def test_a_module_plugin_without_markers_is_warned_about_too(caplog):
    module = types.ModuleType("halfway")
    module.meshkit_aggregators = lambda: []
    with caplog.at_level("WARNING", logger="meshkit.plugins"):
        pset = build_manager([module], entry_points=False)
    assert pset.unmarked_hooks == [
        "plugin 'halfway': meshkit_aggregators() is not marked with @meshkit.hookimpl; "
        "pluggy ignores it, so meshkit never calls it"]


def test_the_built_in_plugins_have_no_unmarked_hook():
    assert build_manager().unmarked_hooks == []
