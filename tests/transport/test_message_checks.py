"""``check_state``: what every message sent must be before a transport carries it."""

from __future__ import annotations

from collections import UserDict

import numpy as np
import pytest

from meshkit import WireError
from meshkit.transport._message import META_KEY, check_state


class _Name(str):
    pass


@pytest.mark.parametrize("payload", [
    {}, {"w": np.zeros(2), "op": "fit", "seq": 1}, {_Name("w"): 1.0}, UserDict({"a": 1}),
])
def test_a_mapping_of_str_keys_is_taken_as_it_is(payload):
    assert check_state(payload) is payload


@pytest.mark.parametrize(("payload", "message"), [
    ([("a", 1)], "payload must be a mapping of name -> numpy array or JSON value, got list"),
    ({"a": 1, 3: 2}, "payload: every key must be a str, got 3"),
    ({"a": 1, META_KEY: 2}, f"payload: key '{META_KEY}' is reserved for the transport"),
    ({"a": 1, _Name(META_KEY): 2}, f"payload: key '{META_KEY}' is reserved for the transport"),
    (UserDict({b"a": 1}), "payload: every key must be a str, got b'a'"),
    # A key of another type is named even when the reserved key is there too.
    ({META_KEY: 1, (1,): 2}, "payload: every key must be a str, got \\(1,\\)"),
])
def test_a_payload_that_is_not_a_state_is_refused_saying_why(payload, message):
    with pytest.raises(WireError, match=message):
        check_state(payload)
