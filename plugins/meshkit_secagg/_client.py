"""A client's side of one SecAgg+ round, as a sans-io state machine.

:class:`ClientRound` takes the coordinator's messages and returns its own;
it does no I/O and keeps no clock, so the round engine decides how messages
travel and when a client is late. Its stages, in order (each method once):

1. :meth:`ClientRound.advertise`: fresh key pairs and self-mask seed, the advert;
2. :meth:`ClientRound.share`: from the roster, the graph, then the
   self-mask seed and the mask private key split t-of-(k + 1) among the
   neighbours and the client itself (it keeps its own share, as Bonawitz
   et al. §4 and Flower's secaggplus_mod do: a round then survives
   ``k + 1 - t`` of a client's holders dropping, not ``k - t``), sealed to
   each neighbour;
3. :meth:`ClientRound.open`: the delivered shares opened (their senders
   are the neighbours it masks with); the senders whose shares did not open
   are returned, and :meth:`ClientRound.reveal` answers such an accusation
   against this client with the one ephemeral key it sealed with;
   :meth:`ClientRound.mask_opened`: the quantised update plus the
   self-mask plus the pairwise masks, mod ``2**modulus_bits``
   (:meth:`ClientRound.mask` does both);
4. :meth:`ClientRound.unmask`: for the survivors (itself included), the
   shares of their self-mask seeds; for the dropped, the shares of their
   mask keys; never both for one client, and nothing when fewer than ``t``
   survive. Its own mask key's share never leaves it: a survivor is never
   dropped.

Sign convention: for neighbours ``u < v`` the pairwise mask is added by
``u`` and subtracted by ``v``, so the pair's masks cancel in the sum.
"""

from __future__ import annotations

import secrets
from typing import Iterable, Mapping

import numpy as np

from meshkit.errors import RefusedError
from meshkit_secagg._agreement import (PAIRWISE, agree, derive, generate_private, open_from,
                                       seal_to, seed_commitment)
from meshkit_secagg._graph import neighbours
from meshkit_secagg._masks import SEED_SIZE, add_mod, mask_vector, sub_mod, vector_dtype
from meshkit_secagg._messages import (KeyAdvert, MaskedInput, Roster, SealedShares, SecAggError,
                                      ShareBundle, ShareDelivery, UnmaskReply, UnmaskRequest)
from meshkit_secagg._params import SecAggParams, masked_length
from meshkit_secagg._shamir import SHARE_SIZE, Share, shamir_split

__all__ = ["ClientRound", "cancelled_pairs"]



