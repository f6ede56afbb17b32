"""``meshkit check`` on any config: it succeeds, or refuses cleanly (exit 2, naming the file).

A property-based test over every table of the config (issue 34): hypothesis
writes configs with random values of random types for every key of every
table -- ``[run]``, ``[mesh]``, ``[simulation]``, ``[secure_aggregation]``,
``[attack]``, and every option of every component the config selects
(strategy, aggregator, outer optimizer, partitioner, privacy, attack,
observers, task, transport, and a model-parallel run's boards) -- as a real
TOML file, and runs ``meshkit check`` on it in-process. Whatever it drew,
the command either prints the plan (exit 0) or one paragraph on stderr
naming the config file (exit 2); an exception escaping as a traceback
(exit 1) is a value that was not validated to a usable range.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import tempfile
import traceback
import typing
from pathlib import Path
from typing import Any, Iterator

import attrs
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import meshkit
from meshkit.cli import main
from meshkit.config import MeshTable, RunTable, SimulationTable

#: Integers at the edges: negative, zero, small, and TOML's int64 limits.
INTS = [-(2 ** 63), -1, 0, 1, 2, 3, 5, 10, 64, 2 ** 31, 2 ** 63 - 1]
#: Floats at the edges: subnormal and huge magnitudes, zero, and what TOML spells nan/inf.
FLOATS = [0.0, -0.0, 1e-300, -1e-300, 5e-324, 1e-9, 0.1, 0.5, 0.999999, 1.0, 1.5, 2.0, 100.0,
          1e300, -1e300, 1.7976931348623157e308, -1.0, math.inf, -math.inf, math.nan]
#: Strings: empty, junk, and words some keys accept (so a draw gets past the first check).
WORDS = ["", "x", "a b", "../..", "coordinator", "client", "clients", "both", "fixed",
         "poisson", "sqrt", "poly", "hinge", "constant", "stop", "skip-round", "virtual",
         "lognormal", "pld", "rdp", "os", "seeded", "auto", "gloo", "spmd", "env://",
         "tcp://127.0.0.1:0", "tcp://192.0.2.7:29500", "float32", "float16", "int8", "affine",
         "identity", "relu", "cpu", "inline", "file", "none", "local", "external", "star",
         "mesh", "127.0.0.1:0", "0.0.0.0:0", "127.0.0.1:99999", "*", "@norm", "stage"]


def _values(depth: int = 1) -> st.SearchStrategy[Any]:
    """Any TOML value: scalars of every type and, nested, arrays and tables."""
    scalar = st.one_of(st.sampled_from(INTS), st.integers(-2 ** 63, 2 ** 63 - 1),
                       st.sampled_from(FLOATS), st.floats(allow_nan=True, allow_infinity=True),
                       st.sampled_from(WORDS), st.booleans())
    if depth <= 0:
        return scalar
    inner = _values(depth - 1)
    return st.one_of(scalar, st.lists(inner, max_size=3),
                     st.dictionaries(st.sampled_from(["a", "x", "name", "stage_id"]), inner,
                                     max_size=2))


def _typed(field: attrs.Attribute) -> st.SearchStrategy[Any]:
    """A value of the field's own type, at the edges of its range (or its default)."""
    kind = field.type
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if args and len(args) == 1:
        kind = args[0]
    default = field.default
    # TOML has no null: a None default is the key left out.
    defaults = ([] if default is attrs.NOTHING or default is None
                or isinstance(default, attrs.Factory)  # type: ignore[arg-type]
                else [default])
    if kind is bool:
        return st.booleans()
    if kind is int:
        return st.sampled_from(INTS + defaults)
    if kind is float:
        return st.sampled_from(FLOATS + INTS + defaults)
    if kind is str:
        return st.sampled_from(WORDS + defaults)
    return _values()


def _table(options: type | None, fixed: dict[str, Any] | None = None
           ) -> st.SearchStrategy[dict[str, Any]]:
    """Some of ``options``' keys, each a value of its own type or of any type."""
    if options is not None and attrs.has(options):
        # As meshkit resolves them when it checks a table: the draw must not change after.
        attrs.resolve_types(options)
    fields = list(attrs.fields(options)) if options is not None and attrs.has(options) else []

    @st.composite
    def build(draw: Any) -> dict[str, Any]:
        table = dict(fixed or {})
        # Mostly zero or one key a table, so most configs get past the first check
        # and reach the deeper ones (the components built, the plan measured).
        count = draw(st.sampled_from([0] * 8 + [1, 1, 1, 2])) if fields else 0
        for field in draw(st.lists(st.sampled_from(fields), unique_by=lambda f: f.name,
                                   min_size=min(count, len(fields)),
                                   max_size=min(count, len(fields)))) if count else []:
            table[field.name] = draw(st.one_of(_typed(field), _typed(field), _typed(field),
                                               _values()))
        if draw(st.integers(0, 99)) == 0:  # now and then a key no class has
            table[draw(st.sampled_from(["bogus", "in_bitz", "runds"]))] = draw(_values(0))
        return table
    return build()


