"""The node driver: capability handshake, run control, serving loops and reports.

A node joins a mesh with :meth:`meshkit.NodeConfig.connect`, announces what
it is (:class:`NodeCaps`) to the coordinator, then serves the jobs rank 0
sends it until told to shut down. Nothing here prints: every loop returns a
report (:class:`NodeReport`, :class:`TrainReport`), because a node embedded
in an app or a board's host shim has no stdout anyone reads.

Protocol (every message is a state: JSON values plus named numpy arrays)
-----------------------------------------------------------------------

All tags are in the kernel's reserved range (see :mod:`meshkit.transport`).

``TAG_CAPS`` (worker -> rank 0, once, before any work moves)
    ``{"caps": NodeCaps.to_json()}``. The coordinator collects every
    worker's record with :func:`collect_caps`, fires the
    ``meshkit_node_joined(caps=...)`` hook for each, and places work only
    where :meth:`NodeCaps.accepts` holds.

``TAG_JOB`` (rank 0 -> worker): one job at a time, ``"kind"`` says which
    * ``{"kind": "pipeline", "job": id, "stage": {...}, "param.<name>": array...}``:
      serve one pipeline stage (:func:`serve_worker`, or
      :func:`serve_fixed_function` on a board rank). ``stage`` is
      :meth:`meshkit.pipeline.Stage.to_message` plus the route: ``prev`` (rank
      activations come from), ``next`` (rank results go to; 0 = back to the
      coordinator) and ``index`` (position in the pipeline).
    * ``{"kind": "train", "job": id, "spec": {...}}``: run
      ``meshkit.train.worker.serve_trainer(group, spec, control)`` (its module
      documents ``spec``). A fixed-function rank answers with an ``error``
      (it cannot train: :meth:`NodeCaps.can_train` says why).
    * ``{"kind": "shutdown"}``: leave the mesh.

``TAG_ACT`` (stage to stage, and rank 0 -> first stage)
    ``{"act": [job, seq], "x": float32 array of shape (k, n)}``: ``k``
    activations (rows) numbered ``seq .. seq + k - 1``; and ``{"end": job}``
    after the last one: a stage forwards ``end`` to ``next`` and reports.
    Frames of another job are stale (left over from an aborted job) and are
    dropped. (One JSON leaf a frame: this is the hot path.)

``TAG_UP`` (worker -> rank 0): replies, so the coordinator can take them with
one ``recv(ANY, TAG_UP)``
    * ``{"kind": "ready", "job": id}``: the stage was accepted; activations
      may move;
    * ``{"result": [job, seq], "x": array}``: the last stage's output rows;
    * ``{"kind": "error", "job": id, "error": ExceptionName, "message": str}``:
      the job failed on this rank (the rank then drains the job until its
      ``end`` and reports, so the pipeline unwinds instead of hanging);
    * ``{"kind": "report", "job": id, "report": {...}}``: the job ended on this
      rank (a :class:`NodeReport` or :class:`TrainReport`, ``"type"`` says which);
    * ``{"kind": "left", "job": id, "report": {...}}``: this rank stopped
      (stop handle or step budget) and is leaving the mesh.

``TAG_ABORT`` (rank 0 -> worker)
    ``{"kind": "abort", "job": id}``: abandon the job (a stage before this
    one died or left, so its ``end`` cannot arrive). Checked only while the
    stage is idle, so activations already queued are still served.
"""

from __future__ import annotations

import logging
import os
import platform as _platform
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import attrs

from meshkit.errors import (
    BoardError,
    ConfigError,
    MeshError,
    PeerLostError,
    PlacementError,
    WireError,
)
from meshkit.node.fixed_function import FixedFunction
from meshkit.node.config import NodeRole
from meshkit.transport import TAG_CAPS, TAG_CONTROL

if TYPE_CHECKING:
    import numpy as np

    from meshkit.node.config import NodeConfig
    from meshkit.pipeline import Stage

__all__ = [
    "TAG_CAPS",
    "TAG_JOB",
    "TAG_UP",
    "TAG_ACT",
    "TAG_ABORT",
    "NodeCaps",
    "NodeControl",
    "NodeReport",
    "TrainReport",
    "platform_tag",
    "local_caps",
    "send_caps",
    "collect_caps",
    "send_job",
    "recv_job",
    "serve_worker",
    "serve_fixed_function",
    "serve_node",
    "shutdown_nodes",
]

log = logging.getLogger(__name__)

#: rank 0 -> worker: the next job (pipeline stage, training spec, shutdown).
TAG_JOB = TAG_CONTROL
#: worker -> rank 0: ready / result / error / report / left.
TAG_UP = 0xFFFF0012
#: Activations moving along a pipeline.
TAG_ACT = 0xFFFF0013
#: rank 0 -> worker: abandon a pipeline job (a stage before you died).
TAG_ABORT = 0xFFFF0014

