"""Exact, order-free weighted sums: :class:`FixedPointSum` and the partial it hands on, :class:`FixedPartial`.

Rule: every contribution's float values times its weight are rounded once,
to a multiple of ``2**-F`` (``F = fraction_bits``, default
:data:`DEFAULT_FRACTION_BITS`), into int64 accumulators; the mass (the sum
of the weights) is rounded the same way and summed in an unbounded integer.
Integer sums are exact, so the total does not depend on the order of the
additions nor on how they were split into partials: partial(A) merged with
partial(B) gives the same bits as B with A, or as one sum over everything.
That is what lets a worker fold its own clients and a coordinator (or a
torch.distributed all-reduce over int64) add the partials without changing
a bit of the round's result, whoever served which client.

What it supports, and what it refuses (an :class:`~meshkit.AggregationError`):

* float arrays (float16, bfloat16, float32, float64) are summed and come
  back from :meth:`FixedPointSum.result` as the weighted mean in their own
  dtype (the integer sum divided by the integer mass in float64, rounded
  once to the dtype);
* integer and bool arrays are not averaged: they must be identical
  everywhere and pass through (as in :class:`~meshkit.aggregation.MeanFold`);
* JSON numbers are summed like array elements (their sums are int64 too),
  strings, bools and null must agree, and a number every contributor sent
  identically (same value and type) passes through unchanged; lists and
  objects must have the same shape everywhere (object keys compared as
  sets, so key order does not matter);
* NaN or inf in a contribution is refused, never summed;
* **range**: an accumulator holds ``|sum of w * x| < 2**(63 - F)``
  (2,147,483,648 at F = 32). Each contribution's largest ``|w * x|`` is
  added to a running bound *before* anything is summed, and a contribution
  that could overflow is refused with the range and what to do (lower
  ``fraction_bits``, or scale the weights down: only their ratios matter).
  The check is conservative: it may refuse a sum that would just fit.
* **precision**: each term is off by at most ``2**-(F+1)`` (1.2e-10 at F =
  32), so the mean is off by at most ``2**-(F+1) * count / mass``: below a
  float32's own rounding (``|x| * 2**-24``) for every value of magnitude
  above ``2**(-F+23) / w``, i.e. above 0.002 with weight 1 and far below it
  with weights that count examples. Choose a larger ``F`` for tiny values,
  a smaller one for a larger range.

A contribution refused leaves the sum unchanged (every check runs before
any accumulator is touched).
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Mapping

import attrs
import numpy as np

from meshkit.aggregation._contract import check_weight, default_source
from meshkit.aggregation._messages import describe
from meshkit.errors import AggregationError, StateError
from meshkit.state import (
    MAX_JSON_DEPTH,
    State,
    dtype_from_name,
    dtype_name,
    is_array,
    is_float_dtype,
    is_supported_dtype,
    json_depth,
)

__all__ = ["FixedPointSum", "FixedPartial", "DEFAULT_FRACTION_BITS", "ContributionOutOfRange"]


class ContributionOutOfRange(AggregationError):
    """One contribution holds a finite value (or a weight) the exact sum cannot hold.

    Raised before the sum changes, so the sum is as it was; the value is its
    sender's alone (1e308 is finite, but no fixed-point sum holds it), so a
    round drops that contribution's sender as it drops a non-finite one
    (docs/protocol.md section 7) instead of failing for everyone.
    """


#: Fraction bits of the default sum: resolution 2**-32, range 2**31 (module docstring).
DEFAULT_FRACTION_BITS = 32

_INT64_MAX = (1 << 63) - 1
#: Elements rounded and added per step: bounded scratch whatever the model's size.
_CHUNK = 1 << 16
#: Models of at most this many float elements (all float arrays, native dtypes)
#: are summed in one arena, a handful of numpy calls per contribution whatever
#: the number of arrays: a small model's cost is the calls, not the arithmetic.
_ARENA_MAX = 1 << 18
_NATIVE = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
#: The most contributions one partial may claim to hold (a sanity bound on the wire).
MAX_PARTIAL_COUNT = 1 << 40

# Wire layout of a partial (a flat state): scalars, then one prefix per kind of entry.
_SUM, _DTYPE, _EXACT, _JSON, _JSUM, _JSAME = "f:", "t:", "x:", "j:", "js:", "jq:"
_SCALARS = ("fraction_bits", "mass", "count")


@attrs.define
class FixedPartial:
    """An exact partial sum: int64 sums per float array, the mass, the count.

    ``sums`` maps each float key to its int64 accumulator (units of
    ``2**-fraction_bits``, the model's shape) and ``dtypes`` to the dtype the
    mean comes back in; ``exact`` holds the integer/bool arrays that pass
    through; ``json`` each JSON entry's template (the value with its first
    contributor's numbers), ``json_sums`` / ``json_same`` its number leaves'
    int64 sums and whether every contributor sent that leaf identically
    (leaves in canonical order: objects by sorted key). ``mass`` is the sum
    of the rounded weights in the same units (an unbounded integer).

    :meth:`to_wire` gives it as one flat state of plain arrays and JSON
    numbers (nothing pickled); :meth:`from_wire` checks one that came from
    elsewhere like any message (a :class:`~meshkit.AggregationError` naming
    what does not fit).
    """

    fraction_bits: int
    mass: int
    count: int
    sums: dict[str, np.ndarray] = attrs.Factory(dict)
    dtypes: dict[str, np.dtype] = attrs.Factory(dict)
    exact: dict[str, np.ndarray] = attrs.Factory(dict)
    json: dict[str, Any] = attrs.Factory(dict)
    json_sums: dict[str, np.ndarray] = attrs.Factory(dict)
    json_same: dict[str, np.ndarray] = attrs.Factory(dict)
    #: The keys in the order the result gives them (the first contributor's).
    order: list[str] = attrs.Factory(list)

    def to_wire(self) -> dict[str, Any]:
        """The partial as a flat state: ``fraction_bits``, ``mass``, ``count`` and prefixed entries."""
        wire: dict[str, Any] = {"fraction_bits": self.fraction_bits, "mass": self.mass,
                                "count": self.count}
        for key in self.order:
            if key in self.sums:
                wire[_SUM + key] = self.sums[key]
                wire[_DTYPE + key] = dtype_name(self.dtypes[key])
            elif key in self.exact:
                wire[_EXACT + key] = self.exact[key]
            else:
                wire[_JSON + key] = self.json[key]
                wire[_JSUM + key] = self.json_sums[key]
                wire[_JSAME + key] = self.json_same[key]
        return wire

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any], *, what: str = "a partial sum",
                  max_count: int = MAX_PARTIAL_COUNT) -> "FixedPartial":
        """A partial that came from elsewhere, checked; :class:`AggregationError` if it does not fit.

        Checked: the scalars' types and ranges (``count <= max_count``, mass
        >= 0 and below ``count * 2**(63 + fraction_bits)``), every entry's
        kind and dtype (sums int64 and never ``-2**63``, a dtype for each
        sum), each JSON entry's number leaves matching its sums and flags.
        Shapes against the model are the caller's to check
        (:meth:`matches`).
        """
        def bad(message: str) -> AggregationError:
            return AggregationError(f"{what}: {message}")

        if not isinstance(wire, Mapping):
            raise bad(f"expected a flat state, got {type(wire).__name__}")
        scalars = {}
        for name in _SCALARS:
            value = wire.get(name)
            if type(value) is not int:
                raise bad(f"{name!r} must be an integer, got {describe(value)}")
            scalars[name] = value
        bits, count, mass = scalars["fraction_bits"], scalars["count"], scalars["mass"]
        if not 0 <= bits <= 62:
            raise bad(f"fraction_bits = {bits} is out of range [0, 62]")
        if not 0 <= count <= max_count:
            raise bad(f"count = {count} is out of range [0, {max_count}]")
        # Each contribution's rounded weight is below 2**63 units of its own
        # values' range; no contributions, no mass.
        if not 0 <= mass <= count * (_INT64_MAX << bits):
            raise bad(f"mass = {mass} is out of range for {count} contributions")
        partial = cls(bits, mass, count)
        pending: dict[str, dict[str, Any]] = {}
        for name, value in wire.items():
            if name in _SCALARS:
                continue
            if not isinstance(name, str):
                raise bad(f"the entry name {name!r} is not a string")
            prefix, _, key = name.partition(":")
            if not key:
                raise bad(f"unknown entry {name!r}")
            pending.setdefault(prefix + ":", {})[key] = value
        for key, value in pending.pop(_SUM, {}).items():
            partial.sums[key] = _int64(value, f"{what}: the sum of {key!r}")
            dtype = pending.get(_DTYPE, {}).pop(key, None)
            if not isinstance(dtype, str):
                raise bad(f"the sum of {key!r} comes without its dtype")
            try:
                parsed = dtype_from_name(dtype)
            except StateError:
                raise bad(f"{key!r} has the unknown dtype {dtype!r}") from None
            if not is_float_dtype(parsed):
                raise bad(f"{key!r} has dtype {dtype}, not a float dtype")
            partial.dtypes[key] = parsed
            partial.order.append(key)
        for key, value in pending.pop(_EXACT, {}).items():
            if key in partial.sums or not is_array(value) or is_float_dtype(value.dtype) \
                    or not is_supported_dtype(value.dtype):
                raise bad(f"the pass-through entry {key!r} must be an integer or bool array "
                          f"of its own, got {describe(value)}")
            partial.exact[key] = np.asarray(value)
            partial.order.append(key)
        for key, value in pending.pop(_JSON, {}).items():
            if key in partial.sums or key in partial.exact:
                raise bad(f"{key!r} is sent twice")
            if is_array(value) or json_depth(value) > MAX_JSON_DEPTH:
                raise bad(f"the JSON entry {key!r} is {describe(value)}")
            leaves = list(_numbers(value))
            sums = _int64(pending.get(_JSUM, {}).pop(key, None), f"{what}: the sums of {key!r}")
            same = pending.get(_JSAME, {}).pop(key, None)
            if not is_array(same) or same.dtype != np.bool_ or same.shape != (len(leaves),) \
                    or sums.shape != (len(leaves),):
                raise bad(f"the JSON entry {key!r} has {len(leaves)} numbers but its sums "
                          f"and flags do not match them")
            if not all(isinstance(n, (int, float)) and math.isfinite(n) for n in leaves):
                raise bad(f"the JSON entry {key!r} holds a non-finite number")
            partial.json[key] = value
            partial.json_sums[key] = sums
            partial.json_same[key] = np.asarray(same)
            partial.order.append(key)
        left = sorted(prefix + key for prefix, entries in pending.items() for key in entries)
        if left:
            raise bad(f"unknown or unmatched entries {left[:5]}")
        # The result gives the keys in the order the partial listed them (the model's).
        listed = {name.partition(":")[2]: None for name in wire
                  if isinstance(name, str) and name[:2] in (_SUM, _EXACT, _JSON)}
        partial.order = [key for key in listed if key in set(partial.order)]
        return partial

    def matches(self, signature: Mapping[str, Any]) -> str | None:
        """Why this partial does not fit a model's ``signature`` (key -> (shape, dtype) or
        None for JSON, :func:`meshkit.train` 's), or None when it does."""
        keys = set(self.order)
        if keys != set(signature):
            missing = sorted(set(signature) - keys)[:5]
            extra = sorted(keys - set(signature))[:5]
            return f"missing keys {missing or 'none'}, unknown keys {extra or 'none'}"
        for key, want in signature.items():
            if want is None:
                if key not in self.json:
                    return f"{key!r} is an array where the model has a JSON value"
                continue
            shape, dtype = want
            if key in self.sums:
                got_shape, got_dtype = self.sums[key].shape, self.dtypes[key]
            elif key in self.exact:
                got_shape, got_dtype = self.exact[key].shape, self.exact[key].dtype
            else:
                return f"{key!r} is a JSON value where the model has an array"
            if tuple(got_shape) != tuple(shape) or got_dtype != dtype:
                return (f"{key!r} is {dtype_name(got_dtype)}{list(got_shape)} where the model "
                        f"has {dtype_name(dtype)}{list(shape)}")
        return None


