"""A worker's local-SGD replica (DiLoCo): inner steps on its shard, pseudo-gradients out,
outer updates in, and the whole replica handed over to heal a newcomer.

Rule: everything a replica holds between requests lives in :class:`LocalSGD`
-- the global model it last applied (``anchor``, bit-identical on every
replica), its own model (``local``), the snapshot of each fragment whose
pseudo-gradient is out and whose update has not come back -- plus, in the
task, the inner optimizer's state (``optimizer_state()``/``load_replica()``,
docs/tasks.md). The arithmetic both sides of an exchange must do alike (the
fragments, the update applied to the anchor, the digest) is here too, and the
coordinator's strategy calls the same functions, so the coordinator's global
model and every replica's anchor are the same bits (checked by digest).

The requests (docs/protocol.md §7.3; schemas in :mod:`meshkit.train._messages.local_sgd`):

* ``replica_init``: start from ``state`` (anchor = local = it), a fresh inner
  optimizer, ``fragments`` fragments, ``bits``-bit outer gradients;
* ``inner``: apply the outer updates (``updated``) that came back (each fragment's
  anchor moves by the decoded update; its local values keep the progress made
  since its snapshot: ``local = anchor + (local - snapshot)``), run ``steps``
  inner steps (the task's ``gradients`` + ``apply`` on a seeded batch of the
  shard), then, when ``send`` names a fragment, snapshot it and reply with its
  pseudo-gradient ``anchor - local`` encoded at ``bits``;
  With ``ring`` (``exchange = "ring"``) the pseudo-gradient is not sent to rank 0:
  the replicas sum their codes exactly over the mesh ring (``Group.mesh_sum``), and
  each steps its own copy of the outer optimizer (``replica_init``'s ``outer``) and
  applies the encoded update at once (:meth:`LocalSGD._ring`);
* ``replica_get`` / ``replica_put``: the whole replica, out of a live one and
  into a newcomer, each answered with the digests that prove the copy.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Mapping

import attrs
import numpy as np

from meshkit import plugins
from meshkit.aggregation import decode_blocks, encode_blocks, mean_of_sum, on_grid, sum_dtype
from meshkit.errors import MeshError, ProtocolError
from meshkit.outer import step_parameters
from meshkit.state import is_array, is_float_dtype
from meshkit.task import buffer_keys
from meshkit.train._sharding import client_seed

__all__ = ["LocalSGD", "split_fragments", "state_digest", "apply_update", "pseudo_gradients",
           "decode_update", "outer_update", "outer_optimizers"]

#: ``batch(shard, shards, batch_size, seed) -> (x, y)``: the worker's seeded batch of a shard.
BatchOf = Callable[[int, int, int, int], tuple[Any, Any]]


def split_fragments(state: Mapping[str, Any], count: int) -> list[list[str]]:
    """The float-array keys of ``state`` in ``count`` contiguous groups (state order) of about
    equal element counts: Streaming DiLoCo's fragments. Every key is in exactly one.

    Refuses (``ValueError``) more fragments than float arrays: a fragment would be empty.
    """
    keys = [k for k, v in state.items() if is_array(v) and is_float_dtype(v.dtype)]
    if not 1 <= count <= max(len(keys), 1):
        raise ValueError(f"{count} fragments, but the model has {len(keys)} float arrays; "
                         f"use at most {len(keys)} fragments")
    sizes = np.array([int(np.asarray(state[k]).size) for k in keys], dtype=np.int64)
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if len(ends) else 0
    groups: list[list[str]] = [[] for _ in range(count)]
    for i, key in enumerate(keys):
        # The fragment whose share of the elements this key's middle falls in, but
        # never fewer keys left than fragments still empty.
        middle = (int(ends[i]) - sizes[i] / 2) / max(total, 1)
        index = min(int(middle * count), count - 1)
        index = max(index, count - (len(keys) - i))
        index = min(index, max((j for j, g in enumerate(groups) if g), default=-1) + 1)
        groups[index].append(key)
    return groups


def state_digest(state: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of a state's keys, dtypes, shapes and bytes, in key order: two
    replicas with the same digest hold the same bits."""
    h = hashlib.sha256()
    for key in sorted(state):
        value = state[key]
        h.update(key.encode() + b"\0")
        if isinstance(value, np.ndarray):
            array = np.ascontiguousarray(value)
            h.update(f"{array.dtype.str}{array.shape}".encode() + b"\0")
            h.update(array.tobytes())
        else:
            h.update(json.dumps(value, sort_keys=True).encode() + b"\0")
    return h.hexdigest()


