"""Every secure-aggregation message: one frozen attrs class each, bounds checked on construction.

Rule: a message that exists is well formed. Each class checks its own
fields (types, sizes, bounds, no duplicates) in ``__attrs_post_init__`` and
raises :class:`SecAggError`, a :class:`~meshkit.ProtocolError` naming the
client the message came from (``client`` is ``None`` for what the
coordinator sends: a client has no rank to drop), never another exception
type. Whether a well-formed message fits the round (a neighbour's share, a
vector of the round's length) is the state machines' check, with the same
error. :func:`decode` turns a wire mapping into a message with the same
guarantee.

The round, in order (``C`` a client, ``S`` the coordinator):

1. ``C -> S`` :class:`KeyAdvert`; 2. ``S -> C`` :class:`Roster`;
3. ``C -> S`` :class:`ShareBundle`; 4. ``S -> C`` :class:`ShareDelivery`;
5. ``C -> S`` :class:`MaskedInput` (or a relay's :class:`MaskedSum`);
6. ``S -> C`` :class:`UnmaskRequest`; 7. ``C -> S`` :class:`UnmaskReply`.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, TypeVar

import attrs
import cattrs
import numpy as np

from meshkit.secure_aggregation import SecureAggregationError
from meshkit_secagg._agreement import KEY_SIZE, SEALED_TO_OVERHEAD
from meshkit_secagg._params import MAX_CLIENTS, MAX_LENGTH
from meshkit_secagg._shamir import SHARE_SIZE

__all__ = ["SecAggError", "KeyAdvert", "Roster", "SealedShares", "ShareBundle", "ShareDelivery",
           "MaskedInput", "MaskedSum", "UnmaskRequest", "UnmaskReply", "MESSAGES", "decode",
           "MAX_CLIENT_ID", "SEALED_SIZE", "payload_bytes"]

#: Client ids are integers 0 to MAX_CLIENT_ID (a share's x is id + 1, a uint32).
MAX_CLIENT_ID = (1 << 32) - 2
#: Bytes of one sealed share pair: the self-mask seed's and the mask key's shares, sealed to
#: the recipient under an ephemeral key (its public half in front).
SEALED_SIZE = 2 * SHARE_SIZE + SEALED_TO_OVERHEAD


class SecAggError(SecureAggregationError):
    """A secure-aggregation message that is malformed or does not fit the round.

    ``client`` is the client it is blamed on (drop that one), ``None`` when
    the fault is the coordinator's (seen on a client).
    """


def _id(value: Any, what: str, blame: Optional[int]) -> int:
    # A plain int is by far the common case (a round checks ~10**5 ids): tested first.
    if type(value) is int and 0 <= value <= MAX_CLIENT_ID:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or not 0 <= value <= MAX_CLIENT_ID:
        raise SecAggError(f"{what} must be a client id (an integer 0 to {MAX_CLIENT_ID}), got "
                          f"{_shown(value)}", blame)
    return int(value)


def _ids(values: Any, what: str, blame: Optional[int]) -> tuple[int, ...]:
    if not isinstance(values, (tuple, list)) or len(values) > MAX_CLIENTS:
        raise SecAggError(f"{what} must be a list of at most {MAX_CLIENTS} client ids", blame)
    if all(type(v) is int for v in values):
        # Plain ints, sorted without repeats, lie between the first and the last: the
        # common case is checked at its ends (anything else is checked one by one below).
        ids = tuple(values)
        if ids == tuple(sorted(set(ids))) and (not ids or (0 <= ids[0]
                                                           and ids[-1] <= MAX_CLIENT_ID)):
            return ids
    ids = tuple(_id(v, what, blame) for v in values)
    if list(ids) != sorted(set(ids)):
        raise SecAggError(f"{what} must be sorted client ids without repeats", blame)
    return ids


def _bytes(value: Any, size: int, what: str, blame: Optional[int]) -> None:
    if not isinstance(value, bytes) or len(value) != size:
        raise SecAggError(f"{what} must be {size} bytes, got {_shown(value)}", blame)


def _shown(value: Any) -> str:
    if isinstance(value, (bytes, bytearray)):
        return f"{len(value)} bytes"
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _blame(value: Any) -> Optional[int]:
    # The sender's id when it is one; a message whose client field is itself bad
    # cannot be blamed on a client (its transport sender is the engine's to name).
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) \
            and 0 <= value <= MAX_CLIENT_ID:
        return int(value)
    return None


@attrs.frozen
class KeyAdvert:
    """Step 1, client to coordinator: the client's two fresh public keys and its seed commitment."""

    client: int
    share_key: bytes
    mask_key: bytes
    seed_commitment: bytes

    def __attrs_post_init__(self) -> None:
        blame = _blame(self.client)
        _id(self.client, "client", blame)
        _bytes(self.share_key, KEY_SIZE, "share_key", blame)
        _bytes(self.mask_key, KEY_SIZE, "mask_key", blame)
        _bytes(self.seed_commitment, 32, "seed_commitment", blame)


