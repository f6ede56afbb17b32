"""The kernel decides by declared traits, never by a built-in plugin's name (DESIGN §10).

Two rules, each checked over the AST of every kernel module (``meshkit/``,
the conformance kit aside: it names the built-ins it was written against):

* no built-in component's name appears as a constant in a comparison
  (``name == "fedavg"``, ``name not in (...)``) or among two or more names
  in a tuple, list or set (``PLAIN_MEANS = ("fedavg", "allreduce")``);
* no ``getattr(x, "<field>", default)`` reads a declared field of a
  contract record (:class:`meshkit.AggregatorTraits`,
  :class:`meshkit.StrategyTraits`, :class:`meshkit.StrategyContext`,
  :class:`meshkit.train.Work`): a declared field is read as an attribute, and
  a component that declares nothing is read through
  ``aggregator_traits()`` / ``strategy_traits()``, the safe reading.
"""

from __future__ import annotations

import ast
from pathlib import Path

import attrs

import meshkit
from meshkit import plugins
from meshkit.train import StrategyContext, Work

KERNEL = Path(meshkit.__file__).parent

#: Words that are kernel vocabulary as well as a built-in's name: ``[mesh] launch =
#: "local"`` (the launch mode, not the strategy or partitioner) and a pipeline
#: stage's ``op = "scale"`` (not the attack).
KERNEL_WORDS = {"local", "scale"}

KINDS = ("transport", "aggregator", "outer_optimizer", "board", "strategy", "task",
         "partitioner", "attack", "privacy", "observer", "compression", "secure_aggregation")


def _kernel_modules() -> list[Path]:
    return sorted(p for p in KERNEL.rglob("*.py") if "testing" not in p.relative_to(KERNEL).parts)


def _builtin_names() -> set[str]:
    names: set[str] = set()
    for kind in KINDS:
        names |= {name for name, component in plugins.available(kind).items()
                  if component.provenance is None
                  or component.provenance.distribution in (None, "meshkit")}
    return names - KERNEL_WORDS


def _named(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    hits: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        found: list[ast.Constant] = []
        if isinstance(node, ast.Compare):
            found = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names]
        elif isinstance(node, (ast.Tuple, ast.Set, ast.List)):
            found = [c for c in node.elts if isinstance(c, ast.Constant) and c.value in names]
            found = found if len(found) >= 2 else []
        hits += [(c.lineno, str(c.value)) for c in found]
    return hits


def test_the_scan_knows_the_builtin_names_and_would_catch_one():
    names = _builtin_names()
    assert {"fedavg", "allreduce", "norm-bound", "federated", "fedbuff", "median"} <= names
    planted = ast.parse('PLAIN_MEANS = ("fedavg", "allreduce")\n'
                        'if cfg.strategy.name not in ("federated",): pass\n'
                        'ok = name == "fedbuff"\n')
    assert {v for _, v in _named(planted, names)} == {"fedavg", "allreduce", "federated",
                                                      "fedbuff"}


def test_no_kernel_module_decides_by_a_builtin_plugins_name():
    names = _builtin_names()
    hits = [f"{path.relative_to(KERNEL.parent)}:{line} {value!r}"
            for path in _kernel_modules()
            for line, value in _named(ast.parse(path.read_text()), names)]
    assert not hits, ("the kernel names built-in plugins (decide by declared traits "
                      "instead):\n" + "\n".join(hits))


def _declared_fields() -> dict[str, str]:
    fields: dict[str, str] = {}
    for record in (meshkit.AggregatorTraits, meshkit.StrategyTraits, StrategyContext, Work):
        for field in attrs.fields(record):
            if not field.name.startswith("_"):  # a private field is no part of the contract
                fields.setdefault(field.name, record.__name__)
    return fields


def _defaulted_reads(tree: ast.AST, fields: dict[str, str]) -> list[tuple[int, str]]:
    return [(node.lineno, node.args[1].value) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "getattr" and len(node.args) == 3
            and isinstance(node.args[1], ast.Constant) and node.args[1].value in fields]


def test_the_getattr_scan_would_catch_a_defaulted_read_of_a_declared_field():
    fields = _declared_fields()
    assert {"linear", "uses_reference", "partitioned", "secure", "rounds", "collective",
            "privacy"} <= set(fields)
    planted = ast.parse('getattr(strategy, "partitioned", False)\n'
                        'getattr(options, "rounds", None)\n'
                        'getattr(aggregator, "uses_reference", False)\n'
                        'getattr(aggregator, "begin", None)\n')
    assert [v for _, v in _defaulted_reads(planted, fields)] == ["partitioned", "rounds",
                                                                  "uses_reference"]


def test_no_kernel_module_reads_a_declared_contract_field_through_a_getattr_default():
    fields = _declared_fields()
    hits = [f"{path.relative_to(KERNEL.parent)}:{line} getattr(..., {value!r}, ...) "
            f"({fields[value]}.{value})"
            for path in _kernel_modules()
            for line, value in _defaulted_reads(ast.parse(path.read_text()), fields)]
    assert not hits, ("declared fields read through a getattr default (read the record: "
                      "strategy_traits(), aggregator_traits(), the context's own field):\n"
                      + "\n".join(hits))
