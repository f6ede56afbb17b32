"""The ``[secure_aggregation]`` table and what a secure run refuses before any process starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import meshkit
from meshkit.config import Selection, parse_config
from meshkit.train._coordinator.plan import resolve
from meshkit.train import build_components
from meshkit_secagg import SecAggPlusOptions


def table(out: Path, **secure: Any) -> dict[str, Any]:
    return {"run": {"out": str(out)}, "mesh": {"workers": 2},
            "strategy": {"rounds": 1, "clients": 6},
            "secure_aggregation": {"degree": 0, "threshold": 3, **secure}}


def _plan(config: dict[str, Any]) -> dict[str, Any]:
    return build_components(resolve(parse_config(config, path="run.toml")))


def test_the_table_takes_the_design_keys_with_auto_degree_and_threshold(tmp_path):
    parsed = parse_config({"secure_aggregation": {}}).secure_aggregation
    assert parsed == Selection("secure_aggregation", "secagg+", {}, "[secure_aggregation]")
    plain = table(tmp_path)
    plain["secure_aggregation"] = {}
    assert _plan(plain)["secure_aggregation"].scheme.options == SecAggPlusOptions(
        degree="auto", threshold="auto", clip_range=8.0, modulus_bits=32)
    chosen = _plan(table(tmp_path, degree=4, threshold=0.5, clip_range=2.0,
                         modulus_bits=40))["secure_aggregation"]
    assert chosen.name == "secagg+" and chosen.traits.modulus_bits == 40
    options = chosen.scheme.options
    assert (options.degree, options.threshold, options.clip_range, options.modulus_bits) == (
        4, 0.5, 2.0, 40)
    assert _plan(table(tmp_path))["secure_aggregation"].scheme.options.threshold == 3


@pytest.mark.parametrize("key, value, message", [
    ("name", "secagg", r"name: no secure_aggregation named 'secagg' \(did you mean 'secagg\+'"),
    ("degree", -1, "degree must be an integer >= 0"),
    ("degree", True, "degree must be \"auto\" or a number"),
    ("threshold", 1, "threshold must be a number of shares >= 2"),
    ("threshold", 1.5, r"a fraction in \(0, 1\)"),
    ("clip_range", 0, "'clip_range' must be > 0"),
    ("modulus_bits", 65, "'modulus_bits' must be <= 64"),
    ("shares", 3, r"\[secure_aggregation\] shares: unknown key"),
])
def test_a_bad_value_names_the_file_the_table_and_the_key(tmp_path, key, value, message):
    # A misspelt name is the plugins' error (UnknownComponentError); a bad key the config's.
    with pytest.raises((meshkit.ConfigError, meshkit.UnknownComponentError),
                       match=message) as caught:
        resolve(parse_config(table(tmp_path, **{key: value}), path="run.toml"))
    assert str(caught.value).startswith("run.toml: [secure_aggregation]")


@pytest.mark.parametrize("change, message", [
    ({"strategy": {"name": "data-parallel"}},
     r"\[secure_aggregation\] name = 'secagg\+' with \[strategy\] name = 'data-parallel'"),
    ({"aggregator": {"name": "median"}},
     r"\[aggregator\] name = 'median': a secure round reveals only the sum.*lacks the "
     r"trait AggregatorTraits.linear = True"),
    ({"aggregator": {"name": "krum"}}, r"\[aggregator\] name = 'krum'"),
    ({"aggregator": {"name": "norm-bound", "max_norm": 1.0}},
     r"'norm-bound': a secure round reveals only the sum.*or its norm.*lacks the trait "
     r"AggregatorTraits.linear"),
    ({"strategy": {"evaluate": "clients"}},
     r"\[strategy\] evaluate = 'clients': each client's own metrics"),
    ({"strategy": {"local_keys": ["b"]}}, r"\[strategy\] local_keys = \['b'\]: FedBN"),
    ({"strategy": {"round_timeout": 5.0}}, r"\[strategy\] round_timeout = 5"),
    ({"attack": {"name": "sign-flip", "clients": [0]}}, r"\[attack\] name = 'sign-flip'"),
    ({"privacy": {"name": "dp-fixed", "clip_norm": 1.0, "noise_multiplier": 1.0},
      "strategy": {"sampling": "poisson", "fraction": 0.5}},
     r"\[privacy\] clip = 'coordinator': the coordinator never holds an individual update"),
])
def test_what_would_reveal_an_individual_update_is_refused_naming_both_keys(
        tmp_path, change, message):
    config = table(tmp_path / "out")
    for key, values in change.items():
        config.setdefault(key, {}).update(values)
    if config["strategy"].get("name") == "data-parallel":
        config["strategy"] = {"name": "data-parallel"}
    with pytest.raises(meshkit.RefusedError, match=message):
        _plan(config)



def test_adaptive_clipping_is_refused_under_secure_aggregation(tmp_path):
    config = table(tmp_path / "out")
    config["strategy"].update({"sampling": "poisson", "fraction": 0.5})
    config["privacy"] = {"name": "dp-adaptive", "clip": "client", "noise_multiplier": 1.0}
    with pytest.raises(meshkit.RefusedError, match=r"\[privacy\] name = 'dp-adaptive': "
                                                   r"adaptive clipping counts"):
        _plan(config)


def test_the_shipped_secure_example_checks_and_says_its_table():
    from meshkit.config import load_config

    example = Path(__file__).resolve().parents[3] / "examples" / "federated-secure.toml"
    plan = resolve(load_config(example))
    assert build_components(plan)["secure_aggregation"].scheme.options.clip_range == 1.0
    assert any(line.startswith("secure_aggregation: secagg+ from plugin 'secagg'")
               and line.endswith("[degree='auto', threshold='auto', clip_range=1.0, "
                                 "modulus_bits=32, interleave=True]")
               for line in plan.describe()), \
        plan.describe()
    from click.testing import CliRunner

    from meshkit.cli import main

    checked = CliRunner().invoke(main, ["check", str(example)])
    assert checked.exit_code == 0, checked.output
    assert "aggregation: secure (secagg+): the coordinator unmasks one sum a round" in \
        checked.output


def _check(tmp_path: Path, strategy: str, secure: str = "", workers: int = 3) -> Any:
    from click.testing import CliRunner

    from meshkit.cli import main

    config = tmp_path / "run.toml"
    config.write_text(f"""
