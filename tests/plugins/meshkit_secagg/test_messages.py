"""Every message is well formed or a SecAggError naming its client: never another exception."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from meshkit import ProtocolError, RefusedError
from meshkit_secagg import (MESSAGES, SEALED_SIZE, SHARE_SIZE, ClientRound, KeyAdvert,
                            MaskedInput, SealedShares, SecAggError, SecAggParams, ServerRound,
                            ShareBundle, UnmaskReply, decode, payload_bytes)

#: Anything a peer's decoder could hand over (the codec's value types), nested a little.
_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(),
                  st.text(max_size=8), st.binary(max_size=80),
                  st.builds(lambda n, wide: np.zeros(n, np.uint64 if wide else np.uint32),
                            st.integers(0, 4), st.booleans()),
                  st.just(np.zeros((2, 2), np.uint32)), st.just(np.zeros(3, np.float32)))
_VALUE = st.recursive(_LEAF, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)


def _good(cls: type) -> dict[str, Any]:
    """A well-formed wire mapping of ``cls``."""
    advert = {"client": 2, "share_key": bytes(32), "mask_key": b"\x01" * 32,
              "seed_commitment": bytes(32)}
    sealed = {"sender": 2, "recipient": 3, "sealed": bytes(SEALED_SIZE)}
    share = bytes(4) + b"\x01" + bytes(SHARE_SIZE - 5)
    return {
        "KeyAdvert": advert,
        "Roster": {"client": 3, "members": [2, 3], "adverts": [advert]},
        "ShareBundle": {"client": 2, "shares": [sealed]},
        "ShareDelivery": {"client": 3, "shares": [sealed]},
        "MaskedInput": {"client": 2, "vector": np.zeros(8, np.uint32)},
        "MaskedSum": {"clients": [2, 4], "vector": np.zeros(8, np.uint64)},
        "UnmaskRequest": {"client": 2, "survivors": [2, 3], "dropped": [4]},
        "UnmaskReply": {"client": 2, "seed_shares": [[3, share]], "key_shares": [[4, share]]},
    }[cls.__name__]


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_a_well_formed_mapping_decodes(cls: type) -> None:
    message = decode(cls, _good(cls), sender=2)
    assert isinstance(message, cls) and payload_bytes(message) > 0


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(cls=st.sampled_from(MESSAGES), data=st.data())
def test_a_mangled_mapping_is_a_secagg_error_for_its_sender(cls: type, data: st.DataObject) -> None:
    mapping = _good(cls)
    how = data.draw(st.sampled_from(["replace", "drop", "add", "whole"]))
    if how == "whole":
        mapping = data.draw(_VALUE)
    else:
        key = data.draw(st.sampled_from(sorted(mapping)))
        if how == "replace":
            mapping[key] = data.draw(_VALUE)
        elif how == "drop":
            del mapping[key]
        else:
            mapping[data.draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in mapping))] = 1
    try:
        decode(cls, mapping, sender=5)
    except SecAggError as error:
        assert isinstance(error, ProtocolError) and error.client == 5
    # else: the replacement happened to be valid (e.g. another client id): fine.


def test_unknown_and_missing_fields_are_named() -> None:
    with pytest.raises(SecAggError, match="malformed KeyAdvert") as caught:
        decode(KeyAdvert, {**_good(KeyAdvert), "extra": 1}, sender=2)
    assert caught.value.client == 2
    with pytest.raises(SecAggError, match="mask_key must be 32 bytes, got 31 bytes"):
        decode(KeyAdvert, {**_good(KeyAdvert), "mask_key": bytes(31)}, sender=2)
    with pytest.raises(SecAggError, match="client id"):
        decode(KeyAdvert, {**_good(KeyAdvert), "client": 1.7}, sender=2)


def test_a_client_cannot_be_both_survivor_and_dropped() -> None:
    with pytest.raises(SecAggError, match="both as a survivor and as dropped"):
        decode(type(decode(MESSAGES[6], _good(MESSAGES[6]))),
               {"client": 2, "survivors": [2, 3], "dropped": [3]})


PARAMS = SecAggParams(clients=5, degree=0, threshold=3, clip_range=1.0, modulus_bits=32)


def _replace_any(message: Any, data: st.DataObject) -> Any:
    """``message`` with one field replaced by something drawn; None when it cannot be built."""
    field = data.draw(st.sampled_from([f.name for f in attrs.fields(type(message))]))
    try:
        return attrs.evolve(message, **{field: data.draw(_VALUE)})
    except SecAggError:
        return None


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_coordinator_fed_junk_blames_the_sender_and_still_sums(data: st.DataObject) -> None:
    seed = b"junk"
    # Length 6: no drawn array (at most 4 long) fits the round by accident.
    ups = {c: np.full(6, c, np.uint32) for c in range(5)}
    clients = {c: ClientRound(PARAMS, c, seed, 6) for c in range(5)}
    server = ServerRound(PARAMS, range(5), seed, 6)
    junk_at = data.draw(st.sampled_from(["advert", "shares", "masked", "unmask"]))

    def feed(stage: str, take: Any, message: Any) -> None:
        if stage == junk_at:
            bad = _replace_any(message, data)
            if bad is not None and bad != message:
                try:
                    take(bad)
                except SecAggError as error:
                    assert error.client in (None, *range(5), getattr(bad, "client", None))
                else:
                    reject()  # it happened to fit (a 32-byte key, say): no round to finish
        take(message)

    for c in clients.values():
        feed("advert", server.receive_advert, c.advertise())
    rosters = server.rosters()
    for c in sorted(rosters):
        feed("shares", server.receive_shares, clients[c].share(rosters[c]))
    deliveries = server.deliveries()
    for c in sorted(deliveries):
        feed("masked", server.receive_masked, clients[c].mask(deliveries[c], ups[c]))
    requests = server.unmask_requests()
    for c in sorted(requests):
        feed("unmask", server.receive_unmask, clients[c].unmask(requests[c]))
    result = server.finish()
    assert result.total.tolist() == [sum(range(5))] * 6


def test_messages_check_themselves_on_construction() -> None:
    with pytest.raises(SecAggError, match="sealed must be"):
        SealedShares(1, 2, b"short")
    with pytest.raises(SecAggError, match="another client sealed"):
        ShareBundle(1, (SealedShares(2, 3, bytes(SEALED_SIZE)),))
    with pytest.raises(SecAggError, match="1-d uint32 or uint64"):
        MaskedInput(1, np.zeros(4, np.int64))
    with pytest.raises(SecAggError, match="both secrets"):
        UnmaskReply(1, ((2, bytes(SHARE_SIZE)),), ((2, bytes(SHARE_SIZE)),))


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_client_fed_junk_by_the_coordinator_raises_only_secagg_or_refused(
        data: st.DataObject) -> None:
    seed = b"junk for clients"
    clients = {c: ClientRound(PARAMS, c, seed, 6) for c in range(5)}
    server = ServerRound(PARAMS, range(5), seed, 6)
    for c in clients.values():
        server.receive_advert(c.advertise())
    rosters = server.rosters()
    stage = data.draw(st.sampled_from(["share", "mask", "unmask"]))
    target = clients[0]

    def offer(call: Any, message: Any, *rest: Any) -> None:
        bad = _replace_any(message, data)  # None: refused on construction, a SecAggError
        if bad is not None:
            try:
                call(bad, *rest)  # accepted is fine too: it still fitted (another id, say)
            except (SecAggError, RefusedError) as error:
                assert not isinstance(error, SecAggError) or error.client in (None, *range(5))

    if stage == "share":
        offer(target.share, rosters[0])
        return
    for c in range(5):
        server.receive_shares(clients[c].share(rosters[c]))
    deliveries = server.deliveries()
    update = np.zeros(6, np.uint32)
    if stage == "mask":
        offer(target.mask, deliveries[0], update)
        return
    for c in range(5):
        server.receive_masked(clients[c].mask(deliveries[c], update))
    offer(target.unmask, server.unmask_requests()[0])


def _ids_one_by_one(values: Any) -> tuple[int, ...] | str:
    """The id-list rule element by element (what the fast path must agree with)."""
    from meshkit_secagg._messages import MAX_CLIENT_ID

    ids = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) \
                or not 0 <= v <= MAX_CLIENT_ID:
            return "must be a client id"
        ids.append(int(v))
    return tuple(ids) if ids == sorted(set(ids)) else "must be sorted"


@settings(max_examples=300, deadline=None, derandomize=True)
@given(values=st.lists(st.one_of(st.integers(-3, 2 ** 32 + 2), st.booleans(),
                                 st.integers(0, 9).map(np.int64),
                                 st.sampled_from([2 ** 32 - 2, 2 ** 32 - 1, -1])),
                       max_size=6))
def test_a_list_of_ids_is_checked_by_the_rule_whatever_the_path(values: list[Any]) -> None:
    from meshkit_secagg._messages import _ids

    for candidate in (values, sorted(values, key=float)):
        expected = _ids_one_by_one(candidate)
        if isinstance(expected, str):
            with pytest.raises(SecAggError, match=expected):
                _ids(candidate, "ids", 4)
        else:
            got = _ids(candidate, "ids", 4)
            assert got == expected and all(type(v) is int for v in got)
