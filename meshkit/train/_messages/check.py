"""Where every trainer message is checked against its schema: what a request and a reply may hold, checked where it enters.

Rule: a trainer message (:mod:`meshkit.train._protocol`) is used only after
it was checked here, against the one attrs class declared for it -- its
fields, their types and their bounds -- structured by one cattrs converter
with ``forbid_extra_keys``. What does not fit is a
:class:`~meshkit.ProtocolError` for its sender:

* a reply, where the coordinator's pools take it in
  (:class:`~meshkit.train.GroupPool`, :class:`~meshkit.train.LocalPool`):
  the rank is declared dead in the ledger with the reason, and the round
  engine serves its clients on the live workers -- never an exception in
  the coordinator;
* a request, where the worker takes it in (:meth:`Trainer.handle`): it is
  answered with ``{"error": ...}`` and the worker serves on.

A contribution is also checked against the round's model
(:func:`check_contribution`): the same keys, and each array the same shape
and dtype, since the fold and the outer step need exactly that.

The check is cheap per message: a handful of fields, and per state one pass
over its keys (no pass over array elements; the wire bounded every length
before allocating, and the fold checks finiteness while it sums). The
converter is built once, at import.

``docs/protocol.md`` §7 lists these classes as tables; a test
(``tests/train/messages/test_messages.py``) parses those tables and compares them
with :func:`field_table`, so the page and the code cannot drift apart.
"""

from __future__ import annotations

from collections import abc
import math
from typing import Any, Callable, Mapping, Optional

import attrs
import cattrs
import numpy as np

from meshkit.errors import ProtocolError
from meshkit.train._messages.fields import CONVERTER, _shown
from meshkit.train._messages.local_sgd import LOCAL_SGD_REPLIES, LOCAL_SGD_REQUESTS
from meshkit.train._messages.secure import SECURE_REPLIES, SECURE_REQUESTS
from meshkit.train._messages.trainer import TRAINER_REPLIES, TRAINER_REQUESTS, ErrorReply

#: op -> the schema of its request, every family's.
REQUESTS: dict[str, type] = {**TRAINER_REQUESTS, **SECURE_REQUESTS, **LOCAL_SGD_REQUESTS}
#: op -> the schema of its reply (besides :class:`ErrorReply`, which any op may get).
REPLIES: dict[str, type] = {**TRAINER_REPLIES, **SECURE_REPLIES, **LOCAL_SGD_REPLIES}

# -- checking ------------------------------------------------------------------------------


def _structure(cls: type, message: Mapping[str, Any], what: str) -> Any:
    try:
        return CONVERTER.structure(message, cls)
    except Exception as exc:  # every structuring failure becomes the sender's ProtocolError
        raise ProtocolError(f"{what} does not fit its schema: {_why(exc)}") from None


def _why(exc: BaseException, path: str = "") -> str:
    """One line saying every way a message did not fit (cattrs' nested errors flattened)."""
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        return f"unknown field(s) {', '.join(map(repr, sorted(exc.extra_fields)))}"
    if isinstance(exc, (cattrs.ClassValidationError, cattrs.IterableValidationError)):
        parts = []
        for inner in exc.exceptions:
            notes = [n for n in getattr(inner, "__notes__", ())
                     if isinstance(n, (cattrs.AttributeValidationNote,
                                       cattrs.IterableValidationNote))]
            where = path
            if notes and isinstance(notes[0], cattrs.AttributeValidationNote):
                where = f"{path}.{notes[0].name}" if path else notes[0].name
            elif notes:
                where = f"{path}[{notes[0].index}]"
            parts.append(_why(inner, where))
        return "; ".join(parts)
    if isinstance(exc, KeyError) and path:
        return f"{path}: missing"
    return f"{path}: {exc}" if path else str(exc)


def check_request(request: Mapping[str, Any]) -> Any:
    """``request`` structured as its op's schema; :class:`ProtocolError` when it does not fit."""
    if type(request) is not dict and not isinstance(request, abc.Mapping):
        raise ProtocolError(f"a request must be an object, got {_shown(request)}")
    op = request.get("op")
    cls = REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError(f"unknown trainer request op {op!r}; known: {sorted(REQUESTS)}")
    return _structure(cls, {k: v for k, v in request.items() if k != "op"},
                      f"the {op!r} request")


