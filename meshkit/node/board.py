"""Fixed-function boards: the descriptor, the driver protocol, the deadline every
call gets, and the length checks at the board's edges.

A *board* is hardware that implements one pre-synthesized stage (an FPGA
bitstream) and cannot compile anything. Board drivers are components of kind
``"board"``, offered by plugins through ``meshkit_boards()``; the factory
builds a driver with:

``descriptor``
    a :class:`meshkit.FixedFunction` saying which stage the hardware
    implements and the element counts it consumes and produces;
``execute(x) -> y``
    push one activation (a 1-D float32 array of ``descriptor.input_elems``)
    through the board and return its output (``descriptor.output_elems``
    values; the kernel converts to float32 and checks the length);
``deadline`` (optional)
    seconds one ``execute`` may take before the kernel calls the board hung
    (:data:`DEFAULT_DEADLINE` when absent);
``close()`` (optional)
    release the device.

The kernel never calls ``execute`` directly: :func:`open_board` wraps the
driver in a :class:`DeadlineBoard`, which runs each call on a dedicated
thread and gives up after the deadline, so a wedged PCIe link or a board
that stopped clocking is an error naming the stage, not a node that hangs
forever while the mesh waits on it.

Every check at a board's edges lives here: that a board implements the stage
its rank advertises (:func:`check_board`), that a stage is the one a
descriptor implements (:meth:`FixedFunction.check`), and that each activation
going in and each result coming out has the length the descriptor declares
(:func:`execute_checked`).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Mapping, Protocol, runtime_checkable

import attrs
import numpy as np

from meshkit import plugins as _plugins
from meshkit.errors import BoardError, BoardTimeoutError, MeshError, PlacementError
from meshkit.node._activation import as_activation
from meshkit.options import structure_strict

__all__ = [
    "DEFAULT_DEADLINE",
    "FixedFunction",
    "Board",
    "BoardError",
    "BoardTimeoutError",
    "DeadlineBoard",
    "open_board",
    "check_board",
    "execute_checked",
]

log = logging.getLogger(__name__)

#: Seconds one ``execute`` call may take when the driver names no deadline.
DEFAULT_DEADLINE = 10.0

#: The datapath dtypes a descriptor may name.
_DTYPES = ("float32", "float16", "bfloat16", "int8", "uint8", "int16", "int32")


@attrs.frozen
class FixedFunction:
    """A stage baked into hardware that cannot be reprogrammed at run time.

    An FPGA bitstream implements exactly one datapath and synthesis takes
    minutes, so a board cannot be shipped a graph: it advertises this
    descriptor and the coordinator only ever assigns it the matching stage.
    Activations cross the wire as float32; ``dtype`` is what the datapath was
    synthesized for, and the board's host driver converts.
    """

    stage_id: str = attrs.field(validator=attrs.validators.instance_of(str))
    input_elems: int = attrs.field(validator=[attrs.validators.instance_of(int),
                                              attrs.validators.gt(0)])
    output_elems: int = attrs.field(validator=[attrs.validators.instance_of(int),
                                               attrs.validators.gt(0)])
    dtype: str = attrs.field(default="float32", validator=attrs.validators.in_(_DTYPES))

    @stage_id.validator
    def _stage_id_not_empty(self, attribute: Any, value: str) -> None:
        if not value:
            raise ValueError("FixedFunction.stage_id must not be empty")

    def check(self, stage: Any) -> None:
        """Raise :class:`PlacementError` unless this hardware can run ``stage``.

        ``stage`` is anything with a ``stage_id`` attribute (or a stage id
        string). Checked by the coordinator before shipping, so a mismatch is
        a clear error at placement time, not a hang or a wrong number later.
        """
        stage_id = stage if isinstance(stage, str) or stage is None else getattr(
            stage, "stage_id", None)
        if stage_id is None:
            raise PlacementError(
                f"fixed-function rank implements stage [{self.stage_id}], but the "
                f"stage it was offered carries no stage_id: set stage_id on the "
                f"stage to target pre-synthesized hardware")
        if stage_id != self.stage_id:
            raise PlacementError(
                f"fixed-function rank implements stage [{self.stage_id}], cannot run "
                f"[{stage_id}]: an FPGA datapath is synthesized, not compiled")

    def accepts(self, stage: Any) -> bool:
        """Whether :meth:`check` passes for ``stage``."""
        try:
            self.check(stage)
        except PlacementError:
            return False
        return True

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> FixedFunction:
        return structure_strict(data, cls, where="fixed_function")


@runtime_checkable
class Board(Protocol):
    """What a board driver offers (``deadline`` and ``close`` are optional)."""

    @property
    def descriptor(self) -> FixedFunction: ...

    def execute(self, x: Any) -> Any: ...


_STOP = object()


class DeadlineBoard:
    """A board whose every ``execute`` has a deadline.

    Calls run one at a time on a daemon thread owned by this wrapper (so a
    driver that never returns cannot keep the process alive at exit). When a
    call misses its deadline the board is marked wedged: the call raises
    :class:`BoardTimeoutError` and every later call is refused, because the
    stuck call still owns the device and a second one would race it.
    """

    def __init__(self, driver: Any, deadline: float | None = None) -> None:
        descriptor = getattr(driver, "descriptor", None)
        if not isinstance(descriptor, FixedFunction):
            raise BoardError(
                f"board driver {type(driver).__name__} must expose `descriptor` as a "
                f"meshkit.FixedFunction, found {descriptor!r}")
        if not callable(getattr(driver, "execute", None)):
            raise BoardError(
                f"board driver {type(driver).__name__} has no execute(x) method")
        if deadline is None:
            deadline = getattr(driver, "deadline", None) or DEFAULT_DEADLINE
        try:
            seconds = float(deadline)
        except (TypeError, ValueError):
            seconds = float("nan")
        # The wait below cannot take more than threading.TIMEOUT_MAX (inf or
        # 1e300 would raise OverflowError on the first activation, mid-job).
        if not 0 < seconds <= threading.TIMEOUT_MAX:
            raise BoardError(
                f"board deadline must be positive seconds, at most "
                f"{threading.TIMEOUT_MAX:.0f}, got {deadline!r}")
        deadline = seconds
        self.driver = driver
        self.descriptor: FixedFunction = descriptor
        self.deadline = float(deadline)
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        self._wedged: str | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _run(self) -> None:
        while True:
            x = self._calls.get()
            if x is _STOP:
                return
            try:
                self._results.put((True, self.driver.execute(x)))
            except BaseException as exc:  # handed to the caller, who decides
                self._results.put((False, exc))

    def execute(self, x: Any) -> Any:
        """Run one activation through the board, or raise :class:`BoardError`."""
        stage = self.descriptor.stage_id
        with self._lock:
            if self._closed:
                raise BoardError(f"board for stage [{stage}] is closed")
            if self._wedged is not None:
                raise BoardError(
                    f"board for stage [{stage}] is wedged ({self._wedged}) and refuses "
                    f"further calls: reset the board and restart the node")
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"meshkit-board-{stage}", daemon=True)
                self._thread.start()
            self._calls.put(x)
            try:
                ok, value = self._results.get(timeout=self.deadline)
            except queue.Empty:
                self._wedged = f"a call missed its {self.deadline:g} s deadline"
                raise BoardTimeoutError(
                    f"board for stage [{stage}] did not answer within its deadline of "
                    f"{self.deadline:g} s: the device is hung or too slow; check the "
                    f"board and its link, or raise the board's `deadline` option"
                ) from None
        if not ok:
            if isinstance(value, MeshError):
                raise value
            raise BoardError(
                f"board for stage [{stage}] failed: {type(value).__name__}: {value}"
            ) from value
        return value

    def close(self) -> None:
        """Stop the call thread and close the driver (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._thread is not None and self._wedged is None:
                self._calls.put(_STOP)
        closer = getattr(self.driver, "close", None)
        if callable(closer):
            try:
                closer()
            except Exception:  # closing is best effort; the node is leaving anyway
                log.warning("board for stage [%s]: close() failed",
                            self.descriptor.stage_id, exc_info=True)

    def __enter__(self) -> DeadlineBoard:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_board(name: str, options: Mapping[str, Any] | Any = None, *,
               plugins: Any = None, deadline: float | None = None) -> DeadlineBoard:
    """Build board component ``name`` with ``options`` and wrap it in a deadline.

    ``plugins`` is a :class:`meshkit.plugins.PluginSet` (the default set when
    None). ``deadline`` overrides the driver's own.
    """
    if plugins is None:
        plugins = _plugins.default()
    driver = plugins.create("board", name, options)
    return DeadlineBoard(driver, deadline)


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


def execute_checked(board: Board, x: np.ndarray) -> np.ndarray:
    """Push one activation through ``board``, checking both lengths against its descriptor.

    An activation of another length is refused rather than clocked into the
    fabric, and a result of another length never travels on: either is a
    :class:`PlacementError` naming both sizes. The driver is always handed
    float32 (a host driver may DMA the raw bytes), whatever dtype a peer put
    on the wire; what it returns must be numbers (:class:`BoardError`).
    """
    ff = board.descriptor
    if x.size != ff.input_elems:
        raise PlacementError(
            f"fixed-function stage [{ff.stage_id}] takes {ff.input_elems} elements, got "
            f"an activation of {x.size}: the datapath is synthesized for one shape and "
            f"cannot adapt; fix the stage feeding it")
    x = x.reshape(-1) if x.dtype == np.float32 else x.reshape(-1).astype(np.float32)
    y = as_activation(board.execute(x), f"fixed-function stage [{ff.stage_id}]: the board",
                      BoardError)
    if y.size != ff.output_elems:
        raise PlacementError(
            f"fixed-function stage [{ff.stage_id}] declares {ff.output_elems} output "
            f"elements, but the board returned {y.size}: the board and its descriptor "
            f"disagree; fix the board driver or its descriptor")
    return y
