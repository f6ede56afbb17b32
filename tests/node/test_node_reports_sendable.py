"""What a node's error says over the wire: a meshkit error as written, a library's without its data."""

from __future__ import annotations

from meshkit import ConfigError
from meshkit.node import sendable
from meshkit.node._reports import MAX_ERROR_CHARS


def test_a_meshkit_error_goes_as_written():
    assert sendable(ConfigError("[task] x = 'a': row 3")) == "[task] x = 'a': row 3"


def test_a_library_error_loses_the_literals_it_quotes():
    exc = ValueError("could not convert string 'root:x:0:0' to float64 at row 0, column 1.")
    assert sendable(exc) == "could not convert string '…' to float64 at row 0, column 1."
    assert sendable(KeyError("no key 'secret' here")) == "no key '…' here"
    assert sendable(ValueError("the user's fit is broken")) == "the user's fit is broken"


def test_a_long_message_is_cut():
    text = sendable(RuntimeError("x" * (MAX_ERROR_CHARS * 3)))
    assert len(text) < MAX_ERROR_CHARS + 10 and text.endswith("[…]")
