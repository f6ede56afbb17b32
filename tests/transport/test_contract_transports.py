"""The built-in transports pass meshkit's transport contract suite."""

from __future__ import annotations

from meshkit.testing import TransportContract


class TestInproc(TransportContract):
    component = "inproc"


class TestInprocBf16Wire(TransportContract):
    # bf16 applies to model frames of all_reduce only; send/recv stay exact.
    component = "inproc"
    options = {"bf16_wire": True}
    reduce_rtol = 1e-2


class TestTcp(TransportContract):
    component = "tcp"


class TestTcpBf16Wire(TransportContract):
    component = "tcp"
    options = {"bf16_wire": True}
    reduce_rtol = 1e-2
