"""Config tables into options classes (``meshkit.options``): strict types, named errors."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import pytest

from meshkit import ConfigError, PluginError
from meshkit.options import structure_strict

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
