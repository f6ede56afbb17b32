"""An authenticated worker flooding a tag nobody reads: the coordinator's memory stays bounded.

The coordinator runs in this process under tracemalloc (numpy's buffers
are traced); the flooder is a real process holding the secret, sending
1 MiB frames on a tag the coordinator never receives.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc

import pytest

from meshkit.node.config import NodeConfig
from meshkit.transport import MAX_UNREAD_BYTES

pytestmark = pytest.mark.slow

SECRET = b"mailbox-flood-secret-0123456789"
MiB = 1 << 20
FRAMES = 400  # 400 MiB offered: six times the bound

FLOODER = textwrap.dedent("""
    import sys
    import numpy as np
    from meshkit import PeerLostError, WireError
    from meshkit.node.config import NodeConfig

    group = NodeConfig(rank=1, world=2, peers=[sys.argv[1]], topology="star",
                       secret=sys.argv[2].encode(), timeout=10.0).connect()
    chunk = {"junk": np.ones(1 << 20, np.uint8)}
    sent = 0
    try:
        for sent in range(1, int(sys.argv[3]) + 1):
            group.send(0, 0x51, chunk)
    except (PeerLostError, WireError):
        pass
    print(sent, flush=True)
    group.close()
""")


def test_a_worker_flooding_an_unread_tag_is_dropped_and_memory_stays_under_the_bound():
    coordinator = NodeConfig(rank=0, world=2, topology="star", bind="127.0.0.1:0",
                             secret=SECRET, timeout=10.0).connect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        flooder = subprocess.Popen(
            [sys.executable, "-c", FLOODER, coordinator.address, SECRET.decode(), str(FRAMES)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = flooder.communicate(timeout=120)
        finally:
            if flooder.poll() is None:
                flooder.kill()
        deadline = time.monotonic() + 20
        while 1 not in coordinator.dead:
            assert time.monotonic() < deadline, f"the flooder was never dropped: {err}"
            threading.Event().wait(0.05)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        coordinator.close()
    assert flooder.returncode == 0, err
    assert int(out.split()[-1]) < FRAMES, "every frame was accepted"
    assert "past the unread bound" in coordinator.dead[1]
    # The stated bound: MAX_UNREAD_BYTES behind the oldest frame, plus the
    # oldest and the frame being read (1 MiB each), plus the reader's slack.
    assert peak - base < MAX_UNREAD_BYTES + 8 * MiB, f"peak {(peak - base) / MiB:.0f} MiB"
