"""The trainer protocol's messages: nested states flatten for the wire and come back whole."""

from __future__ import annotations

import numpy as np
import pytest

from meshkit.train import decode, encode


@pytest.mark.parametrize("state", [{}, {"#": np.arange(3.0), "w": np.ones(2)}, {"a/b": 1.0}])
def test_trainer_messages_carry_any_state_keys_and_empty_states(state):
    message = {"op": "fit", "state": state, "gradients": {}, "round": 2}
    back = decode(encode(message))
    assert back["op"] == "fit" and back["round"] == 2 and back["gradients"] == {}
    assert back["state"].keys() == state.keys()
    for key, value in state.items():
        np.testing.assert_array_equal(back["state"][key], value)
