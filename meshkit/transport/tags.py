"""Every reserved tag lives here.

A tag is an int in ``0 .. TAG_MAX`` that matches a message to the ``recv``
waiting for it. Tags at or above :data:`RESERVED_TAGS` belong to the kernel;
user code (a task, a third-party strategy) picks tags below it. Every tag the
kernel itself sends is defined in this module, whoever speaks it, so a new
protocol message cannot take a value an old one already has:

================  ==============  ============================================
tag               value           spoken by
================  ==============  ============================================
``TAG_WELCOME``   ``0xFFFF0000``  a transport's handshake (accepting side)
``TAG_REDUCE``    ``0xFFFF0001``  retired (the star reduce service, removed)
``TAG_SCATTER``   ``0xFFFF0002``  retired (the star reduce service, removed)
``TAG_BYE``       ``0xFFFF0003``  a transport, on ``close()``
``TAG_RING``      ``0xFFFF0004``  the mesh all-reduce (rank to rank, a ring)
``TAG_RING_SUM``  ``0xFFFF0005``  the mesh exact sum (integer codes; a ring,
                                  numbered by the caller's step)
``TAG_CAPS``      ``0xFFFF0010``  the node driver's capability handshake
``TAG_CONTROL``   ``0xFFFF0011``  the node driver: rank 0 -> worker jobs
                                  (``TAG_JOB`` is the same tag)
``TAG_UP``        ``0xFFFF0012``  the node driver: worker -> rank 0 replies
``TAG_ACT``       ``0xFFFF0013``  pipeline activations, stage to stage
``TAG_ABORT``     ``0xFFFF0014``  the node driver: abandon a pipeline job
``TAG_RELAY``     ``0xFFFF0020``  rank 0 -> a host relay: a request for the
                                  relay itself (fold its ranks' work, fan out)
``TAG_RELAY_CTL`` ``0xFFFF0021``  a host relay <-> rank 0: who it carries,
                                  who joined it, who died (transport only)
``TAG_REQUEST``   ``0x6D6B0101``  the trainer protocol (rank 0 -> worker)
``TAG_REPLY``     ``0x6D6B0102``  the trainer protocol (worker -> rank 0)
================  ==============  ============================================

The transport's own (:data:`SERVICE_TAGS`) are refused by ``send``:
a message under them would spoof the handshake, a leaving rank, a host
relay's membership news or the mesh all-reduce's ring. A retired tag
(:data:`RETIRED_TAGS`: the star reduce service's, removed in issue 21) keeps
its value, so no new message ever takes it, and is refused too: a frame an
older peer sends on one is dropped, never queued. The
node driver's tags are reserved but sent with the ordinary ``send``; their
messages are documented in :mod:`meshkit.node`.

The trainer's two tags are *not* reserved, on purpose: the trainer protocol
(:mod:`meshkit.train.worker`) is built on the public ``send``/``recv`` like
any third-party strategy could be, and needs nothing a user tag lacks. Its
values spell ``"mk"`` in the high half, far from the small numbers user code
picks, and they stay where they are because a new value would be a new wire
protocol. They are listed here so every tag the kernel sends is in one place.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "RESERVED_TAGS",
    "TAG_MAX",
    "TAG_WELCOME",
    "TAG_REDUCE",
    "TAG_SCATTER",
    "RETIRED_TAGS",
    "TAG_BYE",
    "TAG_RING",
    "TAG_RING_SUM",
    "TAG_CAPS",
    "TAG_CONTROL",
    "TAG_JOB",
    "TAG_UP",
    "TAG_ACT",
    "TAG_ABORT",
    "TAG_RELAY",
    "TAG_RELAY_CTL",
    "TAG_REQUEST",
    "TAG_REPLY",
    "SERVICE_TAGS",
    "check_tag",
]

#: Tags at or above this value belong to the kernel (the same value as
#: :data:`meshkit.wire.RESERVED_TAG_BASE`, which the codec documents).
RESERVED_TAGS = 0xFFFF0000
#: The largest tag (tags travel as unsigned 32-bit ints).
TAG_MAX = 0xFFFFFFFF

# -- the transport: handshake, leaving ---------------------------------------------

#: The coordinator's answer to a worker's handshake (welcome or refusal).
TAG_WELCOME = 0xFFFF0000
#: Retired: a worker's contribution to the star reduce service (removed, issue 21).
TAG_REDUCE = 0xFFFF0001
#: Retired: the star reduce service's scatter (removed, issue 21).
TAG_SCATTER = 0xFFFF0002
#: A rank leaving the mesh on purpose (close()), so peers log it quietly.
TAG_BYE = 0xFFFF0003
#: A chunk (or an abort) of the mesh all-reduce, to the next rank of the ring
#: (``Group.mesh_all_reduce``; ``_collective.py``).
TAG_RING = 0xFFFF0004
#: A chunk (or an abort) of the mesh's exact sum, to the next rank of the ring
#: (``Group.mesh_sum``: DiLoCo's integer outer gradients; ``_collective.py``).
TAG_RING_SUM = 0xFFFF0005

# -- the node driver (meshkit.node documents each message) ----------------------

#: Capability handshake: a worker announces its ``NodeCaps`` to rank 0.
TAG_CAPS = 0xFFFF0010
#: Kernel control messages between the coordinator loop and node drivers.
TAG_CONTROL = 0xFFFF0011
#: rank 0 -> worker: the next job (pipeline stage, training spec, shutdown);
#: a control message, so it travels on :data:`TAG_CONTROL`.
TAG_JOB = TAG_CONTROL
#: worker -> rank 0: ready / result / error / report / left.
TAG_UP = 0xFFFF0012
#: Activations moving along a pipeline.
TAG_ACT = 0xFFFF0013
#: rank 0 -> worker: abandon a pipeline job (a stage before you died).
TAG_ABORT = 0xFFFF0014

# -- host relays (meshkit relay; docs/scaling-out.md) ---------------------------

#: rank 0 -> the host relay carrying the addressed rank: a request for the relay
#: itself (fold its ranks' contributions, fan one request out to its ranks). The
#: relay answers on :data:`TAG_REPLY`, naming itself.
TAG_RELAY = 0xFFFF0020
#: A host relay <-> rank 0, on the relay's own connection only: the ranks it
#: carries, a rank that joined or died behind it, a death rank 0 declared.
TAG_RELAY_CTL = 0xFFFF0021

# -- the trainer protocol (user range; see the module docstring) ----------------

#: rank 0 -> worker: one trainer request (fit, grads, apply, ...).
TAG_REQUEST = 0x6D6B_0101
#: worker -> rank 0: the answer to a trainer request.
TAG_REPLY = 0x6D6B_0102

#: Tags whose protocol is gone; kept so no new message takes their values.
RETIRED_TAGS = frozenset({TAG_REDUCE, TAG_SCATTER})

#: Tags user code may not send: they would spoof the handshake, a leaving
#: rank, a host relay's membership news or the ring all-reduce (or speak a
#: retired protocol).
SERVICE_TAGS = frozenset({TAG_WELCOME, TAG_BYE, TAG_RELAY_CTL, TAG_RING, TAG_RING_SUM,
                          *RETIRED_TAGS})


def check_tag(tag: Any, *, service: bool = False) -> int:
    """Validate a tag; the transport's own tags only when ``service``."""
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= TAG_MAX:
        raise ValueError(f"a tag must be an int in 0..0x{TAG_MAX:X}, got {tag!r}")
    if tag in SERVICE_TAGS and not service:
        raise ValueError(
            f"tag 0x{tag:X} is the transport's own (its handshake, a goodbye, a host "
            f"relay's news, the ring all-reduce, or a retired protocol's); use a tag "
            f"below 0x{RESERVED_TAGS:X} for your own messages")
    return tag