#: How often a node parked waiting for work re-checks its stop handle (seconds).
POLL_INTERVAL = 0.2


# -- identity ------------------------------------------------------------------


def platform_tag() -> str:
    """A short platform name for logs and placement (``linux``, ``macos``, ...)."""
    plat = sys.platform
    if plat.startswith("linux"):
        # Python on Android reports "linux" before 3.13; the ANDROID_ROOT
        # variable is how the platform itself tells.
        return "android" if "ANDROID_ROOT" in os.environ else "linux"
    return {"darwin": "macos", "win32": "windows", "ios": "ios", "android": "android",
            "emscripten": "wasm", "wasi": "wasm"}.get(plat, plat)


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may actually use
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _memory() -> tuple[int | None, int | None]:
    """(available, total) physical memory in bytes, or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            info = {}
            for line in fh:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
        return info.get("MemAvailable"), info.get("MemTotal")
    except (OSError, ValueError, IndexError):
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (AttributeError, ValueError, OSError):
        return None, None


def _optional_int(value: Any, field: str, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(f"{where}: {field} must be an integer or null, got {value!r}")
    return value


@attrs.frozen
class NodeCaps:
    """What a node tells the coordinator about itself, so placement follows
    what the hardware can do rather than assumption.

    Beyond the reference's rank/role/devices/platform, a node advertises what
    placement heuristics need: usable CPU cores (``cpu_count``, the process's
    affinity), physical memory (``memory_free``/``memory_total`` bytes, None
    where the OS does not say), its ``heap_bytes`` budget and ``device``
    directive from :class:`~meshkit.NodeConfig`, and software versions
    (``python``, ``numpy``, ``meshkit``) so a mismatch shows up in the
    coordinator's log. ``hostname`` and ``pid`` say which process answered.
    """

    rank: int
    role: str = NodeRole.WORKER
    devices: tuple[str, ...] = ("cpu",)
    platform: str = attrs.field(factory=platform_tag)
    fixed_function: FixedFunction | None = None
    cpu_count: int = 1
    memory_free: int | None = None
    memory_total: int | None = None
    heap_bytes: int | None = None
    device: str = "auto"
    machine: str = ""
    hostname: str = ""
    pid: int = 0
    python: str = ""
    numpy: str = ""
    meshkit: str = ""

    def __attrs_post_init__(self) -> None:
        if self.role not in (NodeRole.WORKER, NodeRole.FIXED_FUNCTION):
            raise ConfigError(
                f"NodeCaps.role must be {NodeRole.WORKER!r} or {NodeRole.FIXED_FUNCTION!r}, "
                f"got {self.role!r}")
        if (self.role == NodeRole.FIXED_FUNCTION) != (self.fixed_function is not None):
            raise ConfigError(
                "NodeCaps: a fixed-function rank must carry its FixedFunction descriptor, "
                "and a worker must not")

    @property
    def is_fixed_function(self) -> bool:
        return self.fixed_function is not None

    def check(self, stage: Any) -> None:
        """Raise :class:`PlacementError` unless this node can run ``stage``.

        A worker compiles whatever it is shipped; a fixed-function rank runs
        only the stage its hardware implements (:meth:`FixedFunction.check`).
        """
        if self.fixed_function is not None:
            try:
                self.fixed_function.check(stage)
            except PlacementError as exc:
                raise PlacementError(f"rank {self.rank}: {exc}") from None

    def accepts(self, stage: Any) -> bool:
        """Whether this node can run ``stage`` (see :meth:`check`)."""
        try:
            self.check(stage)
        except PlacementError:
            return False
        return True

    def check_train(self) -> None:
        """Raise :class:`PlacementError` unless this node can join a training run."""
        ff = self.fixed_function
        if ff is not None:
            # Shipping a training spec to a board does not fail loudly on its
            # own: it never reads the spec, and the first gradient reduce then
            # waits for it for ever. So the coordinator asks first.
            raise PlacementError(
                f"rank {self.rank} is a fixed-function rank implementing the "
                f"pre-synthesized stage [{ff.stage_id}] and cannot train: its datapath "
                f"has no backward pass, and a rank that never joins the reduce stalls "
                f"every rank that does. Leave it out of the training job (train on "
                f"worker ranks only)")

    def can_train(self) -> bool:
        """Whether this node can join a training run (:meth:`check_train` says why not)."""
        return self.fixed_function is None

    def why_not_train(self) -> str | None:
        """The reason :meth:`can_train` is false, or None when it can train."""
        try:
            self.check_train()
        except PlacementError as exc:
            return str(exc)
        return None

    def to_json(self) -> dict[str, Any]:
        data = attrs.asdict(self, recurse=False)
        data["devices"] = list(self.devices)
        data["fixed_function"] = (self.fixed_function.to_json()
                                  if self.fixed_function is not None else None)
        return data

    @classmethod
    def from_json(cls, data: Any, *, where: str = "NodeCaps") -> NodeCaps:
        """Parse a caps record from the wire, checking every field's type.

        Unknown keys are ignored (a newer node may advertise more than this
        coordinator knows about); wrong types are a :class:`WireError`.
        """
        if not isinstance(data, Mapping):
            raise WireError(f"{where}: expected a JSON object, got {type(data).__name__}")
        known = {f.name: f for f in attrs.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key not in known:
                continue
            if key == "fixed_function":
                if value is not None:
                    try:
                        value = FixedFunction.from_json(value)
                    except ConfigError as exc:
                        raise WireError(f"{where}: {exc}") from None
            elif key == "devices":
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise WireError(f"{where}: devices must be a list of strings, got {value!r}")
                value = tuple(value)
            elif key in ("rank", "cpu_count", "pid"):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise WireError(f"{where}: {key} must be an integer, got {value!r}")
            elif key in ("memory_free", "memory_total", "heap_bytes"):
                value = _optional_int(value, key, where)
            elif not isinstance(value, str):
                raise WireError(f"{where}: {key} must be a string, got {value!r}")
            kwargs[key] = value
        if "rank" not in kwargs:
            raise WireError(f"{where}: the record has no rank")
        try:
            return cls(**kwargs)
        except ConfigError as exc:
            raise WireError(f"{where}: {exc}") from None


def local_caps(rank: int, *, fixed_function: FixedFunction | None = None,
               device: str = "auto", heap_bytes: int | None = None,
               devices: Sequence[str] | None = None) -> NodeCaps:
    """This process's capabilities as rank ``rank`` (what :func:`send_caps` advertises)."""
    import numpy

    import meshkit

    free, total = _memory()
    if devices is None:
        devices = ["fpga"] if fixed_function is not None else ["cpu"]
    return NodeCaps(
        rank=rank,
        role=NodeRole.FIXED_FUNCTION if fixed_function is not None else NodeRole.WORKER,
        devices=tuple(devices),
        platform=platform_tag(),
        fixed_function=fixed_function,
        cpu_count=_cpu_count(),
        memory_free=free,
        memory_total=total,
        heap_bytes=heap_bytes,
        device=device,
        machine=_platform.machine(),
        hostname=_platform.node(),
        pid=os.getpid(),
        python=_platform.python_version(),
        numpy=numpy.__version__,
        meshkit=meshkit.__version__,
    )