[run]
task = "synthetic"
out = "{tmp_path / 'out'}"

[mesh]
workers = {workers}

[strategy]
name = "federated"
{strategy}

[secure_aggregation]
{secure}
""")
    return CliRunner().invoke(main, ["check", str(config)])


def test_check_states_how_many_workers_a_round_survives_losing(tmp_path):
    # The built-in default survives losing any one worker of three playing four clients each:
    # placed along the ring, each client's two neighbours sit on the two other workers.
    checked = _check(tmp_path, "clients = 12")
    assert checked.exit_code == 0, checked.output
    assert ("secure aggregation: a cohort of 12 clients over 3 worker(s), at most 4 each; "
            "degree 2, threshold 2: a round survives losing any 1 worker (any 1 client) at "
            "any step") in checked.output
    # In client order the placement is blind to the graph: any 4 clients may be one worker's.
    checked = _check(tmp_path, "clients = 12", "interleave = false")
    assert checked.exit_code == 0, checked.output
    assert ("secure aggregation: a cohort of 12 clients over 3 worker(s), at most 4 each; "
            "degree 8, threshold 5: a round survives losing any 1 worker (any 4 clients) at "
            "any step") in checked.output
    # A threshold that needs every holder survives losing none, and says what would help.
    checked = _check(tmp_path, "clients = 12", "degree = 0\nthreshold = 11")
    assert checked.exit_code == 0, checked.output
    assert ("threshold 11: a round survives losing any 0 workers (any 1 client) at any "
            "step; losing one stops the round") in checked.output


def test_a_cohort_above_the_most_one_round_takes_is_a_config_error_naming_the_key(tmp_path):
    checked = _check(tmp_path, "clients = 70000")
    assert checked.exit_code == 2 and checked.exception is None or \
        isinstance(checked.exception, SystemExit), checked.output
    assert "run.toml: [strategy] clients = 70000: a secure round's cohort would be 70000 " \
           "clients, and at most 65536" in checked.output
    assert "Traceback" not in checked.output


def test_check_states_what_a_masked_coordinate_costs_with_and_without_int8(tmp_path):
    checked = _check(tmp_path, "clients = 12")
    assert checked.exit_code == 0, checked.output
    assert ("updates masked mod 2^32 ([secure_aggregation] modulus_bits): 32 bits a "
            "coordinate up") in checked.output
    checked = _check(tmp_path, 'clients = 12\n\n[compression]\nname = "quantize"')
    assert checked.exit_code == 0, checked.output
    assert ("updates masked mod 2^12 ([compression] 'quantize''s 8-bit codes summed over 12 "
            "clients): 12 bits a coordinate up; the shared grid is [-8, 8] ([secure_aggregation] "
            "clip_range) in steps of 0.0627") in checked.output
    assert "upload: quantize sends" not in checked.output  # a plain fit's payload: never sent
