"""What travels when an update is compressed: the payload layout, built on the worker and
checked and decoded on the coordinator.

Rule: every byte of a compressed contribution is laid out, and checked, here.

Under secure aggregation nothing of this travels: the update is put on the
round's shared grid (:func:`field_codes`, checked here before the scheme
masks it) and the coordinator decodes only the unmasked sum
(:func:`decode_field_sum`).

A compressed fit result is a *state* (the wire's unit: ``name -> array``),
so it travels through the authenticated codec like any model -- no pickle,
every length bounded by the wire before it is allocated. Per model key:

* a compressed key ``k`` (a float array the run aggregates) travels as its
  compressor's fields, one entry ``k + SEP + field`` each (``SEP`` is the
  ASCII unit separator, which no model key may contain);
* every other key (integers, JSON values, ``[strategy] local_keys``) travels
  as itself, whole;
* with a ``stateful`` compressor (error feedback) the client's new residual
  of ``k`` travels as ``k + SEP + "residual"`` (float32, the key's size): the
  coordinator keeps it in its client-local store and sends it with the
  client's next fit -- unless ``[compression] residual = "worker"``, where the
  worker keeps it (:mod:`meshkit.train._worker.residuals`) and the payload
  carries no residual (``residuals=False`` below).

:func:`decode_contribution` checks a payload against the round's model
before any decoder runs: every field present, of its declared dtype and at
most its declared length (:meth:`Compressor.bounds`), nothing extra. What
does not fit is a :class:`~meshkit.ProtocolError` for the worker that sent
it. The decoded array is the reference plus the decoded update, accumulated
in float64 and returned in the model's dtype.
"""

from __future__ import annotations

from typing import Any, Collection, Mapping

import numpy as np

from meshkit.compression._contract import Compressor, compression_traits
from meshkit.errors import ConfigError, ProtocolError

__all__ = ["SEP", "RESIDUAL", "residual_name", "is_residual", "compressed_keys",
           "encode_update", "decode_contribution", "checked_payload", "decoded",
           "check_model_keys", "key_seed",
           "field_codes", "decode_field_sum"]

#: Between a model key and a field name in a payload (no model key may hold it).
SEP = "\x1f"
#: The field that carries a client's error-feedback residual.
RESIDUAL = "residual"
#: A payload's fields per key, at most (the residual aside).
MAX_FIELDS = 16


def residual_name(key: str) -> str:
    """The client-local store's (and the payload's) name of ``key``'s residual."""
    return f"{key}{SEP}{RESIDUAL}"


def is_residual(name: str) -> bool:
    return name.endswith(SEP + RESIDUAL)


def check_model_keys(state: Mapping[str, Any], where: str = "[compression]") -> None:
    """Refuse a model a payload could not name unambiguously (a key holding ``SEP``)."""
    bad = sorted(k for k in state if SEP in k)
    if bad:
        raise ConfigError(f"{where}: the model's keys {bad[:3]!r} hold the ASCII unit "
                          f"separator (0x1f), which a compressed payload uses between a key and "
                          f"its fields; rename them, or drop [compression]")


def _compressible(value: Any) -> bool:
    return isinstance(value, np.ndarray) and value.dtype.kind == "f" and value.size > 0


def compressed_keys(state: Mapping[str, Any], raw: Collection[str] = ()) -> list[str]:
    """The keys of ``state`` a payload compresses: its float arrays not in ``raw``."""
    return [k for k, v in state.items() if k not in raw and _compressible(v)]


def key_seed(seed: int, index: int) -> int:
    """The encoder's seed for the ``index``-th compressed key of a fit seeded ``seed``."""
    return int(np.random.SeedSequence([int(seed), int(index)]).generate_state(1, np.uint64)[0])


