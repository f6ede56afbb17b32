"""What a worker holds of the run's model, and how a ``set_state`` changes it.

Rule: every way a ``set_state`` request replaces or merges the worker's model
is decided here -- the whole model, only ``[strategy] trainable``'s keys, a
compressed delta against the model held (``[compression] broadcast``) --
and so is the model a fit starts from (the client's own local keys in place
of the global ones). The compressors a request names are built here too,
once per name and options.
"""

from __future__ import annotations

from typing import Any, Mapping

from meshkit import plugins
from meshkit.compression import is_residual
from meshkit.errors import MeshError, ProtocolError
from meshkit.train._broadcast import apply_delta
from meshkit.train._worker.local_sgd import state_digest

__all__ = ["set_state", "apply_broadcast", "Stale", "only", "with_local", "Compressors", "by_key"]


class Stale(Exception):
    """A broadcast delta this worker cannot apply: it does not hold the delta's base, or
    the model it decoded is not the one the coordinator named. Nothing changed; the
    reply says ``stale`` and the coordinator sends the whole model."""


def set_state(held: dict[str, Any] | None, request: Mapping[str, Any]
              ) -> tuple[dict[str, Any], frozenset[str] | None]:
    """A ``set_state``: the worker's model and its trainable keys after it.

    Without ``trainable`` the state is the model. With it, the state replaces its own
    keys of the model held (the frozen rest stays as the first round sent it); a
    worker that holds no model must be sent all of it.
    """
    state = request["state"]
    names = request.get("trainable")
    if names is None:
        return dict(state), None
    trainable = frozenset(names)
    missing = sorted(k for k in trainable if k not in state)
    if missing:
        raise MeshError(f"set_state names trainable keys it does not carry: "
                        f"{', '.join(map(repr, missing[:5]))}")
    if held is None or not all(k in held for k in state):
        if held is None and set(state) == trainable:
            raise MeshError("set_state carries only the trainable keys, but this worker "
                            "holds no model to merge them into (it started after the "
                            "first round); the coordinator sends it the whole model again")
        return dict(state), trainable
    return {**held, **state}, trainable


def apply_broadcast(held: dict[str, Any] | None, digest: str | None,
                    request: Mapping[str, Any], compressors: Compressors
                    ) -> tuple[dict[str, Any], str | None]:
    """A ``set_state`` under ``[compression] broadcast``: (the model after it, its digest).

    A whole model (no ``base``) is taken as it is, with the ``digest`` it names. A delta
    is applied only to the model whose digest is its ``base``, and the model it makes
    must have the digest the request names; otherwise :class:`Stale` (meshkit.train._broadcast).
    """
    if request.get("base") is None:
        return dict(request["state"]), request.get("digest")
    if held is None or digest is None:
        raise Stale("this worker holds no broadcast model to apply a delta to")
    if digest != request["base"]:
        raise Stale(f"this worker holds model {digest[:12]}, not the delta's base "
                    f"{str(request['base'])[:12]}")
    if request.get("compress") is None:
        raise MeshError("a broadcast delta (base) names no compressor (compress)")
    chosen = request["compress"]
    try:
        model = apply_delta(compressors.of(chosen), held, request["state"], raw=chosen["raw"])
    except ProtocolError as exc:
        raise Stale(f"the delta does not fit the model held: {exc}") from None
    made = state_digest(model)
    if made != request["digest"]:
        raise Stale(f"the delta decoded to model {made[:12]}, not {str(request['digest'])[:12]} "
                    f"(the coordinator's decoder and this worker's disagree)")
    return model, made


def only(state: Mapping[str, Any], keys: frozenset[str] | None) -> Mapping[str, Any]:
    """``state``'s ``keys`` (``[strategy] trainable``), or all of it when None."""
    if keys is None:
        return state
    return {k: state[k] for k in state if k in keys}


def with_local(state: Mapping[str, Any], request: Mapping[str, Any]) -> Mapping[str, Any]:
    """The model with the client's own local keys (``local``, FedBN) in place of the global's."""
    # A compressed run's residuals travel with the client's local values; they are
    # not model keys (meshkit.compression, the payload).
    local = {k: v for k, v in (request.get("local") or {}).items() if not is_residual(k)}
    if not local:
        return state
    unknown = sorted(k for k in local if k not in state)
    if unknown:
        raise MeshError(f"the client's local keys {', '.join(map(repr, unknown))} are not in "
                        f"the model")
    return {**state, **local}


class Compressors:
    """The compressors requests name (``compress``: ``{name, options, raw}``), each built
    once per name and options."""

    def __init__(self) -> None:
        self._built: dict[tuple[str, str], Any] = {}

    def of(self, chosen: Mapping[str, Any]) -> Any:
        name = str(chosen["name"])
        options = dict(chosen.get("options") or {})
        cache = (name, repr(sorted(options.items())))
        if cache not in self._built:
            self._built[cache] = plugins.default().create("compression", name, options)
        return self._built[cache]


def by_key(entries: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    """A compressed ``fit_batch``'s ``locals`` or ``payloads`` (entry ``NAME`` of fit ``KEY``
    as ``KEY/NAME``) split per fit; a name that is not ``KEY/NAME`` is a ProtocolError."""
    out: dict[int, dict[str, Any]] = {}
    for entry, value in entries.items():
        key, sep, name = entry.partition("/")
        if not sep or not name or not key.isdigit() or len(key) > 19:
            raise ProtocolError(f"a batch's entry {entry[:80]!r} is not KEY/NAME")
        out.setdefault(int(key), {})[name] = value
    return out