def pseudo_gradients(anchor: Mapping[str, Any], local: Mapping[str, Any],
                     keys: list[str]) -> dict[str, np.ndarray]:
    """``anchor - local`` of ``keys``, each in float32 (the exchange's precision)."""
    return {k: (np.asarray(anchor[k], dtype=np.float32)
                - np.asarray(local[k], dtype=np.float32)) for k in keys}


def decode_update(anchor: Mapping[str, Any], codes: Mapping[str, Any],
                  scales: Mapping[str, Any], keys: list[str], bits: int,
                  what: str) -> dict[str, np.ndarray]:
    """Each key's decoded update, shaped as the anchor's array; a message that does not
    fit (a key missing or extra, a length, a dtype) is a :class:`ProtocolError`."""
    if set(codes) != set(keys) or (bits != 32 and set(scales) != set(keys)):
        raise ProtocolError(f"{what}: carries keys {sorted(codes)[:5]}, the fragment has "
                            f"{sorted(keys)[:5]}")
    out = {}
    for key in keys:
        shape = np.shape(anchor[key])
        size = int(np.prod(shape, dtype=np.int64))
        scale = scales.get(key, np.zeros(0, dtype=np.float32))
        out[key] = decode_blocks(codes[key], scale, size, bits,
                                 what=f"{what}, key {key!r}").reshape(shape)
    return out


def apply_update(value: Any, update: np.ndarray) -> np.ndarray:
    """The anchor's new value: ``value + update`` in the value's dtype (the one rule the
    coordinator and every replica follow, so their models stay the same bits)."""
    array = np.asarray(value)
    return (array + update.astype(array.dtype)).astype(array.dtype)


def outer_update(optimizer: Any, start: Mapping[str, Any], mean: Mapping[str, Any],
                 keys: list[str], bits: int, *, buffers: Any = (),
                 name: str = "outer") -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """One fragment's outer step on the mean pseudo-gradient, as the update every replica
    applies: ``(codes, scales)`` of ``stepped - start`` encoded at ``bits``. The star's
    coordinator and, over the ring, every replica compute it alike from the same bits."""
    consensus = {k: (np.asarray(start[k]) - np.asarray(mean[k]).astype(
        np.asarray(start[k]).dtype)) for k in keys}
    stepped = step_parameters(optimizer, {k: start[k] for k in keys}, consensus,
                              buffers=buffers, name=name)
    codes: dict[str, np.ndarray] = {}
    scales: dict[str, np.ndarray] = {}
    for key in keys:
        delta = (np.asarray(stepped[key], dtype=np.float32)
                 - np.asarray(start[key], dtype=np.float32))
        codes[key], scale = encode_blocks(delta, bits)
        if bits != 32:
            scales[key] = scale
    return codes, scales


def outer_optimizers(spec: Mapping[str, Any], state: Mapping[str, Any],
                     count: int) -> list[Any]:
    """``count`` outer optimizers (one a fragment) built from ``spec`` (``{"name",
    "options"}``), each loaded from its ``outer{p}/`` part of ``state``."""
    out = []
    for p in range(count):
        optimizer = plugins.create("outer_optimizer", str(spec["name"]),
                                   dict(spec.get("options") or {}))
        prefix = f"outer{p}/"
        part = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if part:
            optimizer.load_state_dict(part)
        out.append(optimizer)
    return out