#: Every component kind a config selects: name -> options class, read once (a
#: strategy that draws from the plugin set's state would not replay).
_CATALOG = {kind: {name: component.options
                   for name, component in sorted(meshkit.plugins.available(kind).items())}
            for kind in ("strategy", "aggregator", "outer_optimizer", "partitioner", "privacy",
                         "attack", "observer", "task", "transport", "board",
                         "secure_aggregation")}


def _components(kind: str) -> dict[str, Any]:
    return _CATALOG[kind]


#: The component a draw picks half the time: the federated run most tables compose with.
_USUAL = {"strategy": "federated", "aggregator": "fedavg", "partitioner": "iid"}


def _selected(kind: str, table: str) -> Any:
    """``[table]`` selecting a ``kind`` by ``name``, with random values for its options."""
    available = _components(kind)
    names = st.sampled_from(sorted(available))
    if kind in _USUAL:
        names = st.one_of(st.just(_USUAL[kind]), names)
    return names.flatmap(lambda name: _table(available[name], {"name": name}))


@st.composite
def configs(draw: Any) -> dict[str, Any]:
    """A config document touching every table, each key random (values of every type)."""
    tasks = _components("task")
    # flower needs a client app module: its options are drawn, its app is not.
    task = draw(st.sampled_from(["digits", "synthetic", "synthetic-federated"]))
    data: dict[str, Any] = {
        "run": draw(_table(RunTable, {"task": task})),
        "mesh": draw(_table(MeshTable)),
        "strategy": draw(_selected("strategy", "strategy")),
        "task": draw(_table(tasks[task])),
    }
    data["run"]["out"] = draw(st.one_of(st.just("runs/a"), st.sampled_from(
        ["runs", "job.toml", "job.toml/a", "runs/a/b/c", ""])))
    data["mesh"].pop("transport", None)
    if draw(st.booleans()):
        data["mesh"]["transport"] = draw(st.sampled_from(sorted(_components("transport"))))
        transport = _components("transport")[data["mesh"]["transport"]]
        data["transport"] = draw(_table(transport))
    if data["strategy"]["name"] == "model-parallel" and draw(st.booleans()):
        boards = _components("board")
        data["strategy"]["boards"] = [
            {"board": "loopback", "options": draw(_table(boards["loopback"],
                                                         {"stage_id": "s0"}))}]
        data["strategy"]["partitions"] = [{"nodes": ["layer0"], "tag": "s0"}]
    for table, kind in (("aggregator", "aggregator"), ("outer_optimizer", "outer_optimizer"),
                        ("partitioner", "partitioner"), ("privacy", "privacy"),
                        ("attack", "attack")):
        if draw(st.booleans()):
            data[table] = draw(_selected(kind, table))
    if "attack" in data:
        who = draw(st.sampled_from(["clients", "fraction", "fraction", "both", "neither"]))
        if who in ("clients", "both"):
            data["attack"]["clients"] = draw(st.one_of(
                st.lists(st.sampled_from([0, 1]), min_size=1, max_size=2, unique=True),
                st.lists(st.sampled_from(INTS), min_size=1, max_size=3), _values()))
        if who in ("fraction", "both"):
            data["attack"]["fraction"] = draw(st.one_of(st.sampled_from([0.25, 0.5, 1.0]),
                                                        st.sampled_from(FLOATS + INTS)))
    if draw(st.booleans()):
        data["simulation"] = draw(_table(SimulationTable))
    if draw(st.booleans()):
        data["secure_aggregation"] = draw(_selected("secure_aggregation",
                                                    "secure_aggregation"))
    if draw(st.integers(0, 3)) == 0:
        data["observers"] = [draw(_selected("observer", "observers"))]
    return data