def encode_update(compressor: Compressor, start: Mapping[str, Any], fitted: Mapping[str, Any],
                  *, seed: int, raw: Collection[str] = (),
                  residual: Mapping[str, np.ndarray] | None = None,
                  residuals: bool = True
                  ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The payload of a fit (module docstring), and the client's new residuals.

    ``residual`` holds the client's residual per key (``{}``: none yet). The
    residuals returned are keyed by :func:`residual_name` and travel in the
    payload too, unless ``residuals=False`` (``residual = "worker"``: its worker
    keeps them, as :func:`decode_contribution`'s ``residuals=False`` expects);
    they are empty unless the compressor is ``stateful``.
    """
    stateful = compression_traits(compressor).stateful
    residual = residual or {}
    chosen = set(compressed_keys(start, raw))
    payload: dict[str, Any] = {}
    kept: dict[str, np.ndarray] = {}
    index = 0
    for key, value in fitted.items():
        if key not in chosen:
            payload[key] = value
            continue
        update = (np.asarray(value, np.float64).ravel()
                  - np.asarray(start[key], np.float64).ravel()).astype(np.float32)
        if stateful and key in residual:
            update += np.asarray(residual[key], np.float32).ravel()
        fields = compressor.encode(update, seed=key_seed(seed, index))
        index += 1
        for name, array in fields.items():
            payload[f"{key}{SEP}{name}"] = array
        if stateful:
            kept[residual_name(key)] = update - decoded(compressor, fields, update.size, key)
    if residuals:
        payload.update(kept)
    return payload, kept


def decoded(compressor: Compressor, fields: Mapping[str, np.ndarray], size: int,
             key: str) -> np.ndarray:
    """``key``'s update, decoded whole (float32), its shape checked."""
    out = compressor.decode(fields, size)
    if not isinstance(out, np.ndarray) or out.shape != (size,):
        raise ProtocolError(f"the compressor decoded key {key!r} to "
                            f"{getattr(out, 'shape', type(out).__name__)}, not ({size},)")
    return out.astype(np.float32, copy=False)


def decode_contribution(compressor: Compressor, payload: Mapping[str, Any],
                        reference: Mapping[str, Any], *, raw: Collection[str] = (),
                        what: str = "a contribution", residuals: bool = True
                        ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(the contribution ``payload`` stands for, its residuals) -- or a ProtocolError.

    ``reference`` is the round's model (what the client started from, its
    ``raw`` keys aside); ``residuals=False``: a stateful compressor's payload
    carries none (its worker keeps them).
    """
    fields_of, kept = checked_payload(compressor, payload, reference, raw=raw, what=what,
                                      residuals=residuals)
    state: dict[str, Any] = {}
    for key, ref in reference.items():
        if key not in fields_of:
            state[key] = payload[key]
            continue
        try:
            update = decoded(compressor, fields_of[key], int(ref.size), key)
        except ValueError as exc:
            raise ProtocolError(f"{what}: key {key!r} does not decode: {exc}") from None
        total = np.asarray(ref, np.float64).ravel() + update
        state[key] = total.astype(ref.dtype).reshape(ref.shape)
    return state, kept


def checked_payload(compressor: Compressor, payload: Mapping[str, Any],
                    reference: Mapping[str, Any], *, raw: Collection[str] = (),
                    what: str = "a contribution", residuals: bool = True
                    ) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """(each compressed key's fields, the residuals) of ``payload``, checked field by field
    against the compressor's :meth:`~Compressor.bounds` before anything is decoded -- or a
    ProtocolError. Every other key of ``reference`` is in ``payload`` (it is not checked
    further here), and ``payload`` holds nothing else -- with ``residuals=False`` no
    residual either (a worker that keeps its clients' residuals sends none)."""
    stateful = compression_traits(compressor).stateful and residuals
    chosen = set(compressed_keys(reference, raw))
    fields_of: dict[str, dict[str, np.ndarray]] = {}
    kept_of: dict[str, np.ndarray] = {}
    used: set[str] = set()
    for key, ref in reference.items():
        if key not in chosen:
            if key not in payload:
                raise ProtocolError(f"{what} lacks key {key!r}")
            used.add(key)
            continue
        size = int(ref.size)
        fields: dict[str, np.ndarray] = {}
        bounds = compressor.bounds(size)
        if len(bounds) > MAX_FIELDS:
            raise ProtocolError(f"the compressor declares {len(bounds)} fields; at most "
                                f"{MAX_FIELDS}")
        for field, (dtype, most) in bounds.items():
            name = f"{key}{SEP}{field}"
            array = payload.get(name)
            if (not isinstance(array, np.ndarray) or array.dtype != np.dtype(dtype)
                    or array.ndim != 1 or array.size > most):
                shown = (f"{array.dtype}[{array.size}]" if isinstance(array, np.ndarray)
                         else "missing" if array is None else type(array).__name__)
                raise ProtocolError(f"{what}: key {key!r} field {field!r} is {shown}; the "
                                    f"compressor sends 1-d {np.dtype(dtype)} of at most "
                                    f"{most} elements")
            fields[field] = array
            used.add(name)
        fields_of[key] = fields
        if stateful:
            name = residual_name(key)
            kept = payload.get(name)
            if not isinstance(kept, np.ndarray) or kept.dtype != np.float32 or \
                    kept.shape != (size,):
                raise ProtocolError(f"{what}: key {key!r}'s residual is missing or not "
                                    f"float32[{size}] (error feedback sends it back)")
            kept_of[name] = kept
            used.add(name)
    extra = sorted(set(payload) - used)
    if extra:
        raise ProtocolError(f"{what} holds entries the round's model has no place for: "
                            f"{extra[:4]!r}")
    return fields_of, kept_of


def field_codes(compressor: Any, update: np.ndarray, *, seed: int, clip_range: float,
                dtype: np.dtype) -> np.ndarray:
    """``update`` on the secure round's shared grid (:class:`~meshkit.compression.FieldCompressor`),
    checked -- one integer code per coordinate, each below ``2**field_bits`` -- and
    returned as ``dtype`` (the field's vector dtype). A compressor that breaks this
    is a bug in it (``ValueError``), never a code that would wrap in the field."""
    bits = int(compressor.field_bits)
    codes = compressor.encode_field(update, seed=seed, clip_range=clip_range)
    if not isinstance(codes, np.ndarray) or codes.dtype.kind not in "ui" \
            or codes.shape != (update.size,):
        raise ValueError(f"the compressor's field codes are "
                         f"{getattr(codes, 'dtype', type(codes).__name__)}"
                         f"{list(getattr(codes, 'shape', []))}; the round needs "
                         f"{update.size} integers")
    if codes.size and (int(codes.min()) < 0 or int(codes.max()) >= 1 << bits):
        raise ValueError(f"the compressor's field codes reach {int(codes.max())} "
                         f"(min {int(codes.min())}); it declares field_bits = {bits}")
    return codes.astype(dtype, copy=False)


def decode_field_sum(compressor: Any, total: np.ndarray, *, clip_range: float,
                     count: int) -> np.ndarray:
    """The float64 sum of ``count`` clients' updates whose field codes sum to ``total``."""
    out = compressor.decode_field(total, clip_range=clip_range, count=count)
    if not isinstance(out, np.ndarray) or out.shape != (total.size,):
        raise ValueError(f"the compressor decoded a field sum of {total.size} to "
                         f"{getattr(out, 'shape', type(out).__name__)}")
    return out.astype(np.float64, copy=False)
