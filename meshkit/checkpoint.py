"""Atomic run checkpoints: numpy ``.npz`` plus a JSON header, never pickle.

One file, ``OUT/checkpoint.npz``, rewritten after every round: written to a
temporary file in the same directory, fsync'ed, then renamed over the old
one (and the directory fsync'ed), so a crash at any instant leaves either
the previous round's checkpoint or this one — never a torn file.

Layout: every array leaf of the global state is ``state/<key>``, every
array leaf of the outer optimizer's ``state_dict()`` is ``outer/<path>``
(of a stateful aggregator's, ``aggregator/<path>``; of the strategy's own
state, ``strategy/<path>``), each client's own values of the local keys
(FedBN) ``clients/<client>/<key>``;
``__meta__`` is a uint8 array holding UTF-8 JSON with the round, the RNG
state, the JSON leaves (arrays replaced by ``{"__array__": NAME}``) and the
run's identity (task, strategy, seed) that ``--resume`` checks.
Loading uses ``allow_pickle=False``: a checkpoint is data, not code.
"""

from __future__ import annotations

from collections import abc
import json
import os
import time
from pathlib import Path
from typing import Any, Mapping

import attrs
import numpy as np

from meshkit._atomic import atomic_file
from meshkit._npz import write_npz
from meshkit.errors import ConfigError, StateError
from meshkit.state import BFLOAT16, dtype_from_name, dtype_name

__all__ = ["Checkpoint", "CHECKPOINT_NAME", "save_checkpoint", "load_checkpoint",
           "checkpoint_path"]

CHECKPOINT_NAME = "checkpoint.npz"
_META = "__meta__"
FORMAT = 1


@attrs.frozen
class Checkpoint:
    """Everything a run needs to continue after round ``round``."""

    round: int
    state: Mapping[str, Any]
    outer_state: Mapping[str, Any] = attrs.Factory(dict)
    rng_state: Mapping[str, Any] = attrs.Factory(dict)
    #: The run's identity: task, strategy, seed, rounds (checked on resume).
    identity: Mapping[str, Any] = attrs.Factory(dict)
    #: The round's ``metrics.jsonl`` line (JSON), so a crash between writing
    #: the checkpoint and that line does not leave a gap after ``--resume``.
    report: Mapping[str, Any] = attrs.Factory(dict)
    #: Each client's values of the ``[strategy] local_keys`` (FedBN), ``"<client>/<key>"``.
    clients: Mapping[str, Any] = attrs.Factory(dict)
    #: What a stateful aggregator carries across rounds (its ``state_dict()``,
    #: e.g. centered clipping's centre); {} for a stateless one.
    aggregator_state: Mapping[str, Any] = attrs.Factory(dict)
    #: The ``[privacy]`` mechanism's state: its accountant's history, its clip norm.
    privacy_state: Mapping[str, Any] = attrs.Factory(dict)
    #: What the strategy needs beyond the model to continue exactly
    #: (``StrategyContext.strategy_state``: fedbuff's versions in flight, its clock).
    strategy_state: Mapping[str, Any] = attrs.Factory(dict)
    #: Clients whose fit stalled two ranks, by client key (a string) -> why: a resumed
    #: run does not try them again either (``StrategyContext.stalled_clients``).
    stalled_clients: Mapping[Any, str] = attrs.Factory(dict)


def checkpoint_path(path: str | os.PathLike[str]) -> Path:
    """``path`` itself if it is a file, else ``path/checkpoint.npz``."""
    p = Path(path)
    return p / CHECKPOINT_NAME if p.is_dir() or not p.suffix else p


#: JSON leaves ``_to_json`` returns as they are, by exact type (a numpy scalar is not one:
#: ``np.float64`` subclasses ``float`` and is written as its ``item()``).
_PLAIN = frozenset({str, int, float, bool, type(None)})