@attrs.frozen
class Roster:
    """Step 2, coordinator to one client: who advertised, and its neighbours' adverts.

    ``members`` (sorted) is the set the graph is drawn over; ``adverts`` the
    recipient's neighbours' adverts, sorted by client.
    """

    client: int
    members: tuple[int, ...]
    adverts: tuple[KeyAdvert, ...]

    def __attrs_post_init__(self) -> None:
        _id(self.client, "client", None)
        _ids(self.members, "members", None)
        if not isinstance(self.adverts, (tuple, list)) or len(self.adverts) > MAX_CLIENTS \
                or not all(isinstance(a, KeyAdvert) for a in self.adverts):
            raise SecAggError("adverts must be a list of KeyAdvert", None)
        _ids([a.client for a in self.adverts], "adverts' clients", None)


@attrs.frozen
class SealedShares:
    """One client's shares for one neighbour, sealed (AES-GCM) under their agreed key."""

    sender: int
    recipient: int
    sealed: bytes

    def __attrs_post_init__(self) -> None:
        blame = _blame(self.sender)
        _id(self.sender, "sender", blame)
        _id(self.recipient, "recipient", blame)
        _bytes(self.sealed, SEALED_SIZE, "sealed", blame)


def _sealed_list(values: Any, what: str, blame: Optional[int]) -> None:
    if not isinstance(values, (tuple, list)) or len(values) > MAX_CLIENTS \
            or not all(isinstance(v, SealedShares) for v in values):
        raise SecAggError(f"{what} must be a list of at most {MAX_CLIENTS} SealedShares", blame)


@attrs.frozen
class ShareBundle:
    """Step 3, client to coordinator: its sealed shares, one per neighbour."""

    client: int
    shares: tuple[SealedShares, ...]

    def __attrs_post_init__(self) -> None:
        blame = _blame(self.client)
        _id(self.client, "client", blame)
        _sealed_list(self.shares, "shares", blame)
        if any(s.sender != self.client for s in self.shares):
            raise SecAggError("a share bundle holds shares another client sealed", blame)
        _ids([s.recipient for s in self.shares], "the shares' recipients", blame)


@attrs.frozen
class ShareDelivery:
    """Step 4, coordinator to one client: the sealed shares its neighbours sent it."""

    client: int
    shares: tuple[SealedShares, ...]

    def __attrs_post_init__(self) -> None:
        _id(self.client, "client", None)
        _sealed_list(self.shares, "shares", None)
        _ids([s.sender for s in self.shares], "the shares' senders", None)


def _vector(vector: Any, blame: Optional[int]) -> None:
    if not isinstance(vector, np.ndarray) or vector.ndim != 1 \
            or vector.dtype not in (np.dtype(np.uint32), np.dtype(np.uint64)) \
            or not 0 < vector.size <= MAX_LENGTH:
        raise SecAggError(f"a masked vector must be a 1-d uint32 or uint64 array of 1 to "
                          f"{MAX_LENGTH} elements, got {_shown(vector)}", blame)


@attrs.frozen(eq=False)
class MaskedInput:
    """Step 5, client to coordinator: its quantised update plus its masks, mod 2**modulus_bits."""

    client: int
    vector: np.ndarray

    def __attrs_post_init__(self) -> None:
        blame = _blame(self.client)
        _id(self.client, "client", blame)
        _vector(self.vector, blame)


@attrs.frozen(eq=False)
class MaskedSum:
    """Step 5 through a relay: the modular sum of several clients' masked inputs (:func:`add_mod`)."""

    clients: tuple[int, ...]
    vector: np.ndarray

    def __attrs_post_init__(self) -> None:
        ids = _ids(self.clients, "clients", None)
        if not ids:
            raise SecAggError("a masked sum of no clients", None)
        _vector(self.vector, None)


