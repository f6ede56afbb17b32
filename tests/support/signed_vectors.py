"""Signed rounds' test vectors, computed from the kernel's functions (docs/protocol.md §7.2.2).

Every input is fixed by :func:`draw` (SHA-512 of ``"meshkit/signed/vectors " || label``,
cut to the size): the node key's 32-byte Ed25519 seed, the round seed and an
advert row; Ed25519 signatures are deterministic (RFC 8032), so the file
records the exact bytes a peer must produce.

``python -m tests.support.signed_vectors`` rewrites
``tests/secure_aggregation/vectors/signed.json``; the drift test
(tests/secure_aggregation/test_signed_vectors.py) fails when :func:`compute`
no longer gives the stored file, or when docs/protocol.md no longer shows
its values.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshkit.secure_aggregation import advert_message, confirm_message, sign
from meshkit.wire import NodeKey

PATH = Path(__file__).resolve().parents[1] / "secure_aggregation" / "vectors" / "signed.json"

ROUND = 7
CLIENT = 5
SURVIVORS = (1, 2, 3, 5)
DROPPED = (8,)


def draw(label: str, size: int) -> bytes:
    """The vectors' inputs: SHA-512 of the prefix and ``label``, cut to ``size`` bytes."""
    return hashlib.sha512(b"meshkit/signed/vectors " + label.encode()).digest()[:size]


def node_key() -> NodeKey:
    return NodeKey(Ed25519PrivateKey.from_private_bytes(draw("node key", 32)))


def compute() -> dict[str, Any]:
    key = node_key()
    seed = draw("round seed", 32)
    advert = draw("advert", 64) + draw("advert tail", 32)  # 96 bytes, a secagg+ advert's size
    signed_advert = advert_message(seed, ROUND, CLIENT, advert)
    confirm = confirm_message(seed, ROUND, CLIENT, SURVIVORS, DROPPED)
    return {
        "rule": "draw(label, n) = SHA-512('meshkit/signed/vectors ' || label)[:n]; "
                "Ed25519 (RFC 8032) is deterministic",
        "node_key_seed": draw("node key", 32).hex(),
        "node_public_key": key.public.hex(),
        "round_seed": seed.hex(),
        "round": ROUND,
        "client": CLIENT,
        "advert": advert.hex(),
        "advert_message": signed_advert.hex(),
        "advert_signature": sign(key, signed_advert).hex(),
        "survivors": list(SURVIVORS),
        "dropped": list(DROPPED),
        "confirm_message": confirm.hex(),
        "confirm_signature": sign(key, confirm).hex(),
    }


def main() -> None:
    PATH.write_text(json.dumps(compute(), indent=1) + "\n")


if __name__ == "__main__":
    main()
