"""The strict mean: :class:`MeanFold`, the streaming (weighted) mean behind ``allreduce`` and ``fedavg``.

Its rules (docs/aggregators.md has them as formulas):

* every contributor sends the same keys; arrays agree in shape and dtype;
  float arrays are averaged, accumulated in float32 (float16, bfloat16,
  float32) or float64 (float64, or any float with ``wide=True``), and come
  back in their input dtype;
* integer and bool arrays are not averaged: they must be identical
  everywhere and pass through;
* JSON leaves average as :mod:`meshkit.aggregation._json` says;
* NaN/inf in a contribution is refused (unless ``allow_nonfinite``), and so
  is a finite value out of range: beyond :func:`value_limit`, the square
  root of the accumulation dtype's largest value (1.3e154 when the sum is
  float64, 1.8e19 when it is float32). No model value is that large (its
  square overflows), and a few such values overflow the sum: under a mean
  one worker's 1e308 would otherwise be averaged in. The fold sees it in
  its running weighted sum (a cheap test per chunk, which also finds
  NaN/inf): a value a far smaller weight scales back into range is not
  seen there -- the round engine's boundary scan
  (:func:`meshkit.train.check_contribution` with a limit) refuses every one
  exactly;
* a weight is a finite number >= 0, and the weights must not sum to zero;
* one contributor is the identity, exactly (bit for bit, same dtype);
* the mass is divided out once, at ``result()``.

Each refusal is an :class:`~meshkit.AggregationError` naming the key and the
contributors involved (``source`` labels, default ``"contributor #i"``).
:func:`check_contributions` applies the same rules, without the arithmetic,
for a plain aggregator that computes something else.
"""

from __future__ import annotations

from collections import abc
import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from meshkit.aggregation._arenas import arena
from meshkit.aggregation._contract import check_weight, default_source
from meshkit.aggregation._kernel import MIN_ELEMENTS as KERNEL_MIN_ELEMENTS, fold_kernel
from meshkit.aggregation._json import (
    json_accumulate,
    json_check,
    json_rescale,
    json_result,
    json_template,
)
from meshkit.aggregation._messages import describe, listing
from meshkit.aggregation._threads import DEFAULT_THREADS, run_tasks, tasks, workers_for
from meshkit.errors import AggregationError
from meshkit.state import (
    ARRAY_TYPES,
    BFLOAT16,
    FLOAT_DTYPE_SET,
    MAX_JSON_DEPTH,
    State,
    accumulate_dtype,
    dtype_name,
    is_array,
    is_float_dtype,
    is_supported_dtype,
    json_depth,
)

#: Elements per step of the fold's inner loop. 64Ki float32 = 256 KiB, so a
#: chunk's two scratch buffers and its slice of the accumulator stay in L2
#: while a pair's weighted sum is formed and added (docs/benchmarks/aggregate.md).
CHUNK_ELEMENTS = 1 << 16

def value_limit(dtype: Any, *, wide: bool = False) -> float | None:
    """The largest ``|x|`` the strict mean accepts in a ``dtype`` array; None: any finite value.

    The square root of the largest finite value of the dtype the array is
    summed in (:func:`meshkit.state.accumulate_dtype`): 1.34e154 for a
    float64 sum, 1.84e19 for a float32 one. None when every finite value of
    ``dtype`` is below it (float16 summed in float32, float32 with
    ``wide``), or for an integer or bool array (never summed).

    A pure function of ``(dtype, wide)``, asked once per chunk the fold
    folds: remembered in a module dict (a few dtypes, so a few entries).
    """
    try:
        return _LIMIT_OF[dtype, wide]
    except KeyError:
        pass
    except TypeError:  # an unhashable dtype-like: not remembered
        return _value_limit(dtype, wide)
    limit = _value_limit(dtype, wide)
    if len(_LIMIT_OF) < _LIMIT_OF_MAX:
        _LIMIT_OF[dtype, wide] = limit
    return limit


#: :func:`value_limit`'s answers by ``(dtype-like, wide)``, at most ``_LIMIT_OF_MAX``.
_LIMIT_OF: dict[tuple[Any, bool], float | None] = {}
_LIMIT_OF_MAX = 256


def _value_limit(dtype: Any, wide: bool) -> float | None:
    dtype = np.dtype(dtype)
    if not is_float_dtype(dtype):
        return None
    limit = _LIMITS[accumulate_dtype(dtype, wide=wide)]
    top = float(np.finfo(np.float32).max if dtype == BFLOAT16 else np.finfo(dtype).max)
    return None if limit >= top else limit


