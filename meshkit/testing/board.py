"""The board (fixed-function driver) contract suite.

Subclass :class:`BoardContract` and point it at your driver::

    class TestInt8Board(BoardContract):
        component = "int8"
        options = {"stage_id": "mlp.0", "input_elems": 16, "output_elems": 4,
                   "scale": 0.05}

What it checks: the driver advertises a :class:`meshkit.FixedFunction`
descriptor and honours it (``execute`` takes exactly ``input_elems`` values
and returns exactly ``output_elems`` float32 values), any other input size is
refused with a :class:`meshkit.MeshError` that says what was expected and
what was found, ``execute`` is deterministic, leaves its input alone and
returns within ``deadline`` seconds, so a wedged board cannot hang a node.
Each output is the caller's own: it shares no memory with the input, and a
later call does not overwrite it (a driver that hands back one DMA buffer
for every call corrupts an activation a node still holds).

Give the stage's function as ``reference(x) -> y`` (numpy, float64 is
fine) and the suite compares ``execute`` with it on several activations,
within ``rtol``/``atol`` (set them for a quantized datapath). Without it,
only the shapes and the properties above are checked: a board computing the
wrong function (weights transposed on a square stage, a missing bias, a
wrong scale) passes. ::

    class TestDenseBoard(BoardContract):
        component = "dense"
        options = {"stage_id": "fc", "input_elems": 8, "output_elems": 8}
        reference = staticmethod(lambda x: W @ x + b)
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import numpy as np
import pytest

from meshkit.errors import MeshError
from meshkit.node import FixedFunction
from meshkit.testing.support import Call, ContractBase

__all__ = ["BoardContract"]


class BoardContract(ContractBase):
    """Conformance tests every meshkit board driver must pass."""

    kind: ClassVar[str] = "board"

    #: Seconds one ``execute`` may take before the suite calls the board hung,
    #: when the driver declares no ``deadline`` of its own. A bound against a
    #: wedged driver, not a performance requirement.
    deadline: ClassVar[float] = 30.0
    #: The stage's function, ``reference(x) -> y`` on the float32 activation
    #: (computed in any precision); None: the values are not checked.
    reference: ClassVar[Callable[[np.ndarray], np.ndarray] | None] = None
    #: How close ``execute`` must come to ``reference`` (float32 by default;
    #: widen for a quantized datapath).
    rtol: ClassVar[float] = 1e-5
    atol: ClassVar[float] = 1e-6

    def activation(self, board: Any, elems: int | None = None, seed: int = 0) -> np.ndarray:
        """A float32 activation of ``elems`` values (default: the descriptor's input size)."""
        n = board.descriptor.input_elems if elems is None else elems
        return np.random.default_rng(seed).uniform(-1.0, 1.0, n).astype(np.float32)

    def execute(self, board: Any, x: np.ndarray) -> Any:
        """Run ``board.execute(x)`` on a thread; fail if it outlives ``deadline``."""
        deadline = getattr(board, "deadline", None) or self.deadline
        return Call(lambda: board.execute(x), "execute()", why="a board driver must time out "
                    "and raise rather than block its node").result(deadline)

    def test_the_descriptor_is_a_fixed_function(self) -> None:
        board = self.make()
        assert isinstance(board.descriptor, FixedFunction), (
            f"descriptor must be a meshkit.FixedFunction, got {board.descriptor!r}")

    def test_a_declared_deadline_is_positive_seconds(self) -> None:
        deadline = getattr(self.make(), "deadline", None)
        if deadline is None:
            pytest.skip("the driver declares no deadline (the kernel's default applies)")
        assert isinstance(deadline, (int, float)) and not isinstance(deadline, bool) \
            and deadline > 0, f"deadline must be positive seconds, got {deadline!r}"

    def test_execute_honours_the_descriptor(self) -> None:
        board = self.make()
        d = board.descriptor
        y = self.execute(board, self.activation(board))
        assert isinstance(y, np.ndarray), f"execute() must return a numpy array, got {y!r}"
        assert y.ndim == 1 and y.size == d.output_elems, (
            f"descriptor says {d.output_elems} output values; execute() returned shape "
            f"{y.shape}")
        assert y.dtype == np.float32, (
            f"activations cross the wire as float32; execute() returned {y.dtype} "
            f"(convert from the datapath's {d.dtype} in the driver)")

    @pytest.mark.parametrize("delta", [-1, 1, "empty", "double"])
    def test_a_wrong_input_size_is_refused(self, delta: Any) -> None:
        board = self.make()
        n = board.descriptor.input_elems
        elems = {"empty": 0, "double": 2 * n}.get(delta, n + delta if isinstance(delta, int)
                                                    else n)
        if elems == n:
            pytest.skip("same size as the descriptor")
        x = self.activation(board, elems)
        try:
            y = self.execute(board, x)
        except MeshError as exc:
            assert str(n) in str(exc) and str(elems) in str(exc), (
                f"the error should say what was expected ({n} values) and what was "
                f"found ({elems}): {exc}")
            return
        except Exception as exc:
            pytest.fail(f"an activation of {elems} values (descriptor: {n}) should raise a "
                        f"meshkit.MeshError, got {type(exc).__name__}: {exc}", pytrace=False)
        pytest.fail(f"the board accepted an activation of {elems} values although its "
                    f"descriptor says {n} (returned {getattr(y, 'shape', y)}); a datapath "
                    f"synthesized for one size silently reads garbage on another",
                    pytrace=False)

    def test_execute_is_deterministic(self) -> None:
        board = self.make()
        x = self.activation(board, seed=1)
        first = self.execute(board, x.copy())
        second = self.execute(board, x.copy())
        assert np.array_equal(first, second), "the same activation gave two different outputs"

    def test_execute_does_not_modify_its_input(self) -> None:
        board = self.make()
        x = self.activation(board, seed=2)
        before = x.copy()
        self.execute(board, x)
        assert np.array_equal(x, before), "execute() modified the activation it was given"

    def test_a_fresh_driver_gives_the_same_output(self) -> None:
        # Two nodes driving two copies of the same board must agree.
        x = self.activation(self.make(), seed=3)
        a = self.execute(self.make(), x.copy())
        b = self.execute(self.make(), x.copy())
        assert np.array_equal(a, b), "two drivers built from the same options disagree"

    def test_execute_computes_the_declared_reference(self) -> None:
        reference = type(self).reference
        if reference is None:
            pytest.skip("no `reference` declared (the stage's function)")
        board = self.make()
        for seed in range(4):
            x = self.activation(board, seed=10 + seed)
            expected = np.asarray(reference(x.copy()), dtype=np.float64).reshape(-1)
            got = np.asarray(self.execute(board, x), dtype=np.float64)
            np.testing.assert_allclose(
                got, expected, rtol=self.rtol, atol=self.atol,
                err_msg=f"activation {seed}: execute() differs from the declared reference "
                        f"(transposed weights? a missing bias or scale?)")

    def test_each_output_is_the_callers_own(self) -> None:
        board = self.make()
        x1 = self.activation(board, seed=4)
        y1 = self.execute(board, x1)
        kept = np.array(y1, copy=True)
        assert not np.shares_memory(y1, x1), (
            "execute() returned a view of its input: the caller may reuse that buffer for "
            "the next activation")
        self.execute(board, self.activation(board, seed=5))
        assert np.array_equal(y1, kept), (
            "a second execute() overwrote the output of the first: the driver reuses one "
            "output buffer across calls; return a fresh array (copy out of the DMA buffer)")
