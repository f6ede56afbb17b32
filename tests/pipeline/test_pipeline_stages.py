"""Stages: their ops are validated, survive their wire form, and return numbers."""

from __future__ import annotations

import numpy as np
import pytest

from meshkit import ConfigError, MeshError, WireError
from meshkit.pipeline import Stage, run_local


def test_stage_specs_are_validated():
    with pytest.raises(ConfigError, match=r"op 'affine' needs weights of shape \(in, out\)"):
        Stage(op="affine")
    with pytest.raises(ConfigError, match=r"bias has shape \(2,\), expected \(3,\)"):
        Stage.affine(np.zeros((4, 3)), np.zeros(2))
    with pytest.raises(ConfigError, match="op must be one of identity, scale"):
        Stage(op="conv")
    with pytest.raises(ConfigError, match="a board stage .* must set stage_id"):
        Stage(op=None)
    with pytest.raises(ConfigError, match="op 'call' needs function = 'module:function'"):
        Stage(op="call", function="nocolon")


def test_a_stage_survives_its_wire_form():
    rng = np.random.default_rng(2)
    stage = Stage.affine(rng.standard_normal((5, 2)), rng.standard_normal(2),
                         activation="tanh", stage_id="fc1")
    again = Stage.from_message(stage.to_message())
    x = rng.standard_normal(5).astype(np.float32)
    np.testing.assert_array_equal(again.run(x), stage.run(x))
    assert again.stage_id == "fc1" and again.activation == "tanh"
    with pytest.raises(WireError, match="scale must be a number"):
        Stage.from_message({"stage": {"op": "scale", "scale": "big"}})
    with pytest.raises(WireError, match="op must be one of"):
        Stage.from_message({"stage": {"op": "rm -rf"}})


def test_run_local_is_the_reference_computation():
    stages = [Stage(op="scale", scale=3.0), Stage(op="relu")]
    (y,) = run_local(stages, [np.array([-1.0, 2.0])])
    assert y.tolist() == [0.0, 6.0] and y.dtype == np.float32


def return_nothing(x: np.ndarray) -> None:
    """A stage function that forgot its return statement."""


def return_text(x: np.ndarray) -> str:
    return "not numbers"


@pytest.mark.parametrize("function, found", [
    (f"{__name__}:return_nothing", "None"),
    (f"{__name__}:return_text", "'not numbers'"),
])
def test_a_call_stage_returning_no_numbers_is_refused_not_turned_into_nan(function, found):
    stage = Stage(op="call", function=function, stage_id="fc")
    with pytest.raises(MeshError) as err:
        stage.run(np.zeros(2, np.float32))
    assert str(err.value).startswith("call stage [fc]")
    assert found in str(err.value)