def caps_for(config: NodeConfig, **kwargs: Any) -> NodeCaps:
    """:func:`local_caps` for a :class:`~meshkit.NodeConfig`."""
    return local_caps(config.rank, fixed_function=config.fixed_function,
                      device=config.device, heap_bytes=config.heap_bytes, **kwargs)


# -- capability handshake ------------------------------------------------------


def send_caps(group: Any, caps: NodeCaps) -> None:
    """Worker: announce ``caps`` to the coordinator (rank 0)."""
    if caps.rank != group.rank:
        raise ConfigError(
            f"caps advertise rank {caps.rank} but this node is rank {group.rank}")
    group.send(0, TAG_CAPS, {"caps": caps.to_json()})


def collect_caps(group: Any, *, timeout: float | None = None,
                 plugins: Any = None, hook: bool = True) -> list[NodeCaps]:
    """Coordinator: collect every worker's :class:`NodeCaps`, in rank order.

    Records are taken as they arrive; ``meshkit_node_joined(caps=...)`` fires
    for each in order of arrival (on ``plugins``, a
    :class:`meshkit.plugins.PluginSet`; the default set when None; no hook
    when ``hook`` is false). A worker that never announces itself is a
    :class:`PeerLostError` at ``timeout`` naming the ranks still missing; a
    record claiming another rank's identity is a :class:`WireError`.
    """
    if group.rank != 0:
        raise MeshError("collect_caps() runs on the coordinator (rank 0)")
    if hook and plugins is None:
        from meshkit import plugins as _plugins

        plugins = _plugins.default()
    deadline = time.monotonic() + (group.timeout if timeout is None else timeout)
    found: dict[int, NodeCaps] = {}
    expected = set(range(1, group.world_size))
    while expected - found.keys() - set(group.dead):
        remaining = deadline - time.monotonic()
        try:
            src, payload = group.recv(None, TAG_CAPS, timeout=max(remaining, 0.0))
        except PeerLostError as exc:
            missing = sorted(expected - found.keys())
            raise PeerLostError(
                f"capability handshake: rank(s) {missing} did not announce themselves "
                f"({exc})") from None
        caps = NodeCaps.from_json(payload.get("caps"), where=f"caps from rank {src}")
        if caps.rank != src:
            raise WireError(
                f"capability handshake: rank {src} advertised the caps of rank {caps.rank}; "
                f"each node must announce its own rank")
        if src in found:
            log.warning("rank %d announced its caps twice; keeping the first", src)
            continue
        found[src] = caps
        log.info("rank %d joined: %s %s, devices %s", src, caps.role, caps.platform,
                 ",".join(caps.devices))
        if hook:
            plugins.hook.meshkit_node_joined(caps=caps)
    dead = expected - found.keys()
    if dead:
        raise PeerLostError(
            f"capability handshake: rank(s) {sorted(dead)} died before announcing "
            f"themselves: " + "; ".join(f"rank {r}: {group.dead.get(r)}" for r in sorted(dead)))
    return [found[r] for r in sorted(found)]