@attrs.frozen
class UnmaskRequest:
    """Step 6, coordinator to a survivor: whose masked input is in the sum, and who dropped after sharing."""

    client: int
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]

    def __attrs_post_init__(self) -> None:
        _id(self.client, "client", None)
        survivors = _ids(self.survivors, "survivors", None)
        dropped = _ids(self.dropped, "dropped", None)
        if set(survivors) & set(dropped):
            raise SecAggError("a client listed both as a survivor and as dropped (revealing both "
                              "its secrets would unmask its input)", None)


def _share_list(values: Any, what: str, blame: Optional[int]) -> None:
    if not isinstance(values, (tuple, list)) or len(values) > MAX_CLIENTS:
        raise SecAggError(f"{what} must be a list of at most {MAX_CLIENTS} (owner, share)", blame)
    owners = []
    for item in values:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise SecAggError(f"{what} must hold (owner, share) pairs", blame)
        owners.append(_id(item[0], f"{what}' owner", blame))
        _bytes(item[1], SHARE_SIZE, f"{what}' share", blame)
    _ids(owners, f"{what}' owners", blame)


@attrs.frozen
class UnmaskReply:
    """Step 7, survivor to coordinator: seed shares of surviving neighbours, key shares of dropped ones."""

    client: int
    seed_shares: tuple[tuple[int, bytes], ...]
    key_shares: tuple[tuple[int, bytes], ...]

    def __attrs_post_init__(self) -> None:
        blame = _blame(self.client)
        _id(self.client, "client", blame)
        _share_list(self.seed_shares, "seed_shares", blame)
        _share_list(self.key_shares, "key_shares", blame)
        if {o for o, _ in self.seed_shares} & {o for o, _ in self.key_shares}:
            raise SecAggError("both secrets of one client in a reply", blame)


#: Every message class, in the order of the round.
MESSAGES = (KeyAdvert, Roster, ShareBundle, ShareDelivery, MaskedInput, MaskedSum,
            UnmaskRequest, UnmaskReply)

_M = TypeVar("_M")
_converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=False)
_converter.register_structure_hook(np.ndarray, lambda value, _: value)
_converter.register_structure_hook(bytes, lambda value, _: value)
# Passed through as they are, for the classes to check: cattrs' own int hook
# would turn 1.7 into 1 and "3" into 3.
_converter.register_structure_hook(int, lambda value, _: value)


def decode(cls: type[_M], data: Mapping[str, Any], sender: Optional[int] = None) -> _M:
    """``data`` (a mapping off the wire) as a ``cls`` message, or :class:`SecAggError` blaming ``sender``.

    Fields are taken as they are (bytes stay bytes, arrays stay arrays) and
    checked by the class; a missing or unknown key, or a value of the wrong
    shape, is the same error.
    """
    if not isinstance(data, Mapping):
        raise SecAggError(f"a {cls.__name__} must be a mapping, got {_shown(data)}", sender)
    try:
        return _converter.structure(dict(data), cls)
    except SecAggError as error:
        if sender is not None and error.client != sender:
            raise SecAggError(str(error), sender) from None
        raise
    except (cattrs.BaseValidationError, cattrs.ForbiddenExtraKeysError, KeyError, TypeError,
            ValueError, AttributeError, IndexError) as error:
        raise SecAggError(f"a malformed {cls.__name__}: {error}", sender) from None


def payload_bytes(message: Any) -> int:
    """The bytes a message's fields hold: byte strings and arrays as they are, 8 per integer.

    What the protocol itself costs, before the codec's framing (a few bytes
    per field and frame): how the benchmark compares a masked upload with a
    plaintext one.
    """
    if isinstance(message, (bytes, bytearray)):
        return len(message)
    if isinstance(message, np.ndarray):
        return int(message.nbytes)
    if isinstance(message, (int, np.integer)):
        return 8
    if isinstance(message, (tuple, list)):
        return sum(payload_bytes(item) for item in message)
    if attrs.has(type(message)):
        return sum(payload_bytes(getattr(message, f.name)) for f in attrs.fields(type(message)))
    raise TypeError(f"not a secure-aggregation message field: {type(message).__name__}")
