"""Channel.recv(place=...): an expected body lands straight in the receiver's buffer (``meshkit.wire.Placer``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from meshkit import wire
from meshkit.errors import AuthenticationError
from meshkit.testing.support import Call

from tests.support.channels import channel_pair, record, send_raw
class OnePlace:
    """Expects one body: ``payload`` with its last entry's data going to ``target``."""

    def __init__(self, payload: dict[str, Any], target: np.ndarray) -> None:
        encoded = wire.encode_state(payload)
        self.head = b"".join(bytes(piece) for piece in encoded.buffers[:-1])
        self.nbytes = encoded.nbytes
        self.target = target
        self.payload = payload
        self.heads: list[bytes] = []

    def head_size(self, tag: int, flags: int, nbytes: int) -> int:
        return len(self.head) if nbytes == self.nbytes and not flags else 0

    def place(self, head: bytes) -> Any:
        self.heads.append(head)
        return (self.target, self.payload) if head == self.head else None


def expected(target: np.ndarray, k: int = 3) -> dict[str, Any]:
    return {"r": 1, "k": k, "x": target}


@pytest.mark.parametrize("encrypt", [False, True], ids=["auth", "encrypted"])
def test_an_expected_body_lands_in_place_and_any_other_arrives_as_usual(encrypt: bool) -> None:
    a, b = channel_pair(encrypt=encrypt)
    try:
        sent = np.arange(70_001, dtype=np.float32)  # an odd size, bigger than a MAC step
        target = np.zeros_like(sent)
        placer = OnePlace(expected(target), target)
        reading = Call(lambda: b.recv(place=placer))
        a.send(1, 7, {"r": 1, "k": 3, "x": sent})
        frame = reading.result()
        assert frame.placed and frame.body is None
        assert frame.state["x"] is target and frame.state["k"] == 3
        np.testing.assert_array_equal(target, sent)
        # Another segment index: the same length, another head: received as usual.
        other = Call(lambda: b.recv(place=placer))
        a.send(1, 7, {"r": 1, "k": 4, "x": sent + 1})
        frame = other.result()
        assert not frame.placed and frame.state["k"] == 4
        np.testing.assert_array_equal(frame.state["x"], sent + 1)
        np.testing.assert_array_equal(target, sent)  # nothing landed
        # A wrong length is never offered to the placer.
        before = len(placer.heads)
        short = Call(lambda: b.recv(place=placer))
        a.send(1, 7, {"r": 1, "k": 3, "x": sent[:-1]})
        assert short.result().state["x"].shape == (70_000,)
        assert len(placer.heads) == before
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("encrypt", [False, True], ids=["auth", "encrypted"])
def test_a_tampered_body_that_landed_fails_authentication(encrypt: bool) -> None:
    a, b = channel_pair(encrypt=encrypt)
    try:
        target = np.zeros(70_001, np.float32)
        placer = OnePlace(expected(target), target)
        (data,) = record(a, (1, 7, {"r": 1, "k": 3, "x": np.ones(70_001, np.float32)}))
        forged = bytearray(data)
        forged[-1000] ^= 1  # a byte of the segment's data, past the head
        reading = Call(lambda: b.recv(place=placer))
        send_raw(a, bytes(forged))
        with pytest.raises(AuthenticationError, match="failed authentication"):
            reading.result()
        assert placer.heads == [placer.head]  # it landed, and the frame was refused
        assert b.closed
    finally:
        a.close()
        b.close()
