"""NodeConfig refuses timeouts and secrets that would fail later, deeper down."""

from __future__ import annotations

import math

import pytest

from meshkit.errors import ConfigError
from meshkit.node.config import NodeConfig

SECRET = b"review-r1-secret-0123456789"


def test_an_infinite_or_nan_node_timeout_is_a_config_error_not_an_overflow() -> None:
    # `meshkit node --timeout inf` reached the transport, where socket and
    # lock timeouts raised OverflowError (and NaN disabled every timeout).
    for bad in (math.inf, math.nan, 9.3e9, 1e300):
        with pytest.raises(ConfigError, match=r"timeout must be a number of seconds > 0 and "
                                              r"at most 1e\+09"):
            NodeConfig(rank=0, world=2, topology="star", bind="127.0.0.1:0", secret=SECRET,
                       timeout=bad)


def test_a_str_secret_is_refused_when_the_node_is_configured() -> None:
    # A coordinator given a str secret started fine and then refused every
    # worker at the handshake (the workers only saw the connection close);
    # the inproc transport raised a bare TypeError comparing it.
    with pytest.raises(ConfigError, match="secret must be bytes"):
        NodeConfig(rank=0, world=2, topology="star", bind="127.0.0.1:0",
                   secret=SECRET.decode())