@attrs.define
class LocalSGD:
    """One worker's replica (the module docstring); ``task`` runs the inner steps."""

    task: Any
    anchor: dict[str, Any] | None = None
    local: dict[str, Any] | None = None
    fragments: list[list[str]] = attrs.Factory(list)
    bits: int = 32
    #: Fragment -> its local values when its pseudo-gradient was taken (update pending).
    snapshots: dict[int, dict[str, np.ndarray]] = attrs.Factory(dict)
    inner_steps: int = 0
    #: The worker's group: the ring exchange's links (``exchange = "ring"``).
    group: Any = None
    #: Over the ring, each fragment's outer optimizer (every replica steps its own, alike).
    optimizers: list[Any] = attrs.Factory(list)

    def handle(self, op: str, request: Mapping[str, Any], batch: BatchOf) -> dict[str, Any]:
        if op == "replica_init":
            state = dict(request["state"])
            self._start(state, state, int(request["fragments"]), int(request["bits"]), None)
            self._outer(request)
            return {"digest": state_digest(self._anchor())}
        if op == "inner":
            return self._inner(request, batch)
        if op == "replica_get":
            return self._handed_over()
        if op == "replica_put":
            anchor = dict(request["anchor"])
            self._start(anchor, dict(request["local"]), int(request["fragments"]),
                        int(request["bits"]), dict(request["optimizer"]))
            pending = [int(p) for p in request["pending"]]
            snapshot = dict(request["snapshot"])
            for p in pending:
                self._fragment(p)
                self.snapshots[p] = {k: np.array(snapshot[k]) for k in self.fragments[p]}
            self.inner_steps = int(request["inner_steps"])
            self._outer(request)
            return {"digest": state_digest(self._anchor()),
                    "replica_digest": self._replica_digest()}
        raise MeshError(f"unknown replica request {op!r}")

    # -- the requests ------------------------------------------------------------------

    def _start(self, anchor: dict[str, Any], local: dict[str, Any], fragments: int, bits: int,
               optimizer: dict[str, Any] | None) -> None:
        self.fragments = split_fragments(anchor, fragments)
        self.bits = bits
        self.anchor = {k: np.array(v) if isinstance(v, np.ndarray) else v
                       for k, v in anchor.items()}
        self.snapshots = {}
        self.inner_steps = 0
        self.local = self._load(dict(local), optimizer if optimizer is not None else {})

    def _load(self, local: dict[str, Any], optimizer: Mapping[str, Any] | None) -> dict[str, Any]:
        """Make ``local`` the task's replica: ``optimizer`` {} starts the inner optimizer afresh,
        None keeps its state (an outer update moved the model, not the optimizer)."""
        load = getattr(self.task, "load_replica", None)
        if not callable(load):
            return local  # a task whose apply() is a function of (state, gradients)
        return dict(load(local, optimizer))

    def _outer(self, request: Mapping[str, Any]) -> None:
        """Over the ring the replica steps the outer optimizer itself: built from the
        coordinator's name, options and state (absent: the star steps it)."""
        spec = request.get("outer")
        self.optimizers = ([] if spec is None else outer_optimizers(
            spec, request.get("outer_state") or {}, len(self.fragments)))

    def _apply(self, updated: list[int], codes: Mapping[str, Any],
               scales: Mapping[str, Any]) -> None:
        """Apply fragments' outer updates: the anchor moves by the decoded update, the local
        values keep the progress made since their snapshot."""
        anchor, local = self._anchor(), self._local()
        moved = False
        carried = {k for p in updated for k in self.fragments[p]}
        if set(codes) != carried:
            raise ProtocolError(f"the updates carry keys {sorted(set(codes) ^ carried)[:5]} "
                                f"that fragments {updated} do not have, or lack them")
        for p in updated:
            if p not in self.snapshots:
                raise MeshError(f"an update for fragment {p}, whose pseudo-gradient this "
                                f"replica did not send")
            keys = self.fragments[p]
            decoded = decode_update(anchor, {k: codes[k] for k in keys},
                                    {k: scales[k] for k in keys if k in scales}, keys,
                                    self.bits, f"the update of fragment {p}")
            snapshot = self.snapshots.pop(p)
            for key in keys:
                anchor[key] = apply_update(anchor[key], decoded[key])
                progress = np.asarray(local[key]) - snapshot[key]
                local[key] = (anchor[key] + progress).astype(np.asarray(local[key]).dtype)
            moved = True
        if moved:
            self.local = self._load(local, None)

    def _inner(self, request: Mapping[str, Any], batch: BatchOf) -> dict[str, Any]:
        updated = [self._fragment(int(p)) for p in request.get("updated") or ()]
        self._apply(updated, request.get("update_codes") or {},
                    request.get("update_scales") or {})
        anchor, local = self._anchor(), self._local()
        shard, shards = int(request["shard"]), int(request["shards"])
        size, seed, first = int(request["batch_size"]), int(request["seed"]), int(request["step"])
        examples, losses = 0, []
        for k in range(int(request["steps"])):
            x, y = batch(shard, shards, size, client_seed(seed, first + k, shard))
            result = self.task.gradients(local, x, y)
            local = self.local = dict(self.task.apply(local, result.state))
            examples += int(result.examples)
            loss = result.metrics.get("train_loss")
            if loss is not None:
                losses.append(float(loss))
            self.inner_steps += 1
        reply: dict[str, Any] = {"examples": examples,
                                 "metrics": {"train_loss": float(np.mean(losses))} if losses
                                 else {},
                                 "digest": state_digest(anchor)}
        send = request.get("send")
        if send is not None:
            p = self._fragment(int(send))
            if p in self.snapshots:
                raise MeshError(f"fragment {p}'s pseudo-gradient is already out, its update "
                                f"not back")
            keys = self.fragments[p]
            self.snapshots[p] = {k: np.array(local[k]) for k in keys}
            out: dict[str, np.ndarray] = {}
            out_scales: dict[str, np.ndarray] = {}
            for key, g in pseudo_gradients(anchor, self.snapshots[p], keys).items():
                out[key], scale = encode_blocks(g, self.bits)
                if self.bits != 32:
                    out_scales[key] = scale
            ring = request.get("ring")
            if ring is None:
                reply["codes"], reply["scales"] = out, out_scales
            else:
                reply.update(self._ring(p, keys, out, out_scales, [int(r) for r in ring],
                                        int(request["exchange"]), bool(request.get("report"))))
        return reply

    def _ring(self, p: int, keys: list[str], codes: Mapping[str, np.ndarray],
              scales: Mapping[str, np.ndarray], ranks: list[int], exchange: int,
              report: bool) -> dict[str, Any]:
        """Fragment ``p``'s exchange over the mesh ring, then its outer step, here.

        The replicas agree on each block's scale (the largest of theirs: one ring max of
        the float32 scales), re-code their decoded values on it, and sum the codes exactly
        in :func:`meshkit.aggregation.sum_dtype` (int16 for 8-bit codes): the mean is the
        star's bits (:class:`meshkit.aggregation.GridSum`). Every replica then steps its
        own copy of the outer optimizer and applies the update encoded at ``bits``, as
        the star's replicas apply the coordinator's. ``report``: this replica hands the
        sum to the coordinator, which steps the global model alike.
        """
        if self.group is None or not self.optimizers or self.bits == 32:
            raise MeshError("an exchange over the ring needs the worker's mesh group, the "
                            "outer optimizer (replica_init's outer) and 8- or 4-bit codes")
        anchor = self._anchor()
        sizes = {k: int(np.asarray(anchor[k]).size) for k in keys}
        values = {k: decode_blocks(codes[k], scales[k], sizes[k], self.bits) for k in keys}
        before = int(getattr(self.group, "bytes_out", 0))
        # Two collectives an exchange, numbered by it: a late segment of an earlier
        # exchange is dropped by the ring, never summed into this one.
        shared = self.group.mesh_sum(dict(scales), ranks=ranks, step=2 * exchange + 1,
                                     op="max")
        dtype = sum_dtype(self.bits, len(ranks))
        grid = {k: on_grid(values[k], shared[k], self.bits).astype(dtype) for k in keys}
        totals = self.group.mesh_sum(grid, ranks=ranks, step=2 * exchange + 2)
        sent = int(getattr(self.group, "bytes_out", 0)) - before
        mean = {k: mean_of_sum(totals[k], shared[k], len(ranks)).reshape(np.shape(anchor[k]))
                for k in keys}
        update, update_scales = outer_update(
            self.optimizers[p], anchor, mean, keys, self.bits,
            buffers=buffer_keys(self.task), name="outer")
        self._apply([p], update, update_scales)
        out: dict[str, Any] = {"ring_bytes": sent, "applied": state_digest(self._anchor())}
        if report:
            out["totals"] = {k: np.asarray(v) for k, v in totals.items()}
            out["shared"] = {k: np.asarray(v) for k, v in shared.items()}
        return out

    def _handed_over(self) -> dict[str, Any]:
        anchor, local = self._anchor(), self._local()
        snapshot = {k: v for p in sorted(self.snapshots) for k, v in self.snapshots[p].items()}
        return {"anchor": anchor, "local": {k: np.array(v) if isinstance(v, np.ndarray) else v
                                            for k, v in local.items()},
                "optimizer": self._optimizer(), "snapshot": snapshot,
                "pending": sorted(self.snapshots), "inner_steps": self.inner_steps,
                "digest": state_digest(anchor), "replica_digest": self._replica_digest()}

    # -- helpers ---------------------------------------------------------------------------

    def _optimizer(self) -> dict[str, Any]:
        state = getattr(self.task, "optimizer_state", None)
        return dict(state()) if callable(state) else {}

    def _replica_digest(self) -> str:
        """The digest of everything a newcomer takes over: anchor, local model, inner
        optimizer state, pending snapshots."""
        parts = {"anchor": state_digest(self._anchor()), "local": state_digest(self._local()),
                 "optimizer": state_digest(self._optimizer()),
                 "snapshots": state_digest({f"{p}/{k}": v for p, s in self.snapshots.items()
                                            for k, v in s.items()})}
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()

    def _fragment(self, p: int) -> int:
        if not 0 <= p < len(self.fragments):
            raise MeshError(f"fragment {p}: this replica has {len(self.fragments)} fragments")
        return p

    def _anchor(self) -> dict[str, Any]:
        if self.anchor is None:
            raise MeshError("no replica here yet: replica_init or replica_put starts one")
        return self.anchor

    def _local(self) -> dict[str, Any]:
        if self.local is None:
            raise MeshError("no replica here yet: replica_init or replica_put starts one")
        return self.local
