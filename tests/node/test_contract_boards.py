"""The built-in ``loopback`` board passes meshkit's board contract suite."""

from __future__ import annotations

import numpy as np

from meshkit.testing import BoardContract


def sum_in_groups_of_four(x: np.ndarray) -> np.ndarray:
    """A stage that shrinks its activation (12 values in, 3 out)."""
    return x.reshape(-1, 4).sum(axis=1)


class TestLoopbackIdentity(BoardContract):
    component = "loopback"
    options = {"stage_id": "mlp.0", "input_elems": 8, "output_elems": 8}


class TestLoopbackScaleInInt8(BoardContract):
    component = "loopback"
    options = {"stage_id": "mlp.1", "input_elems": 16, "output_elems": 16,
               "function": "scale", "scale": 0.5, "dtype": "int8"}


class TestLoopbackReducingStage(BoardContract):
    component = "loopback"
    options = {"stage_id": "head", "input_elems": 12, "output_elems": 3,
               "function": f"{__name__}:sum_in_groups_of_four"}


class TestLoopbackReducingStageAgainstItsReference(BoardContract):
    component = "loopback"
    options = {"stage_id": "head", "input_elems": 12, "output_elems": 3,
               "function": f"{__name__}:sum_in_groups_of_four"}
    reference = staticmethod(lambda x: x.astype(np.float64).reshape(-1, 4).sum(axis=1))


class TestLoopbackScaleInInt8AgainstItsReference(BoardContract):
    component = "loopback"
    options = {"stage_id": "mlp.1", "input_elems": 16, "output_elems": 16,
               "function": "scale", "scale": 0.5, "dtype": "int8"}
    # The int8 datapath rounds to whole numbers, saturating, in and out.
    reference = staticmethod(lambda x: np.rint(0.5 * np.clip(np.rint(x), -128, 127)))