def check_reply(request: Mapping[str, Any], reply: Mapping[str, Any],
                seq: int | None = None) -> Mapping[str, Any]:
    """``reply`` if it is a well-formed answer to ``request``; else :class:`ProtocolError`.

    Besides the op's schema: the reply echoes ``seq`` (when given), and a
    ``fit``/``grads`` carries ``kept`` equal to the request's ``keep`` with
    keep, its result without. The reply is returned as it came (a mapping;
    its numbers already the right types), so code past the boundary reads
    it as before.
    """
    op = request.get("op")
    if type(reply) is not dict and not isinstance(reply, abc.Mapping):
        raise ProtocolError(f"the reply to {op!r} must be an object, got {_shown(reply)}")
    if "error" in reply:
        message = _structure(ErrorReply, reply, f"the error reply to {op!r}")
    else:
        cls = REPLIES.get(op)  # type: ignore[arg-type]
        if cls is None:
            raise ProtocolError(f"a reply to {op!r}, which is never answered")
        message = _structure(cls, reply, f"the reply to {op!r}")
        if op in ("fit", "grads"):
            _check_kept(op, request.get("keep"), message)
        elif op == "fit_batch":
            # The request itself, or what a pool kept of it (_pool._answers_to).
            asked = (list(request["keys"]) if "keys" in request
                     else [fit["key"] for fit in request.get("fits", ())])
            answered = [result.key for result in message.results]
            if answered != asked:
                raise ProtocolError(f"the reply to 'fit_batch' answers keys "
                                    f"{answered[:8]}, asked for {asked[:8]}")
            compressed = bool(request.get("compressed", request.get("compress") is not None))
            grid = bool(request.get("grid", "clip_range" in (request.get("compress") or {})))
            if (message.payloads is not None) != (compressed and not grid):
                raise ProtocolError(f"the reply to 'fit_batch' must carry payloads only, and "
                                    f"always, when the batch asked for compress without "
                                    f"clip_range")
    if seq is not None and message.seq != seq:
        raise ProtocolError(f"the reply to {op!r} echoes seq {message.seq}, not {seq}")
    return reply


def _check_kept(op: str, keep: Any, message: Any) -> None:
    result = "state" if op == "fit" else "gradients"
    present = getattr(message, result) is not None
    if keep is None:
        if message.kept is not None or not present:
            raise ProtocolError(f"the reply to {op!r} without keep must carry {result!r} and "
                                f"no 'kept'")
    elif message.kept != keep or present:
        raise ProtocolError(f"the reply to {op!r} with keep = {keep} must carry kept = "
                            f"{keep} and no {result!r} (got kept = {message.kept!r}"
                            f"{', and ' + result if present else ''})")


#: A state's shape as a contribution must match it: key -> (shape, dtype) for an
#: array, None for a JSON value.
Signature = dict[str, Optional[tuple[tuple[int, ...], Any]]]


def signature(state: Mapping[str, Any]) -> Signature:
    """What :func:`check_contribution` compares: each key's shape and dtype (None: JSON)."""
    out: Signature = {}
    for key, value in state.items():
        out[key] = (value.shape, value.dtype) if isinstance(value, np.ndarray) else None
    return out


