"""Signed rounds' test vectors (docs/protocol.md §7.2.2) against the kernel's code and the page.

The drift test recomputes the file from :mod:`meshkit.secure_aggregation`'s
functions and fails on any change; the page test fails when the protocol
page stops showing a stored value. A meant change is a protocol change:
regenerate (``python -m tests.support.signed_vectors``) and update
docs/protocol.md in the same commit.
"""

from __future__ import annotations

import json
import re
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from meshkit.secure_aggregation import advert_message, confirm_message, verify
from tests.support import protocol_doc, signed_vectors

STORED: dict[str, Any] = json.loads(signed_vectors.PATH.read_text())


def test_the_stored_vectors_are_what_the_code_computes():
    computed = signed_vectors.compute()
    moved = sorted(k for k in set(STORED) | set(computed) if STORED.get(k) != computed.get(k))
    assert moved == []


def test_the_signatures_verify_and_only_over_their_own_message():
    public = bytes.fromhex(STORED["node_public_key"])
    advert = bytes.fromhex(STORED["advert_message"])
    confirm = bytes.fromhex(STORED["confirm_message"])
    advert_sig = bytes.fromhex(STORED["advert_signature"])
    confirm_sig = bytes.fromhex(STORED["confirm_signature"])
    Ed25519PublicKey.from_public_bytes(public).verify(advert_sig, advert)  # raises if not
    assert verify(public, confirm_sig, confirm)
    assert not verify(public, advert_sig, confirm) and not verify(public, confirm_sig, advert)
    # The layouts, read back: the label, the seed, the round and client, the row or the sets.
    seed = bytes.fromhex(STORED["round_seed"])
    assert advert == advert_message(seed, STORED["round"], STORED["client"],
                                    bytes.fromhex(STORED["advert"]))
    assert advert.startswith(b"meshkit/secagg/1 signed advert " + seed)
    assert len(advert) == 31 + 32 + 8 + 8 + 4 + 96
    assert confirm == confirm_message(seed, STORED["round"], STORED["client"],
                                      STORED["survivors"], STORED["dropped"])
    assert len(confirm) == 39 + 32 + 8 + 8 + 4 + 8 * 4 + 4 + 8 * 1


def test_the_protocol_page_shows_every_stored_value():
    text = protocol_doc.PROTOCOL.read_text()
    section = text[text.index("### 7.2.2 Signed rounds"):text.index("### 7.3 ")]
    shown = re.sub(r"\s+", "", section)
    for key, value in STORED.items():
        if isinstance(value, str) and re.fullmatch(r"[0-9a-f]+", value):
            assert value in shown, key
