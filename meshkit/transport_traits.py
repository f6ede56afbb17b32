"""What a transport declares: :class:`TransportTraits`, which the kernel decides by, never a name.

Rule: a transport whose links authenticate nothing (``authenticates=False``:
anyone who reaches its rendezvous can join the group, read every message or
inject one -- torch.distributed's) may meet only on a loopback address unless
``[mesh] trust_network = true`` says the network is trusted. The transport
declares *where* a rank meets (``rendezvous``: each host with the setting
that chose it), because only it knows; the rule itself is here, once:
:func:`trust_refusal`. ``meshkit check`` and ``meshkit run`` ask it in the
preflight, before anything starts (``meshkit/train/_coordinator/preflight.py``),
and the transport asks it again when a node connects (``meshkit node``,
torchrun), so every entry point says the same sentence.

The traits live on the transport's *options class* (a ``ClassVar``), as
``retired_keys`` do: the preflight reads them without building the transport,
whose factory may import a heavy library (torch) or refuse a mode that only
another launcher runs.

It is its own top-level module, below :mod:`meshkit.transport`, so a transport
plugin declares its traits without importing the transport package (which
loads numpy for the mesh all-reduce): ``meshkit plugins`` and ``--help`` list
every plugin without numpy. :mod:`meshkit.transport` re-exports its names.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any, Callable, Sequence

import attrs

__all__ = ["TransportTraits", "transport_traits", "trust_refusal", "is_loopback"]

#: ``rendezvous(options, rank, bind, peers)`` -> ``[(setting, host), ...]``.
Rendezvous = Callable[[Any, int, str, Sequence[str]], Sequence[tuple[str, str]]]


@attrs.frozen(kw_only=True)
class TransportTraits:
    """The declared properties of a transport (frozen; on its options class as ``traits``).

    * ``authenticates``: every frame on its links is authenticated (``tcp``:
      a keyed MAC under the run's secret). False makes :func:`trust_refusal`
      apply.
    * ``rendezvous``: where a rank of this transport meets or listens, given
      its options, its rank, its bind address and its peers: a list of
      ``(setting, host)``, the setting being what a user changes (``"[mesh]
      bind"``, ``"[transport] init_method"``, ``"MASTER_ADDR"``). None (or an
      empty list): nowhere the kernel can check before connecting.
    """

    authenticates: bool = True
    rendezvous: Rendezvous | None = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.authenticates, bool):
            raise TypeError(f"TransportTraits.authenticates must be True or False, got "
                            f"{self.authenticates!r}")
        if self.rendezvous is not None and not callable(self.rendezvous):
            raise TypeError(f"TransportTraits.rendezvous must be a function (options, rank, "
                            f"bind, peers) -> [(setting, host)], got {self.rendezvous!r}")


#: What a transport that declares no ``traits`` is taken to be: one that authenticates
#: its frames (as every transport before this record did, or was refused).
UNDECLARED = TransportTraits()


def transport_traits(options_class: Any) -> TransportTraits:
    """The ``traits`` a transport's options class declares, or :data:`UNDECLARED`."""
    if options_class is None:
        return UNDECLARED
    traits = getattr(options_class, "traits", UNDECLARED)
    if not isinstance(traits, TransportTraits):
        raise TypeError(f"{getattr(options_class, '__name__', options_class)}.traits is "
                        f"{traits!r}; declare it as meshkit.transport.TransportTraits("
                        f"authenticates=..., rendezvous=...)")
    return traits


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address."""
    name = host.strip("[]")
    if name in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback
                               for i in infos)


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def trust_refusal(name: str, traits: TransportTraits, options: Any, *, rank: int, bind: str,
                  peers: Sequence[str], trust_network: bool) -> str | None:
    """Why transport ``name`` may not meet where it would (the module's rule), or None.

    The sentence names the setting that chose the address, what anyone on the
    network could then do, and what to set instead.
    """
    if traits.authenticates or trust_network or traits.rendezvous is None:
        return None
    for setting, host in traits.rendezvous(options, rank, bind, peers):
        if host and not is_loopback(host):
            reach = "any of this host's interfaces" if _unspecified(host) else host
            return (f"{setting} puts the {name} rendezvous on {host!r}, not a loopback "
                    f"address, and transport {name!r} authenticates nothing (its "
                    f"TransportTraits.authenticates is false): anyone who can reach {reach} "
                    f"can join the group, read every message or inject one. Use a loopback "
                    f"address (127.0.0.1), set [mesh] trust_network = true only on a network "
                    f"you trust (a cluster's private fabric), or use transport = \"tcp\", "
                    f"which authenticates and encrypts every frame")
    return None