def check_contribution(state: Mapping[str, Any], expected: Signature, what: str, *,
                       subset: bool = False, finite: bool = True,
                       limit: Callable[[np.dtype], float | None] | None = None) -> None:
    """A contribution (a fit's model, gradients) matches the round's model, key for key.

    The same keys (with ``subset``: some of them -- gradients need not carry
    a model's JSON or integer entries), and each array the same shape and
    dtype as the model's (a JSON value where the model has one), and every
    float element finite (:func:`nonfinite_leaf`); :class:`ProtocolError`
    saying the first difference otherwise. One pass over the keys, and one
    cheap pass over each float array's elements (its sum). ``finite=False``
    leaves the elements to the caller: the round engine's own strict mean
    finds NaN and inf while it sums, and the engine replays such a round with
    the scan on (:mod:`meshkit.train._rounds.engine`, step 7), so an honest round
    pays for no second pass over a model. ``limit`` (with ``finite``), the
    largest ``|x|`` a fold accepts in an array of a dtype (None: any finite
    value; the strict mean's :meth:`~meshkit.aggregation.MeanFold.value_limit`),
    makes a value beyond it out of range, found in the same one pass
    (:func:`out_of_range_leaf`).
    """
    if subset:
        unknown = [k for k in state if k not in expected]
        if unknown:
            raise ProtocolError(f"{what} does not match the round's model: unknown keys "
                                f"{sorted(unknown)[:5]}")
    elif len(state) != len(expected) or state.keys() != expected.keys():
        missing = sorted(expected.keys() - state.keys())[:5]
        extra = sorted(state.keys() - expected.keys())[:5]
        raise ProtocolError(f"{what} does not match the round's model: missing keys "
                            f"{missing or 'none'}, unknown keys {extra or 'none'}")
    for key, value in state.items():
        want = expected[key]
        if want is None:
            if isinstance(value, np.ndarray):
                raise ProtocolError(f"{what}: {key!r} is an array where the model has a JSON "
                                    f"value")
        elif not isinstance(value, np.ndarray) or value.shape != want[0] \
                or value.dtype != want[1]:
            raise ProtocolError(f"{what}: {key!r} is {_shown(value)} where the model has "
                                f"an array {want[1]}{list(want[0])}")
    for key, value in state.items() if finite else ():
        # Shapes first: a non-finite scan of an array of the wrong shape is wasted.
        if expected[key] is None:
            continue
        bound = None if limit is None else limit(value.dtype)
        if bound is None:
            if nonfinite_leaf(value):
                raise ProtocolError(f"{what}: {key!r} holds NaN or inf; a contribution must "
                                    f"be finite (its sender is dropped, never averaged in)")
            continue
        top = out_of_range_leaf(value, bound)
        if top is None:
            continue
        if not math.isfinite(top):
            raise ProtocolError(f"{what}: {key!r} holds NaN or inf; a contribution must be "
                                f"finite (its sender is dropped, never averaged in)")
        raise ProtocolError(f"{what}: {key!r} is out of range: it holds {top:.3g}, beyond "
                            f"{bound:.3g}, the most the strict mean accepts (the square root "
                            f"of its sum's largest value; its sender is dropped, never "
                            f"averaged in)")


def out_of_range_leaf(value: np.ndarray, limit: float) -> float | None:
    """A float array's largest ``|x|`` when it is beyond ``limit`` or not finite, else None.

    ``limit`` is the square root of the largest value of the dtype the array
    is tested in (its own, float32 for bfloat16: what
    :meth:`~meshkit.aggregation.MeanFold.value_limit` gives). One pass: the
    sum of squares is finite exactly when every element is finite and at
    most ``limit``, except that many large elements may overflow it
    together; so a sum that is not finite is confirmed element by element
    before it is believed.
    """
    if value.size == 0:
        return None
    if value.dtype.kind == "V":  # bfloat16 (ml_dtypes)
        value = value.astype(np.float32)
    flat = value.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        if float(np.dot(flat, flat)) < math.inf:
            return None
    if not np.isfinite(flat).all():
        return math.inf
    top = max(-float(flat.min()), float(flat.max()))
    return top if top > limit else None


def nonfinite_leaf(value: np.ndarray) -> bool:
    """Whether a float array holds a NaN or an infinity (integer and bool arrays never do).

    One pass: the sum is finite exactly when every element is, except that
    finite elements near the dtype's maximum may overflow it (1e308 twice in
    float64, 65504 twice in float16); so a non-finite sum is confirmed
    element by element before it is believed. An honest contribution pays
    for one sum; only a hostile (or huge) one pays for the exact check.
    """
    kind = value.dtype.kind
    if kind not in "fV" or value.size == 0:  # (bfloat16 is kind "V": ml_dtypes)
        return False
    if kind == "V":
        value = value.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        total = value.sum()
    if math.isfinite(float(total)):
        return False
    return not bool(np.isfinite(value).all())


# -- the docs' view --------------------------------------------------------------------------


def field_table(cls: type) -> list[tuple[str, str, str, str]]:
    """A message's fields as docs/protocol.md tabulates them: (field, type, required, meaning)."""
    rows = []
    for f in attrs.fields(cls):
        required = "yes" if f.default is attrs.NOTHING else "no"
        # A field that stands for several on the wire names itself ("...").
        rows.append((f.metadata.get("name", f.name), f.metadata["wire"], required,
                     f.metadata["doc"]))
    return rows