class ClientRound:
    """One client's part in one round (construct it fresh every round).

    ``params`` the round's parameters, ``client`` this client's id,
    ``round_seed`` the round's public seed (every party's the same: the
    graph and the key derivations depend on it), ``length`` the update's
    number of elements.

    Raises: :class:`SecAggError` (``client`` = the neighbour at fault, or
    ``None`` for the coordinator) for a message that does not fit the round;
    :class:`~meshkit.RefusedError` where going on would weaken the
    guarantee (fewer than ``t`` neighbours, fewer than ``t`` survivors);
    ``RuntimeError`` for a stage called out of order (a caller's bug).
    """

    def __init__(self, params: SecAggParams, client: int, round_seed: bytes, length: int) -> None:
        self.params = params
        self.client = client
        self.round_seed = bytes(round_seed)
        self.length = length
        # Each key is agreed with once per neighbour: kept loaded, never re-read from bytes.
        self._share_key = generate_private()
        self._share_public = self._share_key.public_key().public_bytes_raw()
        self._mask_key = generate_private()
        self._mask_private = self._mask_key.private_bytes_raw()  # what is split into shares
        self._mask_public = self._mask_key.public_key().public_bytes_raw()
        self._seed = secrets.token_bytes(SEED_SIZE)
        self._stage = 0
        self._adverts: dict[int, KeyAdvert] = {}
        #: recipient -> the ephemeral private key its shares were sealed with.
        self._ephemeral: dict[int, bytes] = {}
        #: recipient -> (its share key, the sealed bytes, the share pair in them): what a
        #: peer played by the same party may read instead of opening (``open``'s ``peers``).
        self._sealed: dict[int, tuple[bytes, bytes, bytes]] = {}
        #: The neighbours that sent shares (in the delivery), whether or not they opened.
        self._sharers: list[int] = []
        #: sender -> why its shares did not open.
        self._unopened: dict[int, str] = {}
        #: owner -> (share of its self-mask seed, share of its mask key), from the delivery.
        self._held: dict[int, tuple[bytes, bytes]] = {}
        #: This client's own shares of its two secrets (its point is ``client + 1``).
        self._own: tuple[bytes, bytes] = (b"", b"")

    @property
    def masked_length(self) -> int:
        """Elements of this client's masked input: :func:`masked_length` of the update's."""
        return masked_length(self.length)

    def _advance(self, expected: int, name: str) -> None:
        if self._stage != expected:
            raise RuntimeError(f"ClientRound.{name} called out of order (stage {self._stage})")
        self._stage += 1

    def advertise(self) -> KeyAdvert:
        """Step 1: this round's public keys and the commitment to the self-mask seed."""
        self._advance(0, "advertise")
        return KeyAdvert(self.client, self._share_public, self._mask_public,
                         seed_commitment(self._seed, self.round_seed, self.client))

    def share(self, roster: Roster) -> ShareBundle:
        """Step 3: the self-mask seed and mask key, split among the neighbours and sealed to each."""
        self._advance(1, "share")
        if roster.client != self.client or self.client not in roster.members:
            raise SecAggError(f"a roster for client {roster.client} without this client "
                              f"({self.client}) among its members", None)
        if len(roster.members) > self.params.clients:
            raise SecAggError(f"a roster of {len(roster.members)} members for a round of "
                              f"{self.params.clients}", None)
        mine = neighbours(self.round_seed, roster.members, self.params.degree)[self.client]
        got = tuple(a.client for a in roster.adverts)
        if got != mine:
            raise SecAggError(f"the roster's adverts are from {list(got)}, not from this client's "
                              f"neighbours {list(mine)}", None)
        if len(mine) + 1 < self.params.threshold:
            raise RefusedError(
                f"client {self.client} has {len(mine)} neighbours and its own share, fewer than "
                f"the threshold {self.params.threshold}: its secrets could not be rebuilt; a "
                "round needs more clients, or a lower threshold")
        for advert in roster.adverts:
            self._adverts[advert.client] = advert
        # The last point is the client's own: it holds one share of each of its secrets.
        xs = [v + 1 for v in mine] + [self.client + 1]
        seed_shares = shamir_split(self._seed, self.params.threshold, xs)
        key_shares = shamir_split(self._mask_private, self.params.threshold, xs)
        self._own = (seed_shares[-1].to_bytes(), key_shares[-1].to_bytes())
        sealed = []
        for v, s, k in zip(mine, seed_shares, key_shares):
            pair = s.to_bytes() + k.to_bytes()
            try:
                # The sealing agreement is the share key's check: a key of the wrong size
                # or of small order (an all-zero agreement) is refused there.
                ephemeral, box = seal_to(self._adverts[v].share_key, pair, self.round_seed,
                                         self.client, v)
            except ValueError as error:
                raise SecAggError(f"client {v}'s share key: {error}", v) from None
            self._ephemeral[v] = ephemeral  # kept to answer an accusation (reveal)
            self._sealed[v] = (self._adverts[v].share_key, box, pair)
            sealed.append(SealedShares(self.client, v, box))
        return ShareBundle(self.client, tuple(sealed))

    def open(self, delivery: ShareDelivery,
             peers: Mapping[int, "ClientRound"] | None = None) -> tuple[int, ...]:
        """Step 4: opens the shares its neighbours sealed to it; the senders whose did not open.

        A share that does not authenticate, does not parse, or is for another
        holder is not held, and its sender is returned: an accusation the
        coordinator can check without taking this client's word for it (it
        asks the sender for that share's ephemeral key: :meth:`reveal`). A
        delivery that is not this client's, or holds a non-neighbour's share,
        is the coordinator's fault (:class:`SecAggError` blaming ``None``).

        ``peers`` (id -> round) are clients of this round played by the same
        party (a worker playing several): a share one of them sealed to this
        client's own share key, delivered as the very bytes it sealed, is
        read from the sealer instead of decrypted, which is what decrypting
        it would give. Any other share, a peer's altered on the way
        included, is decrypted.
        """
        self._advance(2, "open")
        if delivery.client != self.client:
            raise SecAggError(f"a share delivery for client {delivery.client}", None)
        accused = []
        for sealed in delivery.shares:
            owner = sealed.sender
            if owner not in self._adverts or sealed.recipient != self.client:
                raise SecAggError(f"shares from {owner} to {sealed.recipient}: not a neighbour's "
                                  f"to this client", None)
            self._sharers.append(owner)
            peer = (peers or {}).get(owner)
            kept = peer._sealed.get(self.client) if peer is not None else None
            try:
                if kept is not None and kept[0] == self._share_public \
                        and kept[1] == sealed.sealed:
                    plain = kept[2]  # the bytes its sealer made: no agreement, no AES
                else:
                    plain = open_from(self._share_key, sealed.sealed, self.round_seed,
                                      owner, self.client)
                seed_share = Share.from_bytes(plain[:SHARE_SIZE])
                key_share = Share.from_bytes(plain[SHARE_SIZE:])
                if seed_share.x != self.client + 1 or key_share.x != self.client + 1:
                    raise ValueError("the shares are for another holder")
            except ValueError as error:
                self._unopened[owner] = str(error)
                accused.append(owner)
                continue
            self._held[owner] = (plain[:SHARE_SIZE], plain[SHARE_SIZE:])
        return tuple(accused)

    def reveal(self, recipient: int) -> bytes:
        """The ephemeral private key this client sealed ``recipient``'s shares with.

        Asked for only when ``recipient`` says those shares do not open: it
        lets the coordinator open that one sealed share itself and see who is
        lying. It exposes this client's shares for ``recipient``, nothing else.
        """
        if self._stage < 2 or recipient not in self._ephemeral:
            raise SecAggError(f"a reveal of client {self.client}'s shares for {recipient}, which "
                              "it did not seal to", None)
        return self._ephemeral[recipient]

    def mask(self, delivery: ShareDelivery, update: np.ndarray) -> MaskedInput:
        """Steps 4 and 5 at once: :meth:`open`, then :meth:`mask_opened` with nobody excluded.

        A share that does not open is a :class:`SecAggError` blaming its
        sender here (for callers that do not settle accusations).
        """
        accused = self.open(delivery)
        if accused:
            raise SecAggError(f"client {accused[0]}'s shares: {self._unopened[accused[0]]}",
                              accused[0])
        return self.mask_opened(update)

    @property
    def sharers(self) -> tuple[int, ...]:
        """The neighbours whose shares were delivered to this client (it masks with each)."""
        return tuple(sorted(self._sharers))

    def mask_opened(self, update: np.ndarray, excluded: Iterable[int] = (),
                    cancelled: Iterable[int] = ()) -> MaskedInput:
        """Step 5: ``update`` (from :func:`quantize`) masked with every neighbour that shared with it.

        ``excluded`` are clients the coordinator took out of the round after
        the shares were opened (a sealer proven to have sealed garbage, or an
        accuser proven to have lied): no mask with them, no share of theirs
        kept. The masked vector is :attr:`masked_length` long: the update,
        then a 1 in each of the :data:`CHECK_ELEMENTS` (the coordinator's
        count check).

        ``cancelled`` are sharers whose masked inputs the caller adds to this
        one before anything leaves it (a worker that plays both and sends
        one sum: :func:`cancelled_pairs`): the pair's mask, added by one end
        and subtracted by the other, would cancel in that sum, so neither
        end expands it. The vector returned is then a masked input only as
        part of the caller's sum, which is bit for bit the sum of the
        uncancelled inputs.
        """
        self._advance(3, "mask")
        dtype = vector_dtype(self.params.modulus_bits)
        if not isinstance(update, np.ndarray) or update.dtype != dtype \
                or update.shape != (self.length,):
            raise ValueError(f"the update must be a {dtype} vector of {self.length} elements "
                             "(see quantize)")
        if update.size and int(update.max()) > self.params.levels:
            raise ValueError(f"the update holds values above {self.params.levels}: quantize it "
                             "for this round's parameters")
        gone = set(excluded)
        if self.client in gone:
            raise SecAggError(f"client {self.client} was excluded from the round", None)
        self._sharers = [v for v in self._sharers if v not in gone]
        for v in gone:
            self._held.pop(v, None)
        if len(self._sharers) + 1 < self.params.threshold:
            raise RefusedError(
                f"client {self.client} received shares from {len(self._sharers)} neighbours, "
                f"and holds its own: fewer than the threshold {self.params.threshold}; it does "
                "not mask with so few")
        bits = self.params.modulus_bits
        size = self.masked_length
        out = np.empty(size, dtype=dtype)
        out[:self.length] = update
        out[self.length:] = 1  # the count check (CHECK_ELEMENTS)
        scratch = np.empty(size, dtype=dtype)
        add_mod(out, mask_vector(self._seed, size, bits, out=scratch), bits, out=out)
        # Every sharer the coordinator kept, whether or not its share opened here: the
        # coordinator cancels exactly those pairs' masks.
        skip = set(cancelled)
        for other in sorted(self._sharers):
            if other in skip:
                continue
            seed = self._pairwise_seed(other)
            mask = mask_vector(seed, size, bits, out=scratch)
            (add_mod if self.client < other else sub_mod)(out, mask, bits, out=out)
        return MaskedInput(self.client, out)

    def _pairwise_seed(self, other: int) -> bytes:
        try:
            shared = agree(self._mask_key, self._adverts[other].mask_key)
        except ValueError as error:
            raise SecAggError(f"client {other}'s mask key: {error}", other) from None
        return derive(shared, self.round_seed, PAIRWISE, self.client, other)

    def unmask(self, request: UnmaskRequest) -> UnmaskReply:
        """Step 7: shares of the survivors' self-mask seeds and of the dropped's mask keys."""
        self._advance(4, "unmask")
        survivors, dropped = set(request.survivors), set(request.dropped)
        if request.client != self.client or self.client not in survivors:
            raise SecAggError(f"an unmask request for client {request.client} that does not "
                              f"count this client ({self.client}) among the survivors", None)
        if len(survivors) < self.params.threshold:
            raise RefusedError(
                f"{len(survivors)} survivors, fewer than the threshold {self.params.threshold}: "
                f"client {self.client} reveals no share (no partial unmasking)")
        unaccounted = sorted(set(self._sharers) - survivors - dropped)
        if unaccounted:
            raise SecAggError(f"the unmask request leaves neighbours {unaccounted}, who shared "
                              "with this client, neither surviving nor dropped", None)
        held = {**self._held, self.client: self._own}  # its own share of its own seed too
        seed_shares = tuple((o, held[o][0]) for o in sorted(held) if o in survivors)
        key_shares = tuple((o, self._held[o][1]) for o in sorted(self._held) if o in dropped)
        return UnmaskReply(self.client, seed_shares, key_shares)


def cancelled_pairs(rounds: Mapping[int, ClientRound]) -> dict[int, frozenset[int]]:
    """For clients whose masked inputs one party adds up before sending: each one's masks that cancel.

    A pair ``(u, v)`` of ``rounds`` cancels when each is the other's sharer
    (so ``u`` adds the pair's mask and ``v`` subtracts it, or the other way
    round); a pair masked by one end only (deliveries that disagree) is
    left as it is, so the sum stays bit for bit what the uncancelled inputs
    give. Pass each client's set as ``cancelled`` to
    :meth:`ClientRound.mask_opened`.
    """
    sharers = {c: set(r.sharers) for c, r in rounds.items()}
    return {c: frozenset(v for v in mine if v in sharers and c in sharers[v])
            for c, mine in sharers.items()}
