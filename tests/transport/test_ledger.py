"""Messages a star coordinator holds for ranks that have not joined are bounded in count and bytes."""

from __future__ import annotations

from meshkit.transport import Message
from meshkit.transport._ledger import MAX_HELD, MAX_HELD_BYTES, Ledger

MiB = 1 << 20


class Frame:
    """What a transport hands over as ``Message.raw``: the received body's size."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def relayed(nbytes: int) -> Message:
    return Message(1, 3, 7, {}, raw=Frame(nbytes))


def test_held_messages_stop_at_the_byte_bound_and_are_delivered_when_the_rank_joins():
    ledger = Ledger(0, 4, is_star=True)
    per = MAX_HELD_BYTES // 3 + 1
    for _ in range(5):
        assert ledger.hold(relayed(per))  # True: taken care of (held or dropped)
    held = ledger.link(3)
    assert len(held) == 2 and sum(m.raw.nbytes for m in held) <= MAX_HELD_BYTES


def test_one_message_larger_than_the_bound_is_still_held():
    ledger = Ledger(0, 4, is_star=True)
    assert ledger.hold(relayed(4 * MAX_HELD_BYTES))
    assert ledger.hold(relayed(10))  # behind it: past the bound, dropped
    assert [m.raw.nbytes for m in ledger.link(3)] == [4 * MAX_HELD_BYTES]


def test_small_messages_still_stop_at_the_count_bound():
    ledger = Ledger(0, 4, is_star=True)
    for _ in range(MAX_HELD + 5):
        ledger.hold(relayed(10))
    assert len(ledger.link(3)) == MAX_HELD
