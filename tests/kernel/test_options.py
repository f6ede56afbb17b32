"""Config tables into options classes (``meshkit.options``): strict types, named errors."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import pytest

from meshkit import ConfigError, PluginError
from meshkit.options import parse_options, structure_strict

if TYPE_CHECKING:
    from decimal import Decimal  # only for the type checker: unresolvable at run time


@attrs.frozen
class Typed:
    rounds: int = 1
    names: list[str] = attrs.field(factory=list)


@attrs.frozen
class Unresolvable:
    rounds: int = 1
    rate: Decimal | None = None


def test_values_cattrs_would_coerce_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"\[strategy\] rounds: expected an integer, got '5'"):
        structure_strict({"rounds": "5"}, Typed, where="[strategy]")
    with pytest.raises(ConfigError, match=r"\[strategy\] names: expected an array, got 'abc'"):
        structure_strict({"names": "abc"}, Typed, where="[strategy]")


def test_an_options_class_whose_annotations_cannot_be_resolved_is_the_plugins_error():
    # Before, the failure to resolve was swallowed and every check of the class
    # silently turned off: rounds = "5" went through to cattrs.
    with pytest.raises(PluginError, match=r"\[strategy\]: the options class "
                                          r"\S+Unresolvable has an annotation that cannot be "
                                          r"resolved \(NameError: name 'Decimal'"):
        structure_strict({"rounds": "5"}, Unresolvable, where="[strategy]")


@attrs.frozen
class Flags:
    stage_id: str = ""
    rounds: int = 1
    rate: float = 0.1
    strict: bool = False
    limit: int | None = None
    sizes: list[int] = attrs.field(factory=list)


def test_key_value_options_read_values_with_tomls_grammar():
    table = parse_options(["rounds=8", "rate=1", "strict=true", "limit=3", "sizes=[64, 32]",
                           "stage_id=007", 'extra="a b"', "path=/data/a.csv"], Flags,
                          flag="--x-option", table="[x]")
    assert table == {"rounds": 8, "rate": 1.0, "strict": True, "limit": 3, "sizes": [64, 32],
                     "stage_id": "007", "extra": "a b", "path": "/data/a.csv"}
    assert type(table["rate"]) is float


@pytest.mark.parametrize("pair, message", [
    ("rounds=8.5", "[x] rounds: expected an integer, got '8.5'"),
    ("rounds=true", "[x] rounds: expected an integer, got 'true'"),
    ("rate=fast", "[x] rate: expected a number, got 'fast'"),
    ("strict=yes", "[x] strict: expected true or false, got 'yes'"),
    ("limit=none", "[x] limit: expected an integer, got 'none'"),
    ("rounds", "--x-option 'rounds': expected KEY=VALUE"),
])
def test_a_key_value_option_that_does_not_read_as_its_type_names_the_key(pair, message):
    with pytest.raises(ConfigError) as err:
        parse_options([pair], Flags, flag="--x-option", table="[x]")
    assert str(err.value) == message


def test_an_attrs_validators_error_is_one_sentence_naming_the_key(tmp_path):
    # Before: "[mesh]: invalid value: (\"'launch' must be in ...\", Attribute(name=...), ...)"
    from meshkit.config import MeshTable

    with pytest.raises(ConfigError) as info:
        structure_strict({"launch": "inproc"}, MeshTable, where="[mesh]")
    assert str(info.value) == ("[mesh] launch: invalid value: 'launch' must be in ('local', "
                               "'external') (got 'inproc')")
    with pytest.raises(ConfigError) as info:
        structure_strict({"workers": 0}, MeshTable, where="[mesh]")
    assert str(info.value) == "[mesh] workers: invalid value: 'workers' must be >= 1: 0"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.0, -1.0])
def test_a_non_negative_option_refuses_nan_inf_and_negative_zero(value):
    from meshkit.options import non_negative

    @attrs.frozen
    class Scale:
        alpha: float = attrs.field(default=1.0, validator=non_negative)

    with pytest.raises(ConfigError, match=r"\[task\] alpha: .*must be a finite number >= 0"):
        structure_strict({"alpha": value}, Scale, where="[task]")