_LIMITS = {np.dtype(t): math.sqrt(float(np.finfo(t).max)) for t in (np.float32, np.float64)}


def peak(x: np.ndarray) -> float:
    """The largest ``|x|`` of a float array (bfloat16 read as float32); 0 when empty."""
    if not x.size:
        return 0.0
    if x.dtype == BFLOAT16:
        x = x.astype(np.float32)
    return float(max(-float(x.min()), float(x.max())))


# Relative weights above this are rebased (see MeanFold._rebase): far below
# float32's range, so factor * value cannot overflow for any sane value.
_MAX_FACTOR = 2.0 ** 40


class _FloatEntry:
    """Running weighted sum of one float array, flat, in its accumulation dtype."""

    __slots__ = ("dtype", "shape", "acc")

    def __init__(self, dtype: np.dtype, shape: tuple[int, ...], acc: Any) -> None:
        self.dtype = dtype
        self.shape = shape
        self.acc = acc


class _ExactEntry:
    """An integer or bool array: must be identical everywhere; passes through."""

    __slots__ = ("dtype", "shape", "value")

    def __init__(self, value: np.ndarray) -> None:
        self.dtype = value.dtype
        self.shape = value.shape
        self.value = value



class MeanFold:
    """Strict element-wise mean, streaming; ``weighted`` chooses FedAvg or all-reduce.

    ``weighted=True`` (fedavg): ``sum_i w_i x_i / sum_i w_i``.
    ``weighted=False`` (allreduce): ``sum_i x_i / n``; the weights must then
    all be equal (an unweighted mean refuses to silently ignore unequal work).

    How it stays fast and small (docs/benchmarks/aggregate.md has figures):

    * one accumulator per float array (float32 for float16/bfloat16/float32,
      float64 for float64 or with ``wide``) plus two chunks of scratch per thread,
      whatever the number of contributors;
    * weights are folded relative to the first positive weight, so equal
      weights cost a plain add and one contributor is copied bit-exactly;
    * contributions are summed in groups: the fold keeps references to up
      to ``retain`` contributions (default 1) and folds them together with
      the next one, so the accumulator is read and written once per group
      (``retain=None`` keeps everything until :meth:`result`: the batch
      path, which reads each input once). A state given to :meth:`add` must
      therefore not be modified until :meth:`result` returns (the buffering
      fold has the same rule); ``retain=0`` folds each one at once;
    * the finiteness check runs on each chunk while it is in cache;
    * a large fold is split into contiguous tasks folded by up to ``threads``
      threads (default :data:`DEFAULT_THREADS`), each taking the next task as
      it comes free (:mod:`._threads`): the arithmetic
      of every element is the same whoever folds it, so the result is bit
      for bit the one thread's.

    Every :class:`AggregationError` it raises also carries ``key`` (the key
    or JSON path, or None) and ``contributors`` (the labels involved).
    """

    def __init__(self, *, weighted: bool = True, name: str | None = None,
                 allow_nonfinite: bool = False, wide: bool = False,
                 retain: int | None = 1, chunk: int = CHUNK_ELEMENTS,
                 threads: int = DEFAULT_THREADS) -> None:
        if retain is not None and (isinstance(retain, bool) or not isinstance(retain, int)
                                   or retain < 0):
            raise ValueError(f"retain must be an integer >= 0 or None, got {retain!r}")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        self.threads = threads
        self.weighted = weighted
        self.retain = retain
        self.name = name or ("fedavg" if weighted else "allreduce")
        self.allow_nonfinite = allow_nonfinite
        self.wide = wide
        self._chunk = max(int(chunk), 1)
        self._entries: dict[str, Any] | None = None
        self.sources: list[str] = []
        self.weights: list[float] = []
        self._factors: list[float] = []
        self._reference: float | None = None
        # Contributions waiting to be folded together: (state, factor, label).
        self._pending: list[tuple[State, float, str]] = []
        self._started = False  # whether the accumulators hold anything yet
        # Scratch per (dtype, worker): each thread folds in its own.
        self._scratch: dict[tuple[np.dtype, int], tuple[np.ndarray, np.ndarray]] = {}
        self._broken: str | None = None
        self._kernel: Any = None  # the C kernel for this fold call, or None (_fold_shares)
        self._done = False

    # -- public ---------------------------------------------------------------

    @property
    def count(self) -> int:
        """How many contributions were accepted."""
        return len(self.sources)

    def value_limit(self, dtype: Any) -> float | None:
        """The largest ``|x|`` this fold accepts in a ``dtype`` array (:func:`value_limit`);
        None: any finite value (or, with ``allow_nonfinite``, anything at all)."""
        return None if self.allow_nonfinite else value_limit(dtype, wide=self.wide)

    @property
    def mass(self) -> float:
        """The accepted mass: the sum of the accepted weights (inf past float range)."""
        try:
            return math.fsum(self.weights)
        except OverflowError:  # finite weights near float's maximum
            return math.inf

    def add(self, state: State, weight: float = 1.0, *, source: str | None = None) -> None:
        """Fold in ``state``; a refused contribution leaves the fold unchanged.

        The one exception is NaN/inf, found while summing: a contribution
        refused for it leaves the fold unusable (partial sums cannot be
        undone exactly), and because contributions are summed in pairs the
        refusal may surface at the next ``add`` or at ``result`` -- the
        message and ``error.contributors`` name the contribution at fault.
        """
        label = source or default_source(self.count)
        w, factor = self._admit(weight, label)
        if type(state) is not dict and not isinstance(state, abc.Mapping):
            raise self._fail(None, [label],
                             f"{self.name}: {label} sent {type(state).__name__}, expected a "
                             f"state (a mapping of name -> array or JSON value)")

        if self._entries is None:
            entries = self._template(state, label)
        else:
            entries = self._entries
            self._check_compatible(state, label)

        if factor is None:
            # A weight this much larger than the reference would overflow
            # the factor in float32; make it the reference instead.
            self._rebase(w)
            factor = 1.0

        self._entries = entries
        self._pending.append((state, factor, label))
        if self.retain is not None and len(self._pending) > self.retain:
            pending, self._pending = self._pending, []
            self._fold_arrays(pending)
        for key, entry in entries.items():
            if not isinstance(entry, (_FloatEntry, _ExactEntry)):
                json_accumulate(entry, state[key], factor)
        if self.weighted and self._reference is None and w > 0:
            self._reference = w
        self.sources.append(label)
        self.weights.append(w)
        self._factors.append(factor)

    def result(self) -> dict[str, Any]:
        """The mean of everything added, each array in its input dtype."""
        self._check_open()
        if self._entries is None:
            raise self._fail(None, [],
                             f"{self.name}: no contributions to aggregate; a round needs at "
                             f"least one contributor")
        if not any(w > 0 for w in self.weights):
            listing = ", ".join(f"{s}: {w:g}" for s, w in zip(self.sources, self.weights))
            raise self._fail(None, list(self.sources),
                             f"{self.name}: the weights sum to zero ({listing}); at least "
                             f"one contributor must have done some work (weight > 0)")
        n = self.count
        divisor = math.fsum(self._factors)
        # One contributor: the accumulator holds an exact copy, and skipping
        # the division keeps the identity bit-exact.
        divide = n > 1 and divisor != 1.0
        if self._pending:
            pending, self._pending = self._pending, []
            # The last fold divides each chunk while it is in cache, saving a
            # pass over the accumulators.
            self._fold_arrays(pending, divisor if divide else None)
            divide = False
        self._done = True
        out: dict[str, Any] = {}
        for key, entry in self._entries.items():
            if isinstance(entry, _FloatEntry):
                acc = entry.acc
                if divide:
                    np.divide(acc, divisor, out=acc)
                out[key] = _narrow(acc, entry.dtype, exact=n == 1).reshape(entry.shape)
                entry.acc = None
            elif isinstance(entry, _ExactEntry):
                out[key] = entry.value
            else:
                out[key] = json_result(entry, divisor, self)
        self._entries = None
        self._scratch.clear()
        return out

    # -- internals ------------------------------------------------------------

    def _admit(self, weight: float, label: str) -> tuple[float, float | None]:
        """A new contribution's checked weight ``w`` and the factor it is folded with, or
        None for the factor when ``w`` is more than ``_MAX_FACTOR`` times the reference
        weight (the sum must be rebased onto it first, :meth:`_rebase`). Refuses a closed
        or broken fold, a bad weight, and an unequal weight in an unweighted mean.

        Weights are folded as w_i / w_ref, w_ref being the first positive weight: equal
        weights are then a plain add, and the first contribution is copied exactly (the
        identity for one contributor). Nothing is changed: the caller commits it.
        """
        self._check_open()
        w = check_weight(weight, label, name=self.name)
        return w, self._factor(w, label)

    def _factor(self, w: float, label: str) -> float | None:
        """:meth:`_admit`'s factor for the checked weight ``w``."""
        if not self.weighted:
            if self.weights and w != self.weights[0]:
                shown, first = f"{w:g}", f"{self.weights[0]:g}"
                if shown == first:  # e.g. float32(0.1) vs 0.1: show the digits that differ
                    shown, first = repr(w), repr(self.weights[0])
                raise self._fail(
                    None, [label, self.sources[0]],
                    f"{self.name}: {label} has weight {shown} but {self.sources[0]} has "
                    f"{first}; allreduce is an unweighted mean in which every "
                    f"contributor counts once. Send equal weights, or use fedavg to weight "
                    f"contributions by realized work")
            return 1.0
        if self._reference is None:
            return 1.0 if w > 0 else 0.0
        factor = w / self._reference
        return None if factor > _MAX_FACTOR else factor

    def _check_open(self) -> None:
        if self._done:
            raise self._fail(None, [], f"{self.name}: this fold already produced its "
                                       f"result; begin a new one")
        if self._broken is not None:
            raise self._fail(None, [], f"{self.name}: this fold is unusable after a refused "
                                       f"contribution ({self._broken}); start the round "
                                       f"again without it")

    @staticmethod
    def _fail(key: str | None, contributors: list[str], message: str) -> AggregationError:
        error = AggregationError(message)
        error.key = key  # type: ignore[attr-defined]
        error.contributors = list(contributors)  # type: ignore[attr-defined]
        return error

    def _error(self, key: str, message: str, *contributors: str) -> AggregationError:
        return self._fail(key, list(contributors),
                          f"{self.name}: aggregating {key!r}: {message}")

    def _template(self, state: State, label: str) -> dict[str, Any]:
        """Entries for the first contribution (validated; nothing allocated on error)."""
        return self._allocate(self._plan(state, label))

    def _plan(self, state: State, label: str) -> dict[str, Any]:
        """Validate the first contribution: arrays as they are, JSON as template nodes."""
        plan: dict[str, Any] = {}
        for key, value in state.items():
            if not isinstance(key, str) or not key:
                raise self._fail(None, [label],
                                 f"{self.name}: {label} sent the key {key!r}; state keys "
                                 f"must be non-empty strings")
            if isinstance(value, ARRAY_TYPES):  # is_array, without a call a key
                value = np.asarray(value)
                if not is_supported_dtype(value.dtype):
                    raise self._error(key, f"{label} sent dtype {value.dtype}, which cannot "
                                           f"be averaged; use a float, integer or bool array",
                                      label)
                plan[key] = value
            else:
                if json_depth(value) > MAX_JSON_DEPTH:
                    raise self._error(key, f"{label} sent JSON nested more than "
                                           f"{MAX_JSON_DEPTH} levels deep; flatten it", label)
                plan[key] = json_template(value, key, label, self)
        return plan

    def _allocate(self, plan: dict[str, Any]) -> dict[str, Any]:
        entries: dict[str, Any] = {}
        # One arena per accumulation dtype, sliced into every float array's
        # accumulator: a single large allocation is mapped (with huge pages
        # where the OS offers them) much faster than many medium ones, and
        # the results are views into it (reshaped, no copy for float32/64).
        offsets: dict[np.dtype, int] = {}
        layout: dict[str, tuple[np.dtype, int]] = {}
        for key, value in plan.items():
            if isinstance(value, ARRAY_TYPES) and value.dtype in FLOAT_DTYPE_SET:
                acc_dtype = accumulate_dtype(value.dtype, wide=self.wide)
                start = offsets.get(acc_dtype, 0)
                layout[key] = (acc_dtype, start)
                # Start each accumulator on a 64-byte boundary.
                align = max(64 // acc_dtype.itemsize, 1)
                offsets[acc_dtype] = start + -(-value.size // align) * align
        # A model-sized arena is the round before last's, when nothing holds it (_arenas).
        arenas = {dtype: arena(dtype, size) for dtype, size in offsets.items()}
        for key, value in plan.items():
            if not isinstance(value, ARRAY_TYPES):
                entries[key] = value
            elif key in layout:
                acc_dtype, start = layout[key]
                acc = arenas[acc_dtype][start:start + value.size]
                entries[key] = _FloatEntry(value.dtype, value.shape, acc)
            else:
                entries[key] = _ExactEntry(np.array(value, copy=True))
        return entries

    def _check_compatible(self, state: State, label: str) -> None:
        """Every strictness check that can be made before touching the sums."""
        entries = self._entries
        assert entries is not None
        first = self.sources[0]
        for key in entries:
            if key not in state:
                raise self._fail(
                    key, [label, first],
                    f"{self.name}: key {key!r} is missing from {label}, but {first} sent "
                    f"it; every contributor must send the same keys (a mean over whoever "
                    f"has a key would silently re-weight the others)")
        for key in state:
            if key not in entries:
                raise self._fail(
                    key, [label, first],
                    f"{self.name}: {label} sent key {key!r}, which {first} did not; every "
                    f"contributor must send the same keys")
        for key, entry in entries.items():
            value = state[key]
            if isinstance(entry, (_FloatEntry, _ExactEntry)):
                if not isinstance(value, ARRAY_TYPES):  # is_array, without a call a key
                    raise self._error(key, f"{label} sent {describe(value)} where {first} "
                                           f"sent a {dtype_name(entry.dtype)} array",
                                      label, first)
                value = np.asarray(value)
                if value.shape != entry.shape:
                    raise self._error(
                        key, f"{label} sent shape {value.shape} where {first} sent "
                             f"{entry.shape}; every contributor must hold the same model",
                        label, first)
                if value.dtype != entry.dtype:
                    raise self._error(
                        key, f"{label} sent dtype {dtype_name(value.dtype)} where {first} "
                             f"sent {dtype_name(entry.dtype)}; cast contributions to one "
                             f"dtype before sending", label, first)
                if isinstance(entry, _ExactEntry) and not np.array_equal(value, entry.value):
                    raise self._error(
                        key, f"{label} and {first} sent different {dtype_name(entry.dtype)} "
                             f"arrays; integer and bool arrays are not averaged, they must "
                             f"be identical everywhere (store a quantity meant to be "
                             f"averaged as a float array)", label, first)
            else:
                json_check(entry, value, key, label, first, self)

    def _rebase(self, reference: float) -> None:
        """Re-express everything folded so far relative to a new reference weight."""
        assert self._reference is not None and self._entries is not None
        scale = self._reference / reference
        with np.errstate(under="ignore"):
            if self._started:
                for entry in self._entries.values():
                    if isinstance(entry, _FloatEntry):
                        np.multiply(entry.acc, scale, out=entry.acc)
        for entry in self._entries.values():
            if not isinstance(entry, (_FloatEntry, _ExactEntry)):
                json_rescale(entry, scale)
        self._pending = [(state, factor * scale, label)
                         for state, factor, label in self._pending]
        self._factors = [f * scale for f in self._factors]
        self._reference = reference

    def _buffers(self, dtype: np.dtype, size: int,
                 worker: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Scratch sized to one chunk, or to the array when it is smaller."""
        size = min(self._chunk, size)
        pair = self._scratch.get((dtype, worker))
        if pair is None or pair[0].size < size:
            # Sized to what is folded: a fold of small arrays allocates small
            # scratch, not a whole chunk's worth each round.
            pair = self._scratch[dtype, worker] = (np.empty(size, dtype=dtype),
                                                   np.empty(size, dtype=dtype))
        return pair[0], pair[1]

    def _fold_arrays(self, parts: list[tuple[State, float, str]],
                     divisor: float | None = None) -> None:
        """Add the held contributions' float arrays into the accumulators."""
        assert self._entries is not None
        init = not self._started
        jobs = []  # (key, accumulator, [(x, factor)])
        for key, entry in self._entries.items():
            if isinstance(entry, _FloatEntry):
                jobs.append((key, entry.acc, [(np.asarray(state[key]).reshape(-1), factor)
                                              for state, factor, _ in parts]))
        self._fold_or_refuse(jobs, init, divisor, lambda job: parts)
        self._started = True

    def _fold_or_refuse(self, jobs: list[tuple[str, np.ndarray, list[tuple[np.ndarray, float]]]],
                        init: bool, divisor: float | None,
                        parts_of: Callable[[tuple[str, np.ndarray, list[tuple[np.ndarray, float]]]],
                                           list[tuple[Mapping[str, Any], float, str]]]) -> None:
        """Fold ``jobs`` (:meth:`_fold_shares`); a non-finite share is refused naming the
        contributions ``parts_of(its job)``, and any refusal leaves the fold broken."""
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                bad = self._fold_shares(jobs, init, divisor)
            if bad is not None:
                key, where = bad
                job = next(job for job in jobs if job[0] == key)
                raise self._refusal(key, where, job[2], parts_of(job), job[1])
        except AggregationError as exc:
            self._broken = str(exc)
            raise

    def _fold_shares(self, jobs: list[tuple[str, np.ndarray, list[tuple[np.ndarray, float]]]],
                     init: bool, divisor: float | None) -> tuple[str, slice] | None:
        """Fold ``jobs`` on up to ``threads`` threads; the first bad (key, chunk) or None."""
        sizes = [acc.size for _, acc, _ in jobs]
        total = sum(sizes)
        # A large fold runs the C kernel where it applies (one pass a chunk, the same bits).
        self._kernel = fold_kernel() if total >= KERNEL_MIN_ELEMENTS else None
        workers = workers_for(total, self.threads, init=init)
        if workers == 1:
            # One thread (every fold below a million elements, and every first fold):
            # each array in one pass, in order -- the same chunks, so the same bits, as
            # its tasks one after the other, without a call per task (issue 36).
            for key, acc, xs in jobs:
                where = self._fold_chunks(acc, xs, init, divisor)
                if where is not None:
                    # The first bad chunk in (array, offset) order, as below; the
                    # refusal breaks the fold, so the arrays after it need no folding.
                    return key, where
            return None
        work = tasks(sizes, self._chunk)
        for worker in range(workers):  # scratch made here, not racing in threads
            for index, lo, hi in work:
                self._buffers(jobs[index][1].dtype, hi - lo, worker)

        def run(worker: int, task: tuple[int, int, int]) -> list[tuple[int, str, slice]]:
            index, lo, hi = task
            key, acc, xs = jobs[index]
            if worker == 0:
                # The calling thread, inside _fold_or_refuse's errstate already.
                where = self._fold_chunks(acc, xs, init, divisor, lo, hi, worker)
            else:
                with np.errstate(over="ignore", invalid="ignore"):
                    where = self._fold_chunks(acc, xs, init, divisor, lo, hi, worker)
            return [] if where is None else [(index, key, where)]

        found = run_tasks(run, work, workers)
        if not found:
            return None
        _, key, where = min(found, key=lambda item: (item[0], item[2].start))
        return key, where

    def _fold_chunks(self, acc: np.ndarray, xs: list[tuple[np.ndarray, float]],
                     init: bool, divisor: float | None = None, lo: int = 0,
                     hi: int | None = None, worker: int = 0) -> slice | None:
        """acc[lo:hi] (+)= sum of factor * x over ``xs``, chunk by chunk; the bad chunk or None.

        Each chunk's weighted sum is formed in cache-sized scratch, then added
        to the accumulator once, so the accumulator is read and written once
        per call however many contributions ``xs`` holds; ``init`` writes
        instead of adding (the first fold needs no zeroed accumulator);
        ``divisor`` divides each chunk once it is complete (the round's last
        fold).
        """
        hi = acc.size if hi is None else hi
        step = self._chunk
        check = not self.allow_nonfinite
        if self._kernel is not None and len(xs) <= 2 and acc.dtype == _F32 \
                and all(_kernel_ready(x) for x, _ in xs):
            return self._fold_fused(acc, xs, init, divisor, lo, hi, check)
        t, u = self._buffers(acc.dtype, hi - lo, worker)
        add, dot = np.add, np.dot
        # A "plain" part needs no widening and no scaling: a bare add.
        parts = [(x, f, x.dtype == acc.dtype and f == 1.0) for x, f in xs]
        (x0, f0, plain0), rest = parts[0], parts[1:]
        pair_add = bool(rest) and plain0 and rest[0][2]
        if pair_add:
            x1 = rest[0][0]
            rest = rest[1:]
        direct = not init and not rest and not pair_add and plain0
        for start in range(lo, hi, step):
            stop = min(start + step, hi)
            n = stop - start
            a = acc[start:stop]
            if direct:
                add(a, x0[start:stop], out=a)
            else:
                # The chunk's weighted sum: straight into the accumulator on the
                # first fold, else into scratch.
                target = a if init else t[:n]
                if pair_add:
                    add(x0[start:stop], x1[start:stop], out=target)
                else:
                    _scaled_into(target, x0[start:stop], f0)
                for x, f, plain in rest:
                    if plain:
                        add(target, x[start:stop], out=target)
                    else:
                        scaled = u[:n]
                        _scaled_into(scaled, x[start:stop], f)
                        add(target, scaled, out=target)
                if not init:
                    add(a, target, out=a)
            # The chunk's sum of squares, while it is in cache: finite exactly when
            # no element is NaN, inf or beyond the square root of the dtype's
            # largest value, unless many large values overflow it together -- a
            # false alarm told apart element by element (_alarm), rarely paid. The
            # limit is asked only then: a clean chunk never reads it (issue 36).
            if check and not dot(a, a) < _INF and _alarm(
                    a, xs, start, stop, self.value_limit(xs[0][0].dtype)):
                return slice(start, stop)
            if divisor is not None:
                np.divide(a, divisor, out=a)
        return None

    def _fold_fused(self, acc: np.ndarray, xs: list[tuple[np.ndarray, float]], init: bool,
                    divisor: float | None, lo: int, hi: int, check: bool) -> slice | None:
        """:meth:`_fold_chunks` by the C kernel (:mod:`._kernel`): the same chunks, checks
        and bits, one pass a chunk; an alarm is decided here, as numpy's path does."""
        (x0, f0), (x1, f1) = xs[0], xs[1] if len(xs) == 2 else (None, 1.0)
        step = self._chunk
        start = lo
        while start < hi:
            bad = self._kernel(acc.ctypes.data, x0.ctypes.data, f0, f0 != 1.0,
                               None if x1 is None else x1.ctypes.data, f1, f1 != 1.0,
                               start, hi, init, step, check, divisor is not None,
                               1.0 if divisor is None else divisor)
            if bad < 0:
                return None
            stop = min(bad + step, hi)
            a = acc[bad:stop]
            if _alarm(a, xs, bad, stop, self.value_limit(x0.dtype)):
                return slice(bad, stop)
            if divisor is not None:  # a false alarm: this chunk is not divided yet
                np.divide(a, divisor, out=a)
            start = stop
        return None

    def _refusal(self, key: str, where: slice, xs: list[tuple[np.ndarray, float]],
                 parts: list[tuple[State, float, str]], acc: np.ndarray) -> AggregationError:
        """Why the chunk ``where`` of ``key``'s sum is refused: NaN/inf sent, the sum
        overflowed, or a value out of range (:func:`value_limit`), naming who sent it."""
        acc_dtype = acc.dtype
        culprits = []
        for (x, _), (_, _, label) in zip(xs, parts):
            chunk = x[where]
            if chunk.dtype == BFLOAT16:
                chunk = chunk.astype(np.float32)
            if not np.isfinite(chunk).all():
                culprits.append(label)
        if culprits:
            return self._error(
                key, f"{listing(culprits)} sent NaN or inf; non-finite values are "
                     f"refused by default (a diverged contributor must not be averaged into "
                     f"the others). Find why it diverged, or set allow_nonfinite = true to "
                     f"let them through", *culprits)
        labels = [label for _, _, label in parts]
        limit = self.value_limit(xs[0][0].dtype)
        peaks = [(peak(x[where]), label) for (x, _), (_, _, label) in zip(xs, parts)]
        culprits = [] if limit is None else [label for top, label in peaks if top > limit]
        if culprits:
            top = max(p for p, _ in peaks)
            wider = (" (or set accumulate = \"float64\" to sum it in float64, where the "
                     "limit is 1.3e154)" if acc_dtype != np.float64 else "")
            return self._error(
                key, f"{listing(culprits)} sent a value out of range (|x| up to {top:.3g}, "
                     f"beyond {limit:.3g}, the square root of {dtype_name(acc_dtype)}'s "
                     f"largest value: no model value is that large, and a few such values "
                     f"overflow the sum); a mean would average it into the model. Find why "
                     f"it was sent{wider}", *culprits)
        return self._error(
            key, f"the weighted sum overflowed {dtype_name(acc_dtype)} while adding "
                 f"{listing(labels)}; scale the weights down (only their ratios matter) "
                 f"or set accumulate = \"float64\"", *labels)



_INF = math.inf
_F32 = np.dtype(np.float32)


def _kernel_ready(x: np.ndarray) -> bool:
    """Whether the C kernel can read ``x``: float32, C-contiguous and aligned."""
    return x.dtype == _F32 and x.flags.c_contiguous and x.flags.aligned


def _alarm(a: np.ndarray, xs: list[tuple[np.ndarray, float]], start: int, stop: int,
           limit: float | None) -> bool:
    """Whether a chunk whose sum of squares is not finite holds a real refusal: NaN or inf
    in the sum (sent, or an overflow), or a contribution's value beyond ``limit``; else
    many large values in range overflowed the test together, which is no refusal."""
    if not np.isfinite(a).all():
        return True
    return limit is not None and any(peak(x[start:stop]) > limit for x, _ in xs)


def _narrow(acc: np.ndarray, dtype: np.dtype, *, exact: bool) -> np.ndarray:
    """``acc`` in ``dtype``; ``exact`` when ``acc`` holds one contribution widened."""
    if acc.dtype == dtype:
        return acc  # what astype(copy=False) returns, without an errstate an array a round
    if exact and dtype == BFLOAT16 and acc.dtype == np.float32:
        # bf16 is the top half of a float32: taking it back keeps every bit,
        # where a cast would quiet NaN payloads (and warn about them).
        return (acc.view(np.uint32) >> 16).astype(np.uint16).view(BFLOAT16)
    with np.errstate(invalid="ignore"):  # NaN got here only with allow_nonfinite
        return acc.astype(dtype, copy=False)



def _scaled_into(out: np.ndarray, x: np.ndarray, factor: float) -> None:
    """out = factor * x, widening x first when its dtype is narrower than out's."""
    if x.dtype == out.dtype:
        if factor == 1.0:
            np.copyto(out, x)
        else:
            np.multiply(x, factor, out=out)
    else:
        # Widen before scaling: bfloat16 * float would round in bfloat16.
        np.copyto(out, x, casting="unsafe")
        if factor != 1.0:
            np.multiply(out, factor, out=out)



def check_contributions(states: Sequence[State], weights: Sequence[float] | None = None,
                        *, name: str = "aggregator",
                        sources: Sequence[str] | None = None) -> list[float]:
    """Every strictness rule of :class:`MeanFold` except the arithmetic; the weights.

    For a plain aggregator that computes something else (a median, a
    trimmed mean) but should refuse what the built-ins refuse: no
    contributions, a weight count that disagrees, a negative, non-finite or
    zero-total weight, a missing or extra key, a shape or dtype that
    disagrees, integer/bool arrays or non-numeric JSON that differ. Returns
    the weights as floats (all 1.0 when ``weights`` is None). Finiteness is
    not checked (use :func:`meshkit.state.validate_state` for that).
    """
    states = list(states)
    if not states:
        raise AggregationError(f"{name}: no contributions to aggregate; a round needs at "
                               f"least one contributor")
    if weights is not None and len(weights) != len(states):
        raise AggregationError(f"{name}: {len(states)} states but {len(weights)} weights; give "
                               f"one weight per contribution, or none")
    labels = list(sources) if sources is not None else [
        default_source(i) for i in range(len(states))]
    checked = [check_weight(1.0 if weights is None else weights[i], labels[i], name=name)
               for i in range(len(states))]
    if not any(w > 0 for w in checked):  # not fsum: huge finite weights overflow it
        listing = ", ".join(f"{s}: {w:g}" for s, w in zip(labels, checked))
        raise AggregationError(f"{name}: the weights sum to zero ({listing}); at least one "
                               f"contributor must have done some work (weight > 0)")
    probe = MeanFold(name=name, allow_nonfinite=True)
    for i, (state, label) in enumerate(zip(states, labels)):
        if not isinstance(state, abc.Mapping):
            raise AggregationError(f"{name}: {label} sent {type(state).__name__}, expected a "
                                   f"state (a mapping of name -> array or JSON value)")
        if i == 0:
            plan = probe._plan(state, label)
            # Stand-ins with the shape and dtype the checks compare against;
            # nothing model-sized is allocated.
            probe._entries = {
                key: (value if not is_array(value)
                      else _FloatEntry(value.dtype, value.shape, None)
                      if is_float_dtype(value.dtype) else _ExactEntry(value))
                for key, value in plan.items()}
            probe.sources.append(label)
        else:
            probe._check_compatible(state, label)
    return checked