def _toml(value: Any) -> str:
    """``value`` as a TOML value (strings as JSON's, which TOML's basic strings read alike)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"


def _document(data: dict[str, Any]) -> str:
    lines = []
    for table, body in data.items():
        entries = body if isinstance(body, list) else [body]
        for entry in entries:
            lines.append(f"[[{table}]]" if isinstance(body, list) else f"[{table}]")
            lines += [f"{json.dumps(k)} = {_toml(v)}" for k, v in entry.items()]
    return "\n".join(lines) + "\n"


#: One working directory for every example: ``[run] out`` and the file paths
#: a config names are relative to it (check creates nothing there).
_WORKDIR = Path(tempfile.mkdtemp(prefix="meshkit-check-any-"))
(_WORKDIR / "job.toml").write_text("")  # an ``out`` that is a file


#: How much more address space an example may take than the test process holds:
#: a drawn model of terabytes must be refused (a MemoryError made a ConfigError),
#: not allocated on a machine others share.
_HEADROOM = 3 << 30


@contextlib.contextmanager
def _memory_capped() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as fh:
        held = int(fh.read().split()[0]) * resource.getpagesize()
    cap = held + _HEADROOM if hard == resource.RLIM_INFINITY else min(held + _HEADROOM, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _check_cleanly(data: dict[str, Any]) -> None:
    """``meshkit check`` on ``data`` as a TOML file: exit 0 with ``ok``, or 2 naming the file."""
    path = _WORKDIR / "fuzz.toml"
    path.write_text(_document(data))
    cwd = os.getcwd()
    os.chdir(_WORKDIR)
    try:
        meshkit.plugins.reset()
        with _memory_capped():
            result = CliRunner().invoke(main, ["check", "-q", str(path)], env={
                "MESHKIT_SECRET": None})
    finally:
        os.chdir(cwd)
    if result.exit_code == 0:
        assert result.stdout.strip().endswith("ok"), result.stdout
        return
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        _document(data), "".join(traceback.format_exception(*result.exc_info))[-2500:])
    assert result.exit_code == 2, (_document(data), result.output)
    assert result.stderr.startswith(f"meshkit: error: {path}"), (_document(data),
                                                                 result.stderr)
    assert "Traceback" not in result.stderr


#: Examples of the whole-config property; each base of the per-table one gets a
#: tenth (at least 10). ``MESHKIT_CHECK_EXAMPLES=3000`` searches harder.
_EXAMPLES = int(os.environ.get("MESHKIT_CHECK_EXAMPLES", "150"))
_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
_SETTINGS = settings(max_examples=max(10, _EXAMPLES // 10), deadline=None,
                     suppress_health_check=_HEALTH)


@settings(max_examples=_EXAMPLES, deadline=None, suppress_health_check=_HEALTH)
@given(data=configs())
def test_check_either_passes_or_refuses_naming_the_file(data: dict[str, Any]) -> None:
    _check_cleanly(data)


def _federated(**tables: Any) -> dict[str, Any]:
    """A config ``meshkit check`` passes: digits, 4 clients on 2 workers, plus ``tables``."""
    data: dict[str, Any] = {"run": {"task": "digits", "out": "runs/a"}, "mesh": {},
                            "strategy": {"name": "federated", "clients": 4, "rounds": 3}}
    for table, body in tables.items():
        data[table] = {**data.get(table, {}), **body}
    return data


#: Configs ``meshkit check`` passes, and the table each one's draws change: one
#: table at a time, so a draw reaches the checks that come after the first.
BASES = {
    "run": (_federated(), "run", RunTable),
    "mesh": (_federated(), "mesh", MeshTable),
    "simulation": (_federated(strategy={"name": "fedbuff", "clients": 8, "buffer_size": 2,
                                        "concurrency": 4}, simulation={}),
                   "simulation", SimulationTable),
    **{f"secure_aggregation {name}": (_federated(secure_aggregation={"name": name}),
                                      "secure_aggregation", options)
       for name, options in _CATALOG["secure_aggregation"].items()},
    **{f"strategy {name}": ({**_federated(), "strategy": {"name": name}}, "strategy", options)
       for name, options in _CATALOG["strategy"].items()
       if options is not None and name not in ("federated", "fedbuff", "model-parallel")},
    "strategy federated": (_federated(), "strategy", _CATALOG["strategy"]["federated"]),
    "strategy fedbuff": (_federated(strategy={"name": "fedbuff", "clients": 8, "buffer_size": 2,
                                              "concurrency": 4}),
                         "strategy", _CATALOG["strategy"]["fedbuff"]),
    "strategy fedbuff on a population": (
        _federated(run={"task": "synthetic-federated"}, task={"clients": 1000, "dim": 4},
                   strategy={"name": "fedbuff", "clients": 0, "buffer_size": 2,
                             "concurrency": 4}, simulation={}),
        "strategy", _CATALOG["strategy"]["fedbuff"]),
    **{f"aggregator {name}": (_federated(aggregator={"name": name, **(
        {"max_norm": 1.0} if name == "norm-bound" else {})}), "aggregator", options)
       for name, options in _CATALOG["aggregator"].items() if options is not None},
    **{f"outer_optimizer {name}": (_federated(outer_optimizer={"name": name}),
                                   "outer_optimizer", options)
       for name, options in _CATALOG["outer_optimizer"].items() if options is not None},
    **{f"privacy {name}": (_federated(privacy={"name": name}), "privacy", options)
       for name, options in _CATALOG["privacy"].items()},
    **{f"privacy {name} on clients": (_federated(privacy={"name": name, "clip": "client"}),
                                      "privacy", options)
       for name, options in _CATALOG["privacy"].items()},
    **{f"attack {name}": (_federated(attack={"name": name, "fraction": 0.25}), "attack",
                          options)
       for name, options in _CATALOG["attack"].items() if options is not None},
    "partitioner dirichlet": (_federated(partitioner={"name": "dirichlet"}), "partitioner",
                              _CATALOG["partitioner"]["dirichlet"]),
    "partitioner pathological": (_federated(partitioner={"name": "pathological"},
                                            strategy={"clients": 10}),
                                 "partitioner", _CATALOG["partitioner"]["pathological"]),
    **{f"task {name}": (_federated(run={"task": name}), "task", _CATALOG["task"][name])
       for name in ("digits", "synthetic")},
    "task synthetic-federated": (_federated(run={"task": "synthetic-federated"},
                                            strategy={"clients": 0, "fraction": 0.01}),
                                 "task", _CATALOG["task"]["synthetic-federated"]),
    **{f"transport {name}": (_federated(mesh={"transport": name}), "transport", options)
       for name, options in _CATALOG["transport"].items() if options is not None},
    **{f"observer {name}": ({**_federated(), "observers": [{"name": name}]}, "observers",
                            options)
       for name, options in _CATALOG["observer"].items()},
    "board loopback": ({"run": {"task": "digits", "out": "runs/a"}, "mesh": {"workers": 2},
                        "strategy": {"name": "model-parallel", "partitions": [
                            {"nodes": ["hidden"], "rank": 1}, {"nodes": ["output"], "rank": 2},
                            {"nodes": ["scale"], "tag": "scale"}],
                            "boards": [{"board": "loopback", "options": {
                                "stage_id": "scale", "input_elems": 64, "output_elems": 64,
                                "function": "scale", "scale": 0.0625}}]}},
                       "board", _CATALOG["board"]["loopback"]),
}
BASES["strategy model-parallel"] = (BASES["board loopback"][0], "strategy",
                                    _CATALOG["strategy"]["model-parallel"])


@pytest.mark.parametrize("base", sorted(BASES))
@_SETTINGS
@given(draw=st.data())
def test_check_refuses_any_value_of_any_key_cleanly(base: str, draw: Any) -> None:
    """Each table of a config that passes, one to three keys at a time, any value."""
    data, table, options = BASES[base]
    data = json.loads(json.dumps(data))  # a fresh copy (no nan in the bases)
    if options is not None:
        attrs.resolve_types(options)
    fields = list(attrs.fields(options)) if options is not None else []
    changes = draw.draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3,
                                 unique_by=lambda f: f.name)) if fields else []
    body = (data["observers"][0] if table == "observers" else
            data["strategy"]["boards"][0]["options"] if table == "board" else
            data.setdefault(table, {}))
    for field in changes:
        body[field.name] = draw.draw(st.one_of(_typed(field), _typed(field), _values()))
    _check_cleanly(data)


def test_a_strategys_own_refusal_names_the_config_file(tmp_path):
    # fedbuff's refusals named their keys but no file (issue 34).
    path = tmp_path / "fedbuff.toml"
    path.write_text(_document({
        "run": {"task": "digits", "out": str(tmp_path / "run")},
        "strategy": {"name": "fedbuff", "clients": 8, "buffer_size": 2, "concurrency": 4},
        "privacy": {"name": "dp-fixed", "clip_norm": 1.0, "noise_multiplier": 1.0}}))
    result = CliRunner().invoke(main, ["check", str(path)])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"meshkit: error: {path}: [privacy] name = 'dp-fixed' "
                                    f"with [strategy] name = 'fedbuff'")


@pytest.mark.parametrize("option, words", [
    ("in_bitz = 8", "[[strategy.boards]] #1 (loopback) options in_bitz: unknown key"),
    ("input_elems = 0", "[[strategy.boards]] #1 (loopback) options input_elems: invalid value"),
])
def test_check_refuses_a_boards_options_before_any_node_starts(tmp_path, option, words):
    # Before, check said ok and run waited ~58 s for a board node that had exited (issue 35).
    data = json.loads(json.dumps(BASES["board loopback"][0]))
    key, _, value = option.partition(" = ")
    data["strategy"]["boards"][0]["options"][key] = int(value)
    path = tmp_path / "boards.toml"
    path.write_text(_document(data))
    result = CliRunner().invoke(main, ["check", str(path)])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"meshkit: error: {path}: {words}")