# -- run control ---------------------------------------------------------------


@attrs.define
class NodeControl:
    """Bounds a node: a step budget, plus a stop handle another thread can raise.

    A node on a phone or a shared board gets backgrounded, throttled or
    unplugged, and must be able to leave without waiting for the job to end.
    Both are observed *between* activations: the one in progress always
    completes and is sent on. ``steps`` counts activations over the node's
    whole life (every job), so ``NodeControl(steps=3)`` serves exactly three
    and then leaves.
    """

    steps: int | None = attrs.field(default=None)
    _stop: threading.Event = attrs.field(factory=threading.Event, alias="stop_event")
    done: int = attrs.field(default=0, init=False)

    @steps.validator
    def _check_steps(self, attribute: Any, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise ConfigError(f"NodeControl steps must be a non-negative integer, got {value!r}")

    def stop(self) -> None:
        """Ask the node to leave after its current activation (thread-safe)."""
        self._stop.set()

    @property
    def stop_handle(self) -> threading.Event:
        """The event to ``set()`` from another thread to stop the node."""
        return self._stop

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    @property
    def budget_spent(self) -> bool:
        return self.steps is not None and self.done >= self.steps

    def should_continue(self) -> bool:
        """Whether another activation may be served."""
        return not self.stopped and not self.budget_spent

    def reason(self) -> str | None:
        """Why serving must end (``"stop"``, ``"budget"``), or None."""
        if self.stopped:
            return "stop"
        if self.budget_spent:
            return "budget"
        return None

    def count(self, n: int = 1) -> None:
        self.done += n


# -- reports -------------------------------------------------------------------


@attrs.frozen
class NodeReport:
    """What a node did serving one pipeline job, returned instead of printed.

    ``stopped`` is None when the job ended normally (its ``end`` arrived),
    ``"stop"`` or ``"budget"`` when :class:`NodeControl` ended it, and
    ``"error"`` when the stage failed (``error`` holds the message).
    """

    rank: int
    role: str = NodeRole.WORKER
    stage_id: str | None = None
    job: int | None = None
    activations: int = 0
    stopped: str | None = None
    error: str | None = None
    platform: str = attrs.field(factory=platform_tag)
    device: str = "cpu"
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"type": "node", **attrs.asdict(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NodeReport:
        return _report_from_json(cls, data)


@attrs.frozen
class TrainReport:
    """What a node did in a training job (built by ``meshkit.train.worker.serve_trainer``).

    ``steps`` counts optimizer steps (or local epochs in a federated round),
    ``rounds`` the reduce rounds it took part in, ``examples`` the examples it
    trained on; ``metrics`` is the task's last metrics (JSON numbers);
    ``stopped`` is None on a normal end, else why the node left early.
    """

    rank: int
    steps: int = 0
    rounds: int = 0
    examples: int = 0
    metrics: dict[str, Any] = attrs.field(factory=dict)
    stopped: str | None = None
    error: str | None = None
    job: int | None = None
    platform: str = attrs.field(factory=platform_tag)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"type": "train", **attrs.asdict(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TrainReport:
        return _report_from_json(cls, data)


def _report_from_json(cls: type, data: Mapping[str, Any]) -> Any:
    if not isinstance(data, Mapping):
        raise WireError(f"a {cls.__name__} must be a JSON object, got {data!r}")
    names = {f.name for f in attrs.fields(cls)}
    try:
        return cls(**{k: v for k, v in data.items() if k in names})
    except TypeError as exc:
        raise WireError(f"malformed {cls.__name__}: {exc}") from None


def report_from_json(data: Mapping[str, Any]) -> NodeReport | TrainReport:
    """A report from its JSON form (``"type"`` selects node or train)."""
    kind = data.get("type") if isinstance(data, Mapping) else None
    if kind == "train":
        return TrainReport.from_json(data)
    return NodeReport.from_json(data)


# -- jobs ------------------------------------------------------------------------


def send_job(group: Any, rank: int, job: Mapping[str, Any]) -> None:
    """Coordinator: send a job message (see the module docstring) to ``rank``."""
    group.send(rank, TAG_JOB, job)


def recv_job(group: Any, *, control: NodeControl | None = None,
             timeout: float = float("inf")) -> dict[str, Any] | None:
    """Worker: wait for the next job from rank 0; None if ``control`` stopped us first."""
    payload = _recv_polling(group, 0, TAG_JOB, control, timeout)
    if payload is None:
        return None
    if not isinstance(payload.get("kind"), str):
        raise WireError(f"job message from rank 0 has no 'kind': keys {sorted(payload)}")
    return dict(payload)


def shutdown_nodes(group: Any, ranks: Iterable[int] | None = None) -> None:
    """Coordinator: tell ``ranks`` (every live worker by default) to leave the mesh."""
    for rank in (group.live_ranks if ranks is None else ranks):
        try:
            send_job(group, rank, {"kind": "shutdown"})
        except PeerLostError:
            pass  # already gone: nothing left to shut down


def _activation(value: Any, where: str, error: type[MeshError] = MeshError) -> np.ndarray:
    """``value`` as a flat float32 activation; anything but real numbers is ``error``.

    ``numpy.asarray(None, float32)`` is ``[nan]``: a function or board that
    forgot to return would otherwise pass a NaN on as if it were a result.
    """
    import reprlib

    import numpy as np

    try:
        array = None if value is None else np.asarray(value)
    except (TypeError, ValueError):  # ragged sequences and the like
        array = None
    numeric = array is not None and (
        array.dtype.kind in "biuf"
        or array.dtype.type.__module__.startswith("ml_dtypes"))  # bfloat16 and friends
    if not numeric:
        found = reprlib.repr(value) if array is None or array.dtype.kind == "O" \
            else f"{reprlib.repr(value)} (dtype {array.dtype})"
        raise error(f"{where} returned {found}, expected numbers (a 1-D float32 activation)")
    assert array is not None
    return np.asarray(array, dtype=np.float32).reshape(-1)


def _up(group: Any, message: Mapping[str, Any]) -> None:
    group.send(0, TAG_UP, message)


def _recv_polling(group: Any, src: int, tag: int, control: NodeControl | None,
                  timeout: float, abort: Any = None) -> Any:
    """``recv`` that re-checks ``control``'s stop handle every :data:`POLL_INTERVAL`.

    Returns None when the stop handle fired while waiting (or ``abort()``
    returned true). A peer that is lost still raises :class:`PeerLostError`
    at once; ``timeout`` bounds the wait.
    """
    deadline = time.monotonic() + timeout
    idle = False
    while True:
        if control is not None and control.stopped:
            return None
        # Only when nothing arrived for a whole poll: frames already queued
        # (activations sent before the abort) are still served in order.
        if idle and abort is not None and abort():
            return None
        idle = True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PeerLostError(
                f"rank {group.rank}: nothing from rank {src} within {timeout:g} s")
        polling = control is not None or abort is not None
        wait = min(remaining, POLL_INTERVAL) if polling else remaining
        started = time.monotonic()
        try:
            return group.recv(src, tag, timeout=wait)
        except PeerLostError:
            dead = group.dead
            waited = time.monotonic() - started
            # The transport says "lost" both for a dead peer and for a quiet
            # one; only the quiet one is worth waiting for again.
            if src in dead or 0 in dead or waited < wait * 0.5:
                raise


# -- serving -----------------------------------------------------------------------


def _stage_or_refuse(group: Any, job: Mapping[str, Any]) -> tuple[Stage, dict[str, Any]]:
    """:func:`_stage_from_job`, telling rank 0 when the job cannot be parsed.

    Otherwise the coordinator waits for a ``ready`` that never comes until
    its timeout (e.g. a newer coordinator shipping an op this node lacks).
    """
    try:
        return _stage_from_job(job)
    except WireError as exc:
        _up(group, {"kind": "error", "job": job.get("job"), "error": type(exc).__name__,
                    "message": f"rank {group.rank}: {exc}"})
        raise


def _stage_from_job(job: Mapping[str, Any]) -> tuple[Stage, dict[str, Any]]:
    from meshkit.pipeline import Stage

    if job.get("kind") != "pipeline":
        raise WireError(f"expected a pipeline job, got kind {job.get('kind')!r}")
    route = job.get("stage")
    if not isinstance(route, Mapping):
        raise WireError("pipeline job carries no 'stage' object")
    for key in ("prev", "next"):
        value = route.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise WireError(f"pipeline job: stage.{key} must be a rank, got {value!r}")
    stage = Stage.from_message(job)
    return stage, {"prev": route["prev"], "next": route["next"], "job": job.get("job"),
                   "index": route.get("index")}


class _Serving:
    """The activation loop shared by worker and fixed-function stages."""

    def __init__(self, group: Any, route: Mapping[str, Any], control: NodeControl,
                 timeout: float) -> None:
        self.group = group
        self.prev: int = route["prev"]
        self.next: int = route["next"]
        self.job = route["job"]
        self.control = control
        self.timeout = timeout

    def next_activation(self) -> tuple[int, np.ndarray] | None:
        """The next activation of this job, or None at ``end`` (or a stop while idle)."""
        import numpy as np

        while True:
            msg = _recv_polling(self.group, self.prev, TAG_ACT, self.control, self.timeout,
                                self.aborted)
            if msg is None:
                return None
            if "end" in msg:
                if msg["end"] != self.job:
                    continue  # the end of an older, aborted job
                return None
            head = msg.get("act")
            x = msg.get("x")
            if not (isinstance(head, list) and len(head) == 2 and isinstance(head[1], int)
                    and isinstance(x, np.ndarray) and x.ndim == 2):
                raise WireError(
                    f"rank {self.group.rank}: malformed activation from rank {self.prev} "
                    f"(expected 'act': [job, seq] and a 2-D array 'x' of rows)")
            if head[0] != self.job:
                log.debug("rank %d: dropping a stale activation of job %r", self.group.rank,
                          head[0])
                continue
            return head[1], x

    def aborted(self) -> bool:
        """Whether rank 0 abandoned this job (checked only while idle)."""
        while True:
            try:
                msg = self.group.recv(0, TAG_ABORT, timeout=0)
            except PeerLostError:
                return False
            if msg.get("job") == self.job:
                log.info("rank %d: job %r aborted by the coordinator", self.group.rank,
                         self.job)
                return True

    def forward(self, seq: int, y: np.ndarray) -> None:
        # One JSON leaf per frame: every leaf costs an encode and a decode on
        # every hop, and these frames are the pipeline's hot path.
        msg = {"act" if self.next != 0 else "result": [self.job, seq], "x": y}
        if self.next == 0:
            _up(self.group, msg)
        else:
            self.group.send(self.next, TAG_ACT, msg)

    def forward_end(self) -> None:
        end = {"end": self.job}
        if self.next != 0:
            try:
                self.group.send(self.next, TAG_ACT, end)
            except PeerLostError as exc:
                log.warning("rank %d: could not pass the end of job %r on to rank %d: %s",
                            self.group.rank, self.job, self.next, exc)

    def drain(self) -> None:
        """After a failure: swallow this job's activations until its end arrives."""
        try:
            while self.next_activation() is not None:
                pass
        except (PeerLostError, WireError):
            pass


def _stack(ys: list[np.ndarray]) -> list[np.ndarray]:
    """Rows of equal length travel as one (k, n) frame; otherwise one frame each."""
    import numpy as np

    if len(ys) == 1:
        return [ys[0].reshape(1, -1)]  # a view: no copy for the common single row
    if len({y.size for y in ys}) == 1:
        return [np.stack(ys)]
    return [y.reshape(1, -1) for y in ys]


def _serve(group: Any, route: Mapping[str, Any], run: Any, control: NodeControl,
           timeout: float, base: dict[str, Any]) -> NodeReport:
    loop = _Serving(group, route, control, timeout)
    _up(group, {"kind": "ready", "job": loop.job})
    started = time.monotonic()
    served = 0
    stopped: str | None = None
    error: str | None = None
    error_type = "MeshError"
    while error is None:
        stopped = control.reason()
        if stopped is not None:
            break
        try:
            item = loop.next_activation()
        except WireError as exc:
            # A malformed frame: report it and unwind like a failed stage, so
            # rank 0 hears why and this stage still reports at the job's end.
            error, error_type = str(exc), type(exc).__name__
            _up(group, {"kind": "error", "job": loop.job, "error": error_type,
                        "message": error})
            loop.drain()
            break
        if item is None:
            stopped = control.reason()  # None: the job's end arrived
            break
        seq, batch = item
        # A frame may carry several activations (rows); each is one step, and
        # control is checked between them, so a budget or a stop lands on an
        # exact activation even inside a batch.
        ys: list[np.ndarray] = []
        for row in batch:
            if ys:
                stopped = control.reason()
                if stopped is not None:
                    break
            try:
                ys.append(run(row))
            except MeshError as exc:
                error, error_type = str(exc), type(exc).__name__
                break
            except Exception as exc:  # noqa: BLE001 (a user function or driver broke: report it)
                stage = base.get("stage_id")
                error = (f"stage{f' [{stage}]' if stage else ''} on rank {group.rank} "
                         f"failed: {type(exc).__name__}: {exc}")
                break
            control.count()
        if ys:
            first = seq
            try:
                for part in _stack(ys):
                    loop.forward(first, part)
                    first += part.shape[0]
            except PeerLostError as exc:
                if loop.next == 0:
                    raise  # the coordinator itself is gone: serve_node decides
                # The next stage died (a mesh send to a dead rank fails at
                # once): a failure of this job, not of this node, which
                # reports it, drains and serves the next job.
                if error is None:
                    error = (f"rank {group.rank} could not pass activations on to rank "
                             f"{loop.next}: {exc}")
                    error_type = type(exc).__name__
            served += len(ys)
        if error is not None:
            _up(group, {"kind": "error", "job": loop.job, "error": error_type,
                        "message": error})
            loop.drain()
        elif stopped is not None:
            break
    report = NodeReport(activations=served, stopped="error" if error else stopped,
                        error=error, job=loop.job, seconds=time.monotonic() - started,
                        **base)
    # Pass the end on in every case: after a normal end, an error (we drained
    # to it) or a stop (we are leaving mid-job), the stages after us finish
    # cleanly and report, and the coordinator unwinds the rest.
    loop.forward_end()
    return report


def serve_worker(group: Any, job: Mapping[str, Any] | None = None, *,
                 control: NodeControl | None = None, device: str = "cpu",
                 timeout: float = float("inf")) -> NodeReport:
    """Serve one pipeline stage as a general worker; returns a :class:`NodeReport`.

    ``job`` is the pipeline job message (received from rank 0 when None).
    Activations come from ``stage.prev`` and go to ``stage.next`` until the
    job's ``end``, the stop handle, or the step budget. A stage that fails
    reports an ``error`` to rank 0 instead of hanging the pipeline.
    """
    control = control if control is not None else NodeControl()
    if job is None:
        job = recv_job(group, control=control)
        if job is None:
            return NodeReport(rank=group.rank, stopped=control.reason(), device=device)
    stage, route = _stage_or_refuse(group, job)
    base = {"rank": group.rank, "role": NodeRole.WORKER, "stage_id": stage.stage_id,
            "device": device}
    if stage.op is None:
        # A board-only stage reached a worker: placement was bypassed.
        message = (f"rank {group.rank} is a worker and stage [{stage.stage_id}] runs only "
                   f"on fixed-function hardware implementing it")
        _up(group, {"kind": "error", "job": route["job"], "error": "PlacementError",
                    "message": message})
        raise PlacementError(message)
    return _serve(group, route, stage.run, control, timeout, base)


def check_board(board: Any, advertised: FixedFunction) -> None:
    """Refuse a board whose stage differs from the one the rank advertises."""
    actual = board.descriptor
    if actual != advertised:
        raise PlacementError(
            f"the board implements stage [{actual.stage_id}] ({actual.input_elems} -> "
            f"{actual.output_elems} {actual.dtype}) but this rank advertises stage "
            f"[{advertised.stage_id}] ({advertised.input_elems} -> "
            f"{advertised.output_elems} {advertised.dtype}): fix the board options or "
            f"the advertised descriptor so they agree")


def serve_fixed_function(group: Any, board: Any, job: Mapping[str, Any] | None = None, *,
                         advertised: FixedFunction | None = None,
                         control: NodeControl | None = None,
                         timeout: float = float("inf")) -> NodeReport:
    """Serve the one stage a board implements; returns a :class:`NodeReport`.

    Checks first that the board implements the stage this rank advertises
    (``advertised``, the board's own descriptor when None) and that the job
    is that stage; then checks every activation's length in and the board's
    output length out against the descriptor, so a mismatched feed is
    refused rather than clocked into the fabric (and a wrong-sized result
    never travels on). ``board`` should be a :class:`meshkit.node.board.DeadlineBoard`
    so a hung board is an error, not a hang.
    """
    import numpy as np

    control = control if control is not None else NodeControl()
    ff: FixedFunction = board.descriptor
    if advertised is not None:
        check_board(board, advertised)
    if job is None:
        job = recv_job(group, control=control)
        if job is None:
            return NodeReport(rank=group.rank, role=NodeRole.FIXED_FUNCTION,
                              stage_id=ff.stage_id, stopped=control.reason(), device="fpga")
    stage, route = _stage_or_refuse(group, job)
    base = {"rank": group.rank, "role": NodeRole.FIXED_FUNCTION, "stage_id": ff.stage_id,
            "device": "fpga"}
    try:
        ff.check(stage)
    except PlacementError as exc:
        message = f"rank {group.rank}: {exc}"
        _up(group, {"kind": "error", "job": route["job"], "error": "PlacementError",
                    "message": message})
        raise PlacementError(message) from None

    def run(x: np.ndarray) -> np.ndarray:
        if x.size != ff.input_elems:
            raise PlacementError(
                f"fixed-function stage [{ff.stage_id}] takes {ff.input_elems} elements, got "
                f"an activation of {x.size}: the datapath is synthesized for one shape and "
                f"cannot adapt; fix the stage feeding it")
        # Drivers are promised float32 (a host driver may DMA the raw bytes),
        # whatever dtype a peer put on the wire.
        x = x.reshape(-1) if x.dtype == np.float32 else x.reshape(-1).astype(np.float32)
        y = _activation(board.execute(x),
                        f"fixed-function stage [{ff.stage_id}]: the board", BoardError)
        if y.size != ff.output_elems:
            raise PlacementError(
                f"fixed-function stage [{ff.stage_id}] declares {ff.output_elems} output "
                f"elements, but the board returned {y.size}: the board and its descriptor "
                f"disagree; fix the board driver or its descriptor")
        return y

    return _serve(group, route, run, control, timeout, base)


def serve_node(group: Any, caps: NodeCaps, *, board: Any = None,
               control: NodeControl | None = None, send_handshake: bool = True,
               job_timeout: float = float("inf")) -> list[NodeReport | TrainReport]:
    """A node's whole life after ``connect``: announce caps, serve jobs, leave.

    Sends ``caps`` to rank 0, then serves each job rank 0 sends (see the
    module docstring) until ``shutdown``, the stop handle, the step budget,
    or a lost coordinator. Each job's report is sent to rank 0 and returned
    in the list. ``board`` is required when ``caps`` is a fixed-function
    rank's (and must implement the advertised stage).
    """
    control = control if control is not None else NodeControl()
    if caps.fixed_function is not None:
        if board is None:
            raise ConfigError(
                f"rank {caps.rank} advertises stage [{caps.fixed_function.stage_id}] but no "
                f"board was given to run it")
        check_board(board, caps.fixed_function)
    if send_handshake:
        send_caps(group, caps)
    reports: list[NodeReport | TrainReport] = []
    while not control.stopped:
        try:
            job = recv_job(group, control=control, timeout=job_timeout)
        except PeerLostError as exc:
            if 0 in group.dead:
                log.info("rank %d: the coordinator went away (%s); leaving", group.rank, exc)
                break
            raise
        if job is None:
            break
        kind = job["kind"]
        if kind == "shutdown":
            break
        job_id = job.get("job")
        if kind == "pipeline":
            try:
                if caps.fixed_function is not None:
                    report: NodeReport | TrainReport = serve_fixed_function(
                        group, board, job, control=control)
                else:
                    report = serve_worker(group, job, control=control, device=caps.device)
            except (PlacementError, WireError) as exc:
                # Already reported to rank 0 where it could be; keep serving jobs.
                log.warning("rank %d: job %r refused: %s", group.rank, job_id, exc)
                continue
            except PeerLostError as exc:
                if 0 in group.dead:
                    log.info("rank %d: the coordinator went away during job %r (%s); "
                             "leaving", group.rank, job_id, exc)
                    break
                raise
        elif kind == "train":
            report = _serve_train(group, caps, job, control)
            if report is None:
                continue
        else:
            _up(group, {"kind": "error", "job": job_id, "error": "WireError",
                        "message": f"rank {group.rank} does not know job kind {kind!r}"})
            continue
        reports.append(report)
        leaving = report.stopped in ("stop", "budget")
        try:
            _up(group, {"kind": "left" if leaving else "report", "job": job_id,
                        "report": report.to_json()})
        except PeerLostError:
            break
        if leaving or control.reason() is not None:
            break
    return reports


def _serve_train(group: Any, caps: NodeCaps, job: Mapping[str, Any],
                 control: NodeControl) -> TrainReport | None:
    job_id = job.get("job")
    why = caps.why_not_train()
    if why is not None:
        _up(group, {"kind": "error", "job": job_id, "error": "PlacementError",
                    "message": why})
        return None
    try:
        from meshkit.train import serve_trainer
    except ImportError as exc:
        _up(group, {"kind": "error", "job": job_id, "error": "RefusedError",
                    "message": f"rank {group.rank} cannot train: meshkit.train.worker is not "
                               f"available ({exc})"})
        return None
    try:
        report = serve_trainer(group, job.get("spec"), control)
    except MeshError as exc:
        _up(group, {"kind": "error", "job": job_id, "error": type(exc).__name__,
                    "message": str(exc)})
        return None
    if report.job is None and job_id is not None:
        report = attrs.evolve(report, job=job_id)
    return report
