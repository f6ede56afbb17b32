"""A transport that authenticates nothing is refused off loopback by its declared traits (issue 34).

The kernel learns it from :class:`meshkit.transport.TransportTraits` on the
transport's options class, never from its name: a third-party transport declaring
the same traits is refused by ``meshkit check`` exactly as ``torchdist`` is, before
anything starts, naming the file and the setting that chose the address.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest

import meshkit
from meshkit.config import load_config
from meshkit.errors import ConfigError
from meshkit.testing import make_plugin_set
from meshkit.train._coordinator.plan import resolve
from meshkit.train._coordinator.preflight import build_components
from meshkit.transport import TransportTraits, transport_traits, trust_refusal


def _host(bind: str) -> str:
    return bind.rpartition(":")[0]


@attrs.frozen
class OpenWireOptions:
    """A transport that authenticates nothing and listens at ``[mesh] bind``."""

    traits: ClassVar[TransportTraits] = TransportTraits(
        authenticates=False,
        rendezvous=lambda options, rank, bind, peers: [(f"[mesh] bind = {bind!r}", _host(bind))])
    port_hint: int = 0


@attrs.frozen
class SealedOptions:
    """One that authenticates its frames: no address is refused."""

    traits: ClassVar[TransportTraits] = TransportTraits(authenticates=True)


def _plugin() -> Any:
    def never(options: Any) -> Any:
        raise AssertionError("the preflight must not build the transport")

    plugin = types.ModuleType("meshkit_openwire_test")

    @meshkit.hookimpl
    def meshkit_transports() -> list[meshkit.Component]:
        return [meshkit.Component("open-wire", never, OpenWireOptions),
                meshkit.Component("sealed", never, SealedOptions)]

    plugin.meshkit_transports = meshkit_transports  # type: ignore[attr-defined]
    return plugin


def _check(tmp_path: Path, transport: str, bind: str, trust: bool = False) -> dict[str, Any]:
    text = f"""
[run]
task = "digits"
out = "{tmp_path / 'out'}"

[mesh]
transport = "{transport}"
workers = 2
bind = "{bind}"
trust_network = {'true' if trust else 'false'}

[strategy]
name = "federated"
rounds = 1
"""
    path = tmp_path / "run.toml"
    path.write_text(text)
    pset = make_plugin_set(_plugin(), entry_points=True)
    return build_components(resolve(load_config(path), pset))


def test_a_third_party_transport_that_authenticates_nothing_is_refused_off_loopback(tmp_path):
    with pytest.raises(ConfigError) as info:
        _check(tmp_path, "open-wire", "192.0.2.7:4000")
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'run.toml'}: [mesh] bind = '192.0.2.7:4000' puts "
                              f"the open-wire rendezvous on '192.0.2.7', not a loopback address")
    assert "TransportTraits.authenticates is false" in message
    assert "set [mesh] trust_network = true only on a network you trust" in message
    assert 'use transport = "tcp"' in message


@pytest.mark.parametrize("transport, bind, trust", [
    ("open-wire", "127.0.0.1:0", False),   # loopback
    ("open-wire", "192.0.2.7:4000", True),  # trusted
    ("sealed", "0.0.0.0:0", False),         # authenticates: any address
])
def test_loopback_trust_or_authentication_passes(tmp_path, transport, bind, trust):
    assert _check(tmp_path, transport, bind, trust)["world"] == 3


def test_every_interface_is_said_as_such():
    why = trust_refusal("open-wire", OpenWireOptions.traits, OpenWireOptions(), rank=0,
                        bind="0.0.0.0:0", peers=(), trust_network=False)
    assert why is not None and "anyone who can reach any of this host's interfaces" in why


def test_a_transport_declaring_no_traits_authenticates_and_junk_traits_are_named():
    assert transport_traits(None).authenticates is True

    class Plain:
        pass

    assert transport_traits(Plain) == TransportTraits()

    class Junk:
        traits = {"authenticates": False}

    with pytest.raises(TypeError, match=r"Junk\.traits is .*declare it as "
                                        r"meshkit\.transport\.TransportTraits"):
        transport_traits(Junk)
    with pytest.raises(TypeError, match="authenticates must be True or False"):
        TransportTraits(authenticates="no")  # type: ignore[arg-type]
