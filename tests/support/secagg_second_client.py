"""The second SecAgg+ client, written from docs/protocol.md §7.2 and docs/secure-aggregation.md only.

It lives once, in the fixture package ``tests/fixtures/meshkit-secondclient``
(``meshkit_secondclient/client.py``), which the real-process tests install and run as
a worker; the quick tests (tests/plugins/meshkit_secagg/test_second_client.py) load
that same file by its path, without installing anything: it reproduces the test
vectors, and it plays clients in a round with the plugin's own clients and
coordinator.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = (Path(__file__).resolve().parents[1] / "fixtures" / "meshkit-secondclient"
         / "meshkit_secondclient" / "client.py")
_spec = importlib.util.spec_from_file_location("tests.support._secondclient", _PATH)
assert _spec is not None and _spec.loader is not None
_client = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _client
_spec.loader.exec_module(_client)

SecondClient = _client.SecondClient
chacha20_keystream = _client.chacha20_keystream
mask_words = _client.mask_words
vector_draw = _client.vector_draw

__all__ = ["SecondClient", "chacha20_keystream", "mask_words", "vector_draw"]
