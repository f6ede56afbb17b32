"""The trainer protocol's messages: nested states flatten for the wire and come back whole."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshkit.train import decode, encode


@pytest.mark.parametrize("state", [{}, {"#": np.arange(3.0), "w": np.ones(2)}, {"a/b": 1.0}])
def test_trainer_messages_carry_any_state_keys_and_empty_states(state):
    message = {"op": "fit", "state": state, "gradients": {}, "round": 2}
    back = decode(encode(message))
    assert back["op"] == "fit" and back["round"] == 2 and back["gradients"] == {}
    assert back["state"].keys() == state.keys()
    for key, value in state.items():
        np.testing.assert_array_equal(back["state"][key], value)


@pytest.mark.parametrize("frame, why", [
    ({"seq": 1, "state": 5, "state/w": 1}, "'state/w' without its count '#state'"),
    ({"seq": 1, "#state": 1, "state": 5}, "'#state' beside a plain 'state'"),
    ({"seq": 1, "#state": 2, "state/w": 1}, "'#state' says 2 entries, the frame has 1"),
    ({"seq": 1, "#gradients": "x"}, "'#gradients' says 'x' entries"),
])
def test_a_frame_that_is_no_encoding_is_a_protocol_error(frame, why):
    from meshkit import ProtocolError
    from meshkit.train import decode

    with pytest.raises(ProtocolError) as caught:
        decode(frame)
    assert why in str(caught.value)


_KEYS = st.text(alphabet="#/ab", min_size=1, max_size=4)


@given(st.dictionaries(st.sampled_from(["op", "seq", "#x", "a/b", "/", "state", "local"]),
                       st.integers(), max_size=4),
       st.dictionaries(st.sampled_from(["state", "local", "partial"]),
                       st.dictionaries(_KEYS, st.integers(), max_size=3), max_size=2))
@settings(max_examples=200, deadline=None, derandomize=True)
def test_any_message_comes_back_whole_and_in_order(plain, nested):
    message = {**{k: v for k, v in plain.items() if k not in nested}, **nested}
    back = decode(encode(message))
    assert back == message
    # The nested states first, then the plain fields in the order they were sent.
    assert list(back) == [k for k in message if k in nested] + [
        k for k in message if k not in nested]
    for head, state in nested.items():
        assert list(back[head]) == list(state)