def _int64(value: Any, what: str) -> np.ndarray:
    if not is_array(value) or np.asarray(value).dtype != np.int64:
        raise AggregationError(f"{what} must be an int64 array, got {describe(value)}")
    value = np.asarray(value)
    if value.size and int(value.min()) == -(1 << 63):
        raise AggregationError(f"{what} holds -2**63, which no honest sum reaches")
    return value


def _numbers(value: Any) -> Iterator[Any]:
    """The number leaves of a JSON value, in canonical order (objects by sorted key)."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node[k] for k in sorted(node, reverse=True))
        elif isinstance(node, list):
            stack.extend(reversed(node))
        elif type(node) in (int, float):
            yield node


def _skeleton(value: Any) -> Any:
    """A JSON value with every number replaced by a marker: what must agree everywhere."""
    if isinstance(value, dict):
        return ("{", tuple(sorted((str(k), _skeleton(v)) for k, v in value.items())))
    if isinstance(value, list):
        return ("[", tuple(_skeleton(v) for v in value))
    if type(value) in (int, float):
        return "#"
    return ("=", type(value).__name__, value)


def _bound(array: np.ndarray) -> int:
    """The largest |element| of an int64 array (0 when empty)."""
    if not array.size:
        return 0
    return max(int(array.max()), -int(array.min()))


class FixedPointSum:
    """An exact, order-free weighted sum of states; the weighted mean at :meth:`result`.

    ``FixedPointSum(fraction_bits=32)``: add contributions with
    :meth:`add`, other sums' partials with :meth:`merge`; :meth:`partial`
    hands the sum on (to be merged elsewhere), :meth:`result` gives the mean.
    The module docstring has the rules, the range and the precision.
    A state given to :meth:`add` is read at once and not kept.
    """

    def __init__(self, fraction_bits: int = DEFAULT_FRACTION_BITS, *,
                 name: str = "fixed-point sum") -> None:
        if isinstance(fraction_bits, bool) or not isinstance(fraction_bits, int) \
                or not 0 <= fraction_bits <= 62:
            raise ValueError(f"fraction_bits must be an integer in [0, 62], got "
                             f"{fraction_bits!r}")
        self.fraction_bits = fraction_bits
        self.name = name
        self._one = float(2 ** fraction_bits)
        self._partial = FixedPartial(fraction_bits, 0, 0)
        self._bounds: dict[str, int] = {}  # key -> an upper bound of |accumulator|
        self.sources: list[str] = []
        self._first = ""  # who set the template
        self._done = False
        # The arena of a small all-float model: (keys, shapes, dtypes), the int64
        # sums (each key's a view into it) and float64/int64 scratch of its size.
        self._fast: tuple[list[str], list[tuple[int, ...]], list[np.dtype]] | None = None
        self._arena = self._wide = self._ints = np.empty(0)

    # -- public -------------------------------------------------------------------------------

    @property
    def count(self) -> int:
        """How many contributions the sum holds (merged partials count theirs)."""
        return self._partial.count

    @property
    def mass(self) -> float:
        """The sum of the (rounded) weights."""
        return self._partial.mass / self._one

    @property
    def limit(self) -> float:
        """The largest ``|sum of w * x|`` an accumulator holds: ``2**(63 - fraction_bits)``."""
        return _INT64_MAX / self._one

    def add(self, state: State, weight: float = 1.0, *, source: str | None = None) -> None:
        """Add ``weight * state``; a refused contribution leaves the sum unchanged."""
        self._check_open()
        label = source or default_source(self.count)
        w = check_weight(weight, label, name=self.name)
        if not isinstance(state, Mapping):
            raise self._fail(f"{label} sent {type(state).__name__}, expected a state (a "
                             f"mapping of name -> array or JSON value)")
        mass = round(w * self._one)
        scale = w * self._one
        if not math.isfinite(scale):
            raise self._range(label, None, w, "its weight alone")
        first = not self._partial.order
        if not first and self._add_fast(state, scale, label):
            self._partial.mass += mass
            self._partial.count += 1
            self.sources.append(label)
            return
        plan: list[tuple[str, np.ndarray, int]] = []  # (key, flat float values, bound)
        json_plan: list[tuple[str, Any, list[Any], int]] = []
        leaves_of: dict[str, list[Any]] = {}
        if first:
            self._check_keys_first(state, label)
        else:
            self._check_keys(list(state), label)
        for key, value in state.items():
            if is_array(value):
                value = np.asarray(value)
                if not is_supported_dtype(value.dtype):
                    raise self._error(key, f"{label} sent dtype {value.dtype}, which cannot "
                                           f"be averaged; use a float, integer or bool array")
                if is_float_dtype(value.dtype):
                    self._check_array(key, value, label, float_=True, first=first)
                    flat = value.reshape(-1)
                    plan.append((key, flat, self._term_bound(key, flat, scale, w, label)))
                else:
                    self._check_array(key, value, label, float_=False, first=first)
            else:
                if json_depth(value) > MAX_JSON_DEPTH:
                    raise self._error(key, f"{label} sent JSON nested more than "
                                           f"{MAX_JSON_DEPTH} levels deep; flatten it")
                if not first:
                    self._check_json(key, value, label)
                leaves = leaves_of[key] = list(_numbers(value))
                _check_json_numbers(self, key, leaves, label)
                biggest = max((abs(float(n)) for n in leaves), default=0.0)
                json_plan.append((key, value, leaves,
                                  self._checked_bound(key, biggest * scale, w, label)))
        # Every check passed: now the sums change.
        part = self._partial
        if first:
            self._first = label
            self._make_arena(state)
            for key, value in state.items():
                part.order.append(key)
                if is_array(value):
                    value = np.asarray(value)
                    if is_float_dtype(value.dtype):
                        if key not in part.sums:  # (the arena's are there already)
                            part.sums[key] = np.zeros(value.shape, dtype=np.int64)
                        part.dtypes[key] = value.dtype
                    else:
                        part.exact[key] = np.array(value, copy=True)
                else:
                    part.json[key] = _copy_json(value)
                    n = len(leaves_of[key])
                    part.json_sums[key] = np.zeros(n, dtype=np.int64)
                    part.json_same[key] = np.ones(n, dtype=np.bool_)
        for key, flat, bound in plan:
            _accumulate(part.sums[key].reshape(-1), flat, scale)
            self._bounds[key] = self._bounds.get(key, 0) + bound
        for key, value, leaves, bound in json_plan:
            sums = part.json_sums[key]
            firsts = list(_numbers(part.json[key]))
            for i, n in enumerate(leaves):
                sums[i] += int(round(float(n) * scale))
                if type(n) is not type(firsts[i]) or n != firsts[i]:
                    part.json_same[key][i] = False
            self._bounds[key] = self._bounds.get(key, 0) + bound
        part.mass += mass
        part.count += 1
        self.sources.append(label)

    def _make_arena(self, state: Mapping[str, Any]) -> None:
        """One int64 arena for a small model of native float arrays only (see _ARENA_MAX)."""
        values = list(state.values())
        if not all(isinstance(v, np.ndarray) and v.dtype in _NATIVE for v in values):
            return
        total = sum(v.size for v in values)
        if not 0 < total <= _ARENA_MAX:
            return
        self._arena = np.zeros(total, dtype=np.int64)
        self._wide = np.empty(total, dtype=np.float64)
        self._ints = np.empty(total, dtype=np.int64)
        start = 0
        for key, value in state.items():
            self._partial.sums[key] = self._arena[start:start + value.size].reshape(value.shape)
            start += value.size
        self._fast = (list(state), [v.shape for v in values], [v.dtype for v in values])

    def _add_fast(self, state: Mapping[str, Any], scale: float, label: str) -> bool:
        """Add a contribution that fits the arena; False (nothing changed) sends it down the
        general path, which words any refusal."""
        fast = self._fast
        if fast is None or not isinstance(state, dict) or len(state) != len(fast[0]):
            return False
        keys, shapes, dtypes = fast
        flats = []
        for key, shape, dtype in zip(keys, shapes, dtypes):
            value = state.get(key)
            if type(value) is not np.ndarray or value.shape != shape or value.dtype != dtype:
                return False
            flats.append(value.reshape(-1))
        wide = self._wide
        np.concatenate(flats, out=wide, casting="same_kind")
        # Bounded before scaling (rounding w * x is monotone in x): nothing can overflow.
        biggest = max(float(wide.max()), -float(wide.min())) * scale
        if not biggest < _INT64_MAX:  # NaN, inf or out of range: refused on the general path
            return False
        np.multiply(wide, scale, out=wide)
        np.rint(wide, out=wide)
        bound = round(biggest)
        if any(self._bounds.get(key, 0) + bound > _INT64_MAX for key in keys):
            return False
        np.copyto(self._ints, wide, casting="unsafe")
        np.add(self._arena, self._ints, out=self._arena)
        for key in keys:
            self._bounds[key] = self._bounds.get(key, 0) + bound
        return True

    def merge(self, partial: FixedPartial, *, source: str | None = None) -> None:
        """Add another sum's partial; a refused partial leaves this sum unchanged.

        Its sums must fit the same model (keys, shapes, dtypes), with the same
        pass-through arrays and JSON constants, and the same ``fraction_bits``.
        The partial belongs to this sum afterwards: the first one merged into
        an empty sum becomes its accumulator (no copy), so do not reuse it.
        """
        self._check_open()
        label = source or f"partial #{len(self.sources)}"
        if not isinstance(partial, FixedPartial):
            raise self._fail(f"{label} is {type(partial).__name__}, not a FixedPartial")
        if partial.fraction_bits != self.fraction_bits:
            raise self._fail(f"{label} counts in units of 2**-{partial.fraction_bits}, this "
                             f"sum in 2**-{self.fraction_bits}; every partial of one sum "
                             f"needs the same fraction_bits")
        if not partial.order:
            if partial.count or partial.mass:
                raise self._fail(f"{label} claims {partial.count} contributions but holds "
                                 f"no entries")
            return
        part = self._partial
        bounds = {key: _bound(array) for key, array in
                  [*partial.sums.items(), *partial.json_sums.items()]}
        if part.order:
            self._check_keys(partial.order, label)
            for key in part.order:
                if key in part.sums:
                    if key not in partial.sums or partial.sums[key].shape != part.sums[key].shape \
                            or partial.dtypes[key] != part.dtypes[key]:
                        raise self._error(key, f"{label} has a different shape or dtype for "
                                               f"it than {self._first}")
                elif key in part.exact:
                    other = partial.exact.get(key)
                    if other is None or other.dtype != part.exact[key].dtype \
                            or not np.array_equal(other, part.exact[key]):
                        raise self._error(key, f"{label} and {self._first} have different "
                                               f"integer or bool arrays; they are not "
                                               f"averaged, they must be identical everywhere")
                else:
                    if key not in partial.json:
                        raise self._error(key, f"{label} has an array where {self._first} "
                                               f"has a JSON value")
                    self._check_json(key, partial.json[key], label)
            for key, bound in bounds.items():
                total = self._bounds.get(key, 0) + bound
                if total > _INT64_MAX:
                    raise self._overflow(key, label)
        for key, bound in bounds.items():
            if bound > _INT64_MAX:  # pragma: no cover - _int64 refuses -2**63 already
                raise self._overflow(key, label)
        # Checked: now the sums change.
        if not part.order:
            # The first partial becomes the sum: its arrays are taken over, not
            # copied (writable, contiguous ones; anything else is copied once).
            self._first = label
            part.order = list(partial.order)
            part.sums = {k: _owned(v) for k, v in partial.sums.items()}
            part.dtypes = dict(partial.dtypes)
            part.exact = dict(partial.exact)
            part.json = {k: _copy_json(v) for k, v in partial.json.items()}
            part.json_sums = {k: _owned(v) for k, v in partial.json_sums.items()}
            part.json_same = {k: _owned(v) for k, v in partial.json_same.items()}
        else:
            for key, array in partial.sums.items():
                np.add(part.sums[key], array, out=part.sums[key])
            for key, array in partial.json_sums.items():
                np.add(part.json_sums[key], array, out=part.json_sums[key])
                mine = list(_numbers(part.json[key]))
                theirs = list(_numbers(partial.json[key]))
                differ = np.array([type(a) is not type(b) or a != b
                                   for a, b in zip(mine, theirs)], dtype=np.bool_)
                same = part.json_same[key]
                np.logical_and(same, partial.json_same[key], out=same)
                if differ.size:
                    np.logical_and(same, ~differ, out=same)
        for key, bound in bounds.items():
            self._bounds[key] = self._bounds.get(key, 0) + bound
        part.mass += partial.mass
        part.count += partial.count
        self.sources.append(label)

    def partial(self) -> FixedPartial:
        """Hand the sum on: its :class:`FixedPartial` (by reference; this sum is finished)."""
        self._check_open()
        self._done = True
        return self._partial

    def result(self) -> dict[str, Any]:
        """The weighted mean of everything added: each array in its input dtype."""
        self._check_open()
        part = self._partial
        if not part.order:
            raise self._fail("no contributions to aggregate; a round needs at least one "
                             "contributor")
        if part.mass <= 0:
            raise self._fail(f"the weights sum to zero over {part.count} contributions; at "
                             f"least one contributor must have done some work (weight > 0)")
        self._done = True
        mass = float(part.mass)
        out: dict[str, Any] = {}
        for key in part.order:
            if key in part.sums:
                # Chunk by chunk, each accumulator dropped once read: the mean
                # never costs more than the sums plus the result.
                out[key] = _mean(part.sums.pop(key), mass, part.dtypes[key])
            elif key in part.exact:
                out[key] = part.exact[key]
            else:
                means = [n if same else int(total) / part.mass
                         for n, same, total in zip(_numbers(part.json[key]),
                                                   part.json_same[key].tolist(),
                                                   part.json_sums[key].tolist())]
                out[key] = _refill(part.json[key], iter(means))
        return out

    # -- checks --------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._done:
            raise self._fail("this sum was already handed on (partial) or produced its "
                             "result; begin a new one")

    def _fail(self, message: str) -> AggregationError:
        return AggregationError(f"{self.name}: {message}")

    def _error(self, key: str, message: str) -> AggregationError:
        error = AggregationError(f"{self.name}: aggregating {key!r}: {message}")
        error.key = key  # type: ignore[attr-defined]
        return error

    def _check_keys_first(self, state: Mapping[str, Any], label: str) -> None:
        for key in state:
            if not isinstance(key, str) or not key:
                raise self._fail(f"{label} sent the key {key!r}; state keys must be "
                                 f"non-empty strings")

    def _check_keys(self, keys: list[str], label: str) -> None:
        mine = set(self._partial.order)
        if set(keys) != mine:
            missing = sorted(mine - set(keys))[:5]
            extra = sorted(set(keys) - mine, key=str)[:5]
            raise self._fail(f"{label} sends keys that differ from {self._first}'s (missing "
                             f"{missing or 'none'}, extra {extra or 'none'}); every "
                             f"contributor must send the same keys")

    def _check_array(self, key: str, value: np.ndarray, label: str, *, float_: bool,
                     first: bool) -> None:
        if first:
            return
        part = self._partial
        if float_:
            if key not in part.sums:
                raise self._error(key, f"{label} sent {describe(value)} where {self._first} "
                                       f"sent {self._what(key)}")
            have_shape, have_dtype = part.sums[key].shape, part.dtypes[key]
        else:
            if key not in part.exact:
                raise self._error(key, f"{label} sent {describe(value)} where {self._first} "
                                       f"sent {self._what(key)}")
            have_shape, have_dtype = part.exact[key].shape, part.exact[key].dtype
        if value.shape != have_shape or value.dtype != have_dtype:
            raise self._error(key, f"{label} sent {describe(value)} where {self._first} sent "
                                   f"a {dtype_name(have_dtype)} array of shape {have_shape}; "
                                   f"every contributor must hold the same model")
        if not float_ and not np.array_equal(value, part.exact[key]):
            raise self._error(key, f"{label} and {self._first} sent different "
                                   f"{dtype_name(value.dtype)} arrays; integer and bool arrays "
                                   f"are not averaged, they must be identical everywhere")

    def _what(self, key: str) -> str:
        part = self._partial
        if key in part.sums:
            return f"a {dtype_name(part.dtypes[key])} array"
        if key in part.exact:
            return f"a {dtype_name(part.exact[key].dtype)} array"
        return describe(part.json[key])

    def _check_json(self, key: str, value: Any, label: str) -> None:
        part = self._partial
        if key not in part.json:
            raise self._error(key, f"{label} sent {describe(value)} where {self._first} sent "
                                   f"{self._what(key)}")
        if _skeleton(value) != _skeleton(part.json[key]):
            raise self._error(key, f"{label} sent {describe(value)} whose structure or "
                                   f"strings, bools and nulls differ from {self._first}'s; "
                                   f"only numbers average, the rest must be identical "
                                   f"everywhere")

    def _term_bound(self, key: str, flat: np.ndarray, scale: float, w: float,
                    label: str) -> int:
        """max |round(w * x * 2**F)| over ``flat``, checked finite and in range."""
        if not flat.size:
            return 0
        hi, lo = float(flat.max()), float(flat.min())
        if not (math.isfinite(hi) and math.isfinite(lo)):
            raise self._error(key, f"{label} sent NaN or inf; non-finite values are refused "
                                   f"(a diverged contributor must not be averaged into the "
                                   f"others). Find why it diverged")
        return self._checked_bound(key, max(hi, -lo) * scale, w, label)

    def _checked_bound(self, key: str, biggest: float, w: float, label: str) -> int:
        term = round(biggest) if math.isfinite(biggest) else math.inf
        if term > _INT64_MAX:
            raise self._range(label, key, w, "one weighted value")
        bound = int(term)
        if self._bounds.get(key, 0) + bound > _INT64_MAX:
            raise self._overflow(key, label)
        return bound

    def _range(self, label: str, key: str | None, w: float, what: str) -> AggregationError:
        where = f"aggregating {key!r}: " if key else ""
        return ContributionOutOfRange(
            f"{self.name}: {where}{what} from {label} (weight {w:g}) is beyond the range of "
            f"a {self.fraction_bits}-bit fixed-point sum (|weight * value| < {self.limit:g}); "
            f"scale the weights down (only their ratios matter) or lower fraction_bits")

    def _overflow(self, key: str, label: str) -> AggregationError:
        return self._error(
            key, f"adding {label} could overflow the int64 sum: this sum holds "
                 f"|sum of weight * value| < {self.limit:g} (fraction_bits = "
                 f"{self.fraction_bits}); scale the weights down (only their ratios matter), "
                 f"lower fraction_bits, or fold fewer contributions into one sum")


def _check_json_numbers(fold: FixedPointSum, key: str, leaves: list[Any], label: str) -> None:
    for n in leaves:
        if type(n) is int and abs(n) > 1 << 1023:
            raise fold._error(key, f"{label} sent an integer beyond the float64 range; "
                                   f"numbers average in fixed point, store it as a string")
        if not math.isfinite(float(n)):
            raise fold._error(key, f"{label} sent the number {n!r}; non-finite values are "
                                   f"refused")


def _accumulate(acc: np.ndarray, x: np.ndarray, scale: float) -> None:
    """acc += round(x * scale) as int64, chunk by chunk (checked in range beforehand)."""
    step = min(_CHUNK, x.size) or 1
    wide = np.empty(step, dtype=np.float64)
    ints = np.empty(step, dtype=np.int64)
    for start in range(0, x.size, step):
        stop = min(start + step, x.size)
        n = stop - start
        t, i = wide[:n], ints[:n]
        np.copyto(t, x[start:stop], casting="unsafe")  # widen first: bf16 * w rounds in bf16
        np.multiply(t, scale, out=t)
        np.rint(t, out=t)
        np.copyto(i, t, casting="unsafe")
        a = acc[start:stop]
        np.add(a, i, out=a)


def _owned(array: np.ndarray) -> np.ndarray:
    """``array`` itself when this sum may add into it in place, else a copy."""
    if array.flags.c_contiguous and array.flags.writeable and array.base is None:
        return array
    return np.array(array, copy=True, order="C")  # (ascontiguousarray makes a 0-d array 1-d)


def _mean(sums: np.ndarray, mass: float, dtype: np.dtype) -> np.ndarray:
    """``sums / mass`` in ``dtype``: each element's int64 sum to float64, divided, rounded once."""
    out = np.empty(sums.shape, dtype=dtype)
    flat, target = sums.reshape(-1), out.reshape(-1)
    step = min(_CHUNK, flat.size) or 1
    wide = np.empty(step, dtype=np.float64)
    for start in range(0, flat.size, step):
        stop = min(start + step, flat.size)
        t = wide[:stop - start]
        np.copyto(t, flat[start:stop], casting="unsafe")
        np.divide(t, mass, out=t)
        np.copyto(target[start:stop], t, casting="unsafe")
    return out


def _copy_json(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_json(v) for v in value]
    return value


def _refill(template: Any, numbers: Iterator[Any]) -> Any:
    """``template`` with its number leaves replaced, in canonical order, from ``numbers``."""
    if isinstance(template, dict):
        filled = {k: _refill(template[k], numbers) for k in sorted(template)}
        return {k: filled[k] for k in template}
    if isinstance(template, list):
        return [_refill(v, numbers) for v in template]
    if type(template) in (int, float):
        return next(numbers)
    return template