def _to_json(value: Any, prefix: str, arrays: dict[str, np.ndarray]) -> Any:
    # Every round's checkpoint walks its report and states leaf by leaf: plain
    # leaves first, and collections.abc's Mapping (typing's delegates to it, at
    # several times the cost of an isinstance).
    if type(value) in _PLAIN:
        return value
    if isinstance(value, np.ndarray):
        _check_array_name(prefix, arrays)
        arrays[prefix] = value
        return {"__array__": prefix}
    if isinstance(value, np.generic):
        return value.item()
    # A collection's plain leaves are taken as they are, without a call each (a
    # round's report is mostly numbers in small dicts and lists).
    if type(value) is dict or isinstance(value, abc.Mapping):
        return {str(k): v if type(v) in _PLAIN else _to_json(v, f"{prefix}/{k}", arrays)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [v if type(v) in _PLAIN else _to_json(v, f"{prefix}/{i}", arrays)
                for i, v in enumerate(value)]
    return value


def _check_array_name(name: str, arrays: Mapping[str, np.ndarray]) -> None:
    """Refuse a key the ``.npz`` cannot hold, before a file its own loader calls corrupt.

    An array's path is a zip member name: NUL ends it early and a lone
    surrogate cannot be encoded, and two keys that spell one path (``"a/b"``
    beside ``{"a": {"b": ...}}``) would silently keep only the last.
    """
    problem = None
    if "\0" in name:
        problem = "holds a NUL character"
    else:
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            problem = "is not valid Unicode (a lone surrogate)"
    if problem is None and name in arrays:
        problem = "spells the same path as another key (a '/' inside a key)"
    if problem is not None:
        section, _, key = name.partition("/")
        raise StateError(f"checkpoint: the {section} key {key!r} {problem}, which a checkpoint "
                         f"cannot hold; rename it in the task's state (nothing was written)")


def _from_json(value: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__array__"}:
            return arrays[value["__array__"]]
        return {k: _from_json(v, arrays) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v, arrays) for v in value]
    return value


def save_checkpoint(out: str | os.PathLike[str], checkpoint: Checkpoint) -> Path:
    """Write ``checkpoint`` atomically into directory ``out``; returns the file."""
    directory = os.fspath(out)  # (os.path, not pathlib: this runs every round)
    arrays: dict[str, np.ndarray] = {}
    meta = {
        "format": FORMAT,
        "round": int(checkpoint.round),
        "state": _to_json(dict(checkpoint.state), "state", arrays),
        "outer": _to_json(dict(checkpoint.outer_state), "outer", arrays),
        "rng": _to_json(dict(checkpoint.rng_state), "rng", arrays),
        "identity": _to_json(dict(checkpoint.identity), "identity", arrays),
        "report": _to_json(dict(checkpoint.report), "report", arrays),
        "aggregator": _to_json(dict(checkpoint.aggregator_state), "aggregator", arrays),
        "privacy": _to_json(dict(checkpoint.privacy_state), "privacy", arrays),
    }
    if checkpoint.strategy_state:
        meta["strategy"] = _to_json(dict(checkpoint.strategy_state), "strategy", arrays)
    if checkpoint.clients:
        meta["clients"] = _to_json(dict(checkpoint.clients), "clients", arrays)
    if checkpoint.stalled_clients:
        meta["stalled"] = {str(k): str(v) for k, v in checkpoint.stalled_clients.items()}
    for name, array in arrays.items():
        if array.dtype.hasobject:
            raise ConfigError(f"checkpoint: {name} is an object array, which only pickle "
                              f"could store; states hold numeric arrays and JSON values")
    # .npy has no spelling for extension dtypes (bfloat16 is saved as raw
    # 2-byte voids), so their names ride in the header and are viewed back.
    extension = {name: dtype_name(a.dtype) for name, a in arrays.items()
                 if a.dtype == BFLOAT16}
    if extension:
        meta["dtypes"] = extension
    header = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
    target = os.path.join(directory, CHECKPOINT_NAME)
    # atomic_file makes the directory when it is not there yet.
    with atomic_file(target, durable=True, prefix=".checkpoint-", suffix=".npz.tmp") as fh:
        write_npz(fh, {_META: header, **arrays})
    _remove_stale_temporaries(directory)
    return Path(target)


#: A temporary this much older than a successful save is a crash's leftover,
#: not another writer's file in progress (a write takes seconds).
STALE_TEMPORARY_SECONDS = 60.0


def _remove_stale_temporaries(directory: str | os.PathLike[str]) -> None:
    """Delete ``.checkpoint-*.npz.tmp`` files a crash mid-write left behind."""
    cutoff = time.time() - STALE_TEMPORARY_SECONDS
    # Looked for after every save: os.scandir and the name's two ends, not
    # Path.glob (a Path object and a pattern match per entry of the directory).
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        name = entry.name
        if not (name.startswith(".checkpoint-") and name.endswith(".npz.tmp")):
            continue
        try:
            if entry.stat().st_mtime < cutoff:
                os.unlink(entry.path)
        except OSError:  # gone already, or not ours to delete: harmless
            pass


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read a checkpoint file (or the one in run directory ``path``)."""
    file = checkpoint_path(path)
    if not file.exists():
        raise ConfigError(f"no checkpoint at {str(file)!r}; nothing to resume from (run "
                          f"without --resume to start afresh)")
    try:
        return _read(file)
    except ConfigError:
        raise
    except Exception as exc:  # zip, zlib, json, utf-8, shape: all mean "corrupt"
        raise ConfigError(
            f"checkpoint {str(file)!r} is unreadable ({type(exc).__name__}: {exc}); it is "
            f"corrupt or not a meshkit checkpoint. {_AFRESH}") from None


def _read(file: Path) -> Checkpoint:
    # allow_pickle=False: an object array (or a pickled file) is refused by
    # numpy before anything in it is executed.
    with np.load(file, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    header = arrays.pop(_META, None)
    if header is None:
        raise ConfigError(f"checkpoint {str(file)!r} has no {_META} header; not a meshkit "
                          f"checkpoint. {_AFRESH}")
    meta = json.loads(header.tobytes().decode("utf-8"))
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ConfigError(f"checkpoint {str(file)!r} has format {found!r}; this "
                          f"meshkit reads format {FORMAT}")
    _check_meta(file, meta)
    for name, spelled in dict(meta.get("dtypes") or {}).items():
        arrays[name] = arrays[name].view(dtype_from_name(spelled))
    return Checkpoint(
        round=meta["round"],
        state=_from_json(meta["state"], arrays),
        outer_state=_from_json(meta["outer"], arrays),
        rng_state=_from_json(meta["rng"], arrays),
        identity=_from_json(meta["identity"], arrays),
        report=_from_json(meta.get("report") or {}, arrays),
        clients=_from_json(meta.get("clients") or {}, arrays),
        aggregator_state=_from_json(meta.get("aggregator") or {}, arrays),
        privacy_state=_from_json(meta.get("privacy") or {}, arrays),
        strategy_state=_from_json(meta.get("strategy") or {}, arrays),
        stalled_clients=dict(meta.get("stalled") or {}),
    )


#: What to do about a checkpoint that cannot be trusted.
_AFRESH = "Restore the file, or start afresh with --overwrite (which replaces it)"

#: The header fields that hold JSON objects; "report", "dtypes", "clients",
#: "aggregator" and "privacy" may be absent.
_OBJECTS = ("state", "outer", "rng", "identity", "report", "dtypes", "clients", "aggregator",
            "privacy", "strategy", "stalled")
_OPTIONAL = ("report", "dtypes", "clients", "aggregator", "privacy", "strategy", "stalled")


def _check_meta(file: Path, meta: Mapping[str, Any]) -> None:
    """Refuse a header field of the wrong JSON type, naming it (not a traceback later)."""
    problems = []
    rnd = meta.get("round")
    if isinstance(rnd, bool) or not isinstance(rnd, int) or rnd < 0:
        problems.append(f"round is {rnd!r}, not a round number")
    for name in _OBJECTS:
        value = meta.get(name)
        if not isinstance(value, dict) and not (name in _OPTIONAL and value is None):
            problems.append(f"{name} is {'missing' if value is None else repr(value)[:40]}, "
                            f"not a JSON object")
    stalled = meta.get("stalled")
    if isinstance(stalled, dict) and not all(
            k.isdigit() and isinstance(v, str) for k, v in stalled.items()):
        problems.append("stalled is not a JSON object of client number -> reason")
    if problems:
        raise ConfigError(f"checkpoint {str(file)!r} is damaged or not from this meshkit: its "
                          f"header's {'; '.join(problems)}. {_AFRESH}")
