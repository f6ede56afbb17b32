"""The built-in transports pass meshkit's transport contract suite."""

from __future__ import annotations

from meshkit.testing import TransportContract


class TestInproc(TransportContract):
    component = "inproc"


class TestTcp(TransportContract):
    component = "tcp"
