"""A rank's unread messages are bounded per (source, tag); past the bound the sender is in breach."""

from __future__ import annotations

import numpy as np
import pytest

from meshkit.transport import Message
from meshkit.transport._ledger import Ledger
from meshkit.transport._mailbox import MAX_UNREAD_TAGS, MESSAGE_OVERHEAD, Mailboxes

MiB = 1 << 20


@pytest.fixture
def box():
    breaches: list[tuple[int, str]] = []
    mailboxes = Mailboxes(Ledger(0, 3, is_star=True), 5.0, max_unread=4 * MiB,
                          on_breach=lambda rank, why: breaches.append((rank, why)))
    mailboxes.breaches = breaches  # type: ignore[attr-defined]
    return mailboxes


def frame(src: int, tag: int, nbytes: int) -> Message:
    return Message(src, 0, tag, {"x": np.zeros(nbytes, np.uint8)})


def test_one_frame_larger_than_the_bound_and_a_small_one_behind_it_are_both_kept(box):
    box.put(frame(1, 7, 32 * MiB))  # a big model: the oldest unread is never counted
    box.put(frame(1, 7, 1000))
    assert not box.breaches
    assert box.take(7, {1}, 1.0).payload["x"].nbytes == 32 * MiB
    assert box.take(7, {1}, 1.0).payload["x"].nbytes == 1000
    assert box.unread_bytes(1, 7) == 0


def test_a_tag_that_is_read_as_it_arrives_never_breaches(box):
    for _ in range(100):  # 300 MiB through, never more than one frame unread
        box.put(frame(1, 7, 3 * MiB))
        box.take(7, {1}, 1.0)
    assert not box.breaches


def test_a_flood_on_an_unread_tag_drops_the_sender_and_frees_its_messages(box):
    for _ in range(5):
        box.put(frame(1, 9, MiB))
    box.put(frame(2, 9, MiB))  # another sender on the same tag is not affected
    assert box.breaches == [(1, box.breaches[0][1])]
    assert "past the unread bound of 4194304 bytes per (source, tag)" in box.breaches[0][1]
    assert box.unread_bytes(1, 9) == 0 and box.unread_bytes(2, 9) == MiB + MESSAGE_OVERHEAD
    assert box.take(9, None, 1.0).src == 2


def test_a_flood_of_empty_frames_meets_the_bound_through_their_overhead(box):
    for _ in range(4 * MiB // MESSAGE_OVERHEAD + 2):
        box.put(Message(1, 0, 9, {}))
    assert [rank for rank, _ in box.breaches] == [1]


def test_a_flood_spread_over_many_tags_is_a_breach_too(box):
    for tag in range(MAX_UNREAD_TAGS + 1):
        box.put(frame(1, tag, 10))
    assert [rank for rank, _ in box.breaches] == [1]
    assert f"more than {MAX_UNREAD_TAGS} tags" in box.breaches[0][1]
    assert all(box.unread_bytes(1, tag) == 0 for tag in range(MAX_UNREAD_TAGS + 1))


def test_frames_landed_in_place_by_a_placer_count_only_their_overhead(box):
    class Placed:  # what the wire hands over for a frame a Placer took (the mesh ring)
        placed = True
        nbytes = 4 * MiB

    for _ in range(8):  # 32 MiB of segments already in the ring's own buffer
        box.put(Message(1, 0, 9, {}, raw=Placed()))
    assert not box.breaches and box.unread_bytes(1, 9) == 8 * MESSAGE_OVERHEAD


def test_what_a_sender_in_breach_still_sends_is_dropped_not_queued_again(box):
    for _ in range(5):
        box.put(frame(1, 9, MiB))  # in breach at the fifth
    for _ in range(5):  # relayed through the coordinator, it keeps coming for a while
        box.put(frame(1, 9, MiB))
    assert len(box.breaches) == 1 and box.unread_bytes(1, 9) == 0


def test_a_sender_that_connects_again_is_heard_again(box):
    for _ in range(5):
        box.put(frame(1, 9, MiB))
    box.forgive(1)  # its node restarted: the group calls this when the link comes up
    box.put(frame(1, 9, 10))
    assert box.take(9, {1}, 1.0).payload["x"].nbytes == 10
