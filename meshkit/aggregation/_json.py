"""JSON leaves: numbers average by weight, objects key by key, lists position by position.

A contribution's JSON values are first turned into a template (one node per
number, constant, list or object) by :func:`json_template`; every later
contribution is checked against it (:func:`json_check`) before anything is
summed, then folded in (:func:`json_accumulate`). Strings, bools and None
pass only when every contributor agrees; identical numbers pass through
unchanged. Refusals are raised through the fold (``fold._error``), so they
carry the key path and contributors like every other refusal of the mean.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from meshkit.aggregation._messages import describe, listing, short

_FLOAT_MAX = sys.float_info.max


class JsonNumber:
    """A number leaf: its running weighted sum, and whether every value so far was the first."""

    __slots__ = ("first", "total", "same", "path")

    def __init__(self, first: Any, path: str = "") -> None:
        self.first = first
        self.path = path
        self.total = 0.0
        self.same = True


class JsonConst:
    """A string, bool or None leaf: must be identical everywhere."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value



def json_template(value: Any, path: str, label: str, fold: Any) -> Any:
    if value is None or type(value) in (bool, str):
        return JsonConst(value)
    if type(value) in (int, float):
        _check_json_int(value, path, label, [label], fold)
        if not fold.allow_nonfinite and not math.isfinite(value):
            raise fold._error(path, f"{label} sent the number {value!r}; non-finite values "
                                    f"are refused by default", label)
        return JsonNumber(value, path)
    if isinstance(value, list):
        return [json_template(v, f"{path}[{i}]", label, fold) for i, v in enumerate(value)]
    if isinstance(value, dict):
        node = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise fold._error(path, f"{label} sent an object with the non-string key "
                                        f"{k!r}; JSON object keys are strings", label)
            node[k] = json_template(v, f"{path}.{k}", label, fold)
        return node
    raise fold._error(path, f"{label} sent {describe(value)}; a state value must be a numpy "
                            f"array or a JSON value (number, string, bool, None, list, dict)",
                      label)


def _check_json_int(value: Any, path: str, label: str, contributors: list[str],
                    fold: Any) -> None:
    # JSON integers are unbounded; one past float64's range would raise
    # OverflowError when weighted (and from math.isfinite).
    if type(value) is int and abs(value) > _FLOAT_MAX:
        raise fold._error(path, f"{label} sent the integer {short(value)}, beyond the float64 "
                                f"range; numbers average in floating point, so store a value "
                                f"this large as a string", *contributors)


def json_check(node: Any, value: Any, path: str, label: str, first: str,
                fold: Any) -> None:
    if isinstance(node, JsonNumber):
        if type(value) not in (int, float):
            raise fold._error(path, f"{label} sent {describe(value)} where {first} sent "
                                    f"{describe(node.first)}", label, first)
        _check_json_int(value, path, label, [label, first], fold)
        if not fold.allow_nonfinite and not math.isfinite(value):
            raise fold._error(path, f"{label} sent the number {value!r}; non-finite values "
                                    f"are refused by default", label, first)
    elif isinstance(node, list):
        if not isinstance(value, list):
            raise fold._error(path, f"{label} sent {describe(value)} where {first} sent a "
                                    f"list of {len(node)}", label, first)
        if len(value) != len(node):
            raise fold._error(path, f"{label} sent a list of {len(value)} where {first} sent "
                                    f"a list of {len(node)}; lists average position by "
                                    f"position and must have the same length", label, first)
        for i, (child, item) in enumerate(zip(node, value)):
            json_check(child, item, f"{path}[{i}]", label, first, fold)
    elif isinstance(node, dict):
        if not isinstance(value, dict):
            raise fold._error(path, f"{label} sent {describe(value)} where {first} sent an "
                                    f"object", label, first)
        for k in node:
            if k not in value:
                raise fold._error(path, f"key {k!r} is missing from {label}, but {first} "
                                        f"sent it; objects average key by key and must have "
                                        f"the same keys", label, first)
        for k in value:
            if k not in node:
                raise fold._error(path, f"{label} sent key {k!r}, which {first} did not; "
                                        f"objects average key by key and must have the same "
                                        f"keys", label, first)
        for k, child in node.items():
            json_check(child, value[k], f"{path}.{k}", label, first, fold)
    else:
        const = node.value
        if type(value) is not type(const) or value != const:
            raise fold._error(path, f"{label} sent {describe(value)} where {first} sent "
                                    f"{describe(const)}; only numbers average, so strings, "
                                    f"bools and null must be identical everywhere",
                              label, first)


def json_accumulate(node: Any, value: Any, factor: float) -> None:
    if isinstance(node, JsonNumber):
        if factor:
            node.total += factor * value
        if value != node.first or type(value) is not type(node.first):
            node.same = False
    elif isinstance(node, list):
        for child, item in zip(node, value):
            json_accumulate(child, item, factor)
    elif isinstance(node, dict):
        for k, child in node.items():
            json_accumulate(child, value[k], factor)


def json_rescale(node: Any, scale: float) -> None:
    if isinstance(node, JsonNumber):
        node.total *= scale
    elif isinstance(node, list):
        for child in node:
            json_rescale(child, scale)
    elif isinstance(node, dict):
        for child in node.values():
            json_rescale(child, scale)


def json_result(node: Any, divisor: float, fold: Any) -> Any:
    if isinstance(node, JsonNumber):
        # Identical numbers pass through unchanged (an int stays an int, and
        # a weighted mean of equal floats cannot drift by an ulp).
        if node.same:
            return node.first
        mean = node.total / divisor
        if not fold.allow_nonfinite and not math.isfinite(mean):
            # Every input was finite (checked at add()): the float64 sum overflowed.
            labels = list(fold.sources)
            raise fold._error(node.path, f"the weighted sum overflowed float64 while adding "
                                         f"{listing(labels)}; numbers this large cannot be "
                                         f"averaged, store them scaled down", *labels)
        return mean
    if isinstance(node, list):
        return [json_result(child, divisor, fold) for child in node]
    if isinstance(node, dict):
        return {k: json_result(child, divisor, fold) for k, child in node.items()}
    return node.value
