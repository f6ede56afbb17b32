"""The coordinator's side of one SecAgg+ round, as a sans-io state machine.

:class:`ServerRound` collects the clients' messages and produces its own;
no I/O, no clock: the round engine decides when a stage closes (everyone
answered, or the deadline passed) by calling the next stage's method.
Stages, in order:

1. :meth:`receive_advert` for each client, then :meth:`rosters` (U1: who advertised);
2. :meth:`receive_shares`, then :meth:`deliveries` (U2: who shared); a
   share that does not open for its recipient is settled by :meth:`judge`
   (from the sealer's revealed ephemeral key) and the party at fault taken
   out by :meth:`exclude`, before anyone masks;
3. :meth:`receive_masked`, then :meth:`unmask_requests` (U3: whose
   masked input is in the sum; U2 minus U3 dropped after sharing);
4. :meth:`receive_unmask`, then :meth:`finish`: the exact integer sum of
   U3's quantised inputs, mod ``2**modulus_bits``.

The coordinator holds the masked inputs' running modular sum only (one
vector, folded as each arrives), never an individual unmasked input: it
subtracts the survivors' self-masks and cancels the dropped clients'
pairwise masks from the sum. It refuses (:class:`~meshkit.RefusedError`)
to ask for unmasking shares when fewer than ``t`` clients survive, and to
unmask when any secret it needs has fewer than ``t`` shares: nothing is
revealed in part.

A message that does not fit is a :class:`SecAggError` naming its client,
and changes nothing: the engine drops that client and goes on. Every
reconstructed secret is checked against what its owner committed to in
step 1 (the self-mask seed's SHA-256, the mask key's public key); a wrong
one is pinned on the holder whose share disagrees with the others
(:meth:`finish` raises naming it and discards its reply; call
:meth:`finish` again).
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

import attrs
import numpy as np

from meshkit.errors import RefusedError
from meshkit_secagg._agreement import (PAIRWISE, agree, check_public_key, derive,
                                       open_revealed, private_key, public_key, seed_commitment)
from meshkit_secagg._graph import neighbours
from meshkit_secagg._masks import add_mod, mask_vector, sub_mod, vector_dtype
from meshkit_secagg._messages import (MAX_CLIENT_ID, KeyAdvert, MaskedInput, MaskedSum, Roster,
                                      SealedShares, SecAggError, ShareBundle, ShareDelivery,
                                      UnmaskReply, UnmaskRequest)
from meshkit_secagg._params import SecAggParams, masked_length
from meshkit_secagg._shamir import SHARE_SIZE, Share, shamir_combine

__all__ = ["ServerRound", "SecAggResult"]

# How many holders' shares finish() will leave out, one at a time, to find the
# one that disagrees (a bound on the work a bad share can cause).
_MAX_SUSPECTS = 64

#: Whether a rebuilt secret is what its owner committed to.
_Check = Callable[[int, bytes], bool]


@attrs.frozen(eq=False)
class SecAggResult:
    """What a round reveals: the integer sum of ``contributors``' quantised inputs (:func:`dequantize` it)."""

    total: np.ndarray
    contributors: tuple[int, ...]
    #: U2 minus U3: shared their secrets, sent no masked input (their pairwise masks were cancelled).
    dropped: tuple[int, ...]


class ServerRound:
    """The coordinator's part in one round.

    ``params`` the round's parameters, ``clients`` the cohort (distinct ids,
    at most ``params.clients``), ``round_seed`` its public seed, ``length``
    the update's number of elements, ``groups`` (optional) each client's
    party, e.g. the worker rank that plays it: a share that rebuilds a wrong
    secret is searched for by leaving out whole parties, so an insider
    playing several clients cannot hide behind a second bad share (each
    client its own party when not given).

    Raises: :class:`SecAggError` naming the client whose message does not
    fit (the state is unchanged); :class:`~meshkit.RefusedError` when too
    few clients remain to go on without weakening the guarantee;
    ``RuntimeError`` for a stage called out of order (a caller's bug).
    """

    def __init__(self, params: SecAggParams, clients: Sequence[int], round_seed: bytes,
                 length: int, groups: Optional[Mapping[int, int]] = None) -> None:
        cohort = sorted(clients)
        if len(set(cohort)) != len(cohort) or not 2 <= len(cohort) <= params.clients \
                or not all(0 <= c <= MAX_CLIENT_ID for c in cohort):
            raise ValueError(f"a cohort must be 2 to {params.clients} distinct client ids, got "
                             f"{len(cohort)} ids")
        self.params = params
        self.cohort = frozenset(cohort)
        self.round_seed = bytes(round_seed)
        self.length = length
        self._dtype = vector_dtype(params.modulus_bits)
        self._stage = 0
        self._adverts: dict[int, KeyAdvert] = {}
        self._keys: dict[bytes, int] = {}  # every advertised public key -> its client
        self._graph: dict[int, tuple[int, ...]] = {}
        self._bundles: dict[int, ShareBundle] = {}
        #: (sender, recipient) -> the sealed share routed, kept to settle accusations.
        self._sealed: dict[tuple[int, int], bytes] = {}
        self._shared: dict[int, tuple[int, ...]] = {}   # U2 member -> its U2 neighbours
        self._masked: set[int] = set()
        self._sum = np.zeros(self.masked_length, dtype=self._dtype)
        self._dropped: tuple[int, ...] = ()
        self._replies: dict[int, UnmaskReply] = {}
        #: Taken out after the shares were opened (:meth:`exclude`).
        self._excluded: set[int] = set()
        #: client -> the party that plays it (a worker's rank): the unit a bad share is
        #: pinned on, since one party playing several clients can lie through all of them.
        self._groups = dict(groups or {})

    @property
    def masked_length(self) -> int:
        """Elements of a masked input (or sum): :func:`masked_length` of the update's."""
        return masked_length(self.length)

    # -- helpers ---------------------------------------------------------------------------

    def _at(self, stage: int, name: str) -> None:
        if self._stage != stage:
            raise RuntimeError(f"ServerRound.{name} called out of order (stage {self._stage})")

    def _from(self, client: int, members: Iterable[int], what: str) -> None:
        if client not in members:
            raise SecAggError(f"{what} from client {client}, who is not in this stage of the "
                              "round", client)

    # -- stage 1: keys -----------------------------------------------------------------------

    def receive_advert(self, advert: KeyAdvert) -> None:
        """Takes one client's :class:`KeyAdvert`."""
        self._at(0, "receive_advert")
        self._from(advert.client, self.cohort, "a key advert")
        if advert.client in self._adverts:
            raise SecAggError(f"a second key advert from client {advert.client}", advert.client)
        for key in (advert.share_key, advert.mask_key):
            if key in self._keys:
                raise SecAggError(f"client {advert.client} advertises a public key client "
                                  f"{self._keys[key]} advertised already", advert.client)
        for name, key in (("share", advert.share_key), ("mask", advert.mask_key)):
            try:
                check_public_key(key)
            except ValueError as error:
                raise SecAggError(f"client {advert.client}'s {name} key: {error}",
                                  advert.client) from None
        if advert.share_key == advert.mask_key:
            raise SecAggError(f"client {advert.client} advertises one key for two purposes",
                              advert.client)
        self._adverts[advert.client] = advert
        self._keys[advert.share_key] = self._keys[advert.mask_key] = advert.client

    def rosters(self) -> dict[int, Roster]:
        """Closes stage 1: each advertiser's roster (its neighbours' adverts over U1's graph)."""
        self._at(0, "rosters")
        members = sorted(self._adverts)
        self._need(len(members), "advertised keys")
        self._graph = neighbours(self.round_seed, members, self.params.degree)
        self._stage = 1
        return {c: Roster(c, tuple(members), tuple(self._adverts[v] for v in self._graph[c]))
                for c in members}

    def _need(self, count: int, what: str) -> None:
        if count < self.params.threshold:
            raise RefusedError(
                f"{count} clients {what}; a round with threshold {self.params.threshold} needs "
                f"at least {self.params.threshold} (each needs {self.params.threshold - 1} "
                "neighbours and itself to hold its shares); nothing was unmasked")

    # -- stage 2: shares ---------------------------------------------------------------------

    def receive_shares(self, bundle: ShareBundle) -> None:
        """Takes one client's :class:`ShareBundle`: one sealed share pair per neighbour."""
        self._at(1, "receive_shares")
        self._from(bundle.client, self._graph, "shares")
        if bundle.client in self._bundles:
            raise SecAggError(f"a second share bundle from client {bundle.client}", bundle.client)
        recipients = tuple(s.recipient for s in bundle.shares)
        if recipients != self._graph[bundle.client]:
            raise SecAggError(f"client {bundle.client} sealed shares for {list(recipients)}, not "
                              f"for its neighbours {list(self._graph[bundle.client])}",
                              bundle.client)
        self._bundles[bundle.client] = bundle

    def deliveries(self) -> dict[int, ShareDelivery]:
        """Closes stage 2: each sharer's delivery, the sealed shares its sharing neighbours sent it.

        A sharer left with fewer than ``t - 1`` sharing neighbours (it holds
        the ``t``-th share itself) could not have its secrets rebuilt, so it
        is left out (as if it had not shared), until every remaining one has
        enough.
        """
        self._at(1, "deliveries")
        shared = set(self._bundles)
        while True:
            thin = {c for c in shared
                    if sum(v in shared for v in self._graph[c]) + 1 < self.params.threshold}
            if not thin:
                break
            shared -= thin
        self._need(len(shared), "shared their secrets")
        self._shared = {c: tuple(v for v in self._graph[c] if v in shared) for c in sorted(shared)}
        inbox: dict[int, list[SealedShares]] = {c: [] for c in self._shared}
        for sender in sorted(self._shared):
            for sealed in self._bundles[sender].shares:
                if sealed.recipient in inbox:
                    inbox[sealed.recipient].append(sealed)
                    self._sealed[sender, sealed.recipient] = sealed.sealed
        self._bundles.clear()
        self._stage = 2
        return {c: ShareDelivery(c, tuple(sorted(box, key=lambda s: s.sender)))
                for c, box in inbox.items()}

    # -- between stages 2 and 3: accusations --------------------------------------------------

    def judge(self, sender: int, recipient: int, ephemeral: Optional[bytes]) -> int:
        """Who is at fault when ``recipient`` says ``sender``'s shares do not open.

        ``ephemeral`` is the key ``sender`` revealed for that sealed share
        (None: it revealed none). The coordinator opens the share it routed
        itself: the sender is at fault when it revealed no key, a key that is
        not the one the share was sealed with, or one under which the share
        does not open or holds no share pair for ``recipient``; otherwise the
        share was sound and the accuser is at fault. Neither side's word is
        taken: the verdict rests on the sealed bytes the sender itself sent.
        """
        self._at(2, "judge")
        if self._masked:
            raise RuntimeError("ServerRound.judge called after a masked input was taken in")
        if (sender, recipient) not in self._sealed:
            raise SecAggError(f"client {recipient} accuses client {sender}, who sealed it no "
                              "share this round", recipient)
        if ephemeral is None:
            return sender
        try:
            plain = open_revealed(ephemeral, self._adverts[recipient].share_key,
                                  self._sealed[sender, recipient], self.round_seed, sender,
                                  recipient)
            pair = Share.from_bytes(plain[:SHARE_SIZE]), Share.from_bytes(plain[SHARE_SIZE:])
        except ValueError:
            return sender
        if len(plain) != 2 * SHARE_SIZE or any(s.x != recipient + 1 for s in pair):
            return sender
        return recipient

    def exclude(self, clients: Iterable[int]) -> tuple[int, ...]:
        """Takes ``clients`` out of the round before anyone masks; every client now out.

        For a party found at fault in :meth:`judge`: nobody masks with an
        excluded client and none of its secrets is needed. A sharer left with
        too few sharing neighbours goes too (as in :meth:`deliveries`), so
        the result may name more clients than asked; tell every masker all
        of them. Refuses when fewer than ``t`` sharers remain.
        """
        self._at(2, "exclude")
        if self._masked:
            raise RuntimeError("ServerRound.exclude called after a masked input was taken in")
        shared = set(self._shared) - set(clients)
        while True:
            thin = {c for c in shared
                    if sum(v in shared for v in self._graph[c]) + 1 < self.params.threshold}
            if not thin:
                break
            shared -= thin
        self._need(len(shared), "remain after the excluded")
        self._excluded.update(set(self._shared) - shared)
        self._shared = {c: tuple(v for v in self._graph[c] if v in shared) for c in sorted(shared)}
        return tuple(sorted(self._excluded))

    # -- stage 3: masked inputs --------------------------------------------------------------

    def receive_masked(self, masked: Union[MaskedInput, MaskedSum]) -> None:
        """Folds one client's :class:`MaskedInput` (or a relay's :class:`MaskedSum`) into the sum."""
        self._at(2, "receive_masked")
        # A sum's faults are its relay's: no one client in it is to blame.
        clients = (masked.client,) if isinstance(masked, MaskedInput) else masked.clients
        blame: Optional[int] = masked.client if isinstance(masked, MaskedInput) else None
        for client in clients:
            if client not in self._shared or client in self._masked:
                raise SecAggError(f"a masked input from client {client}, who "
                                  + ("sent one already" if client in self._masked
                                     else "did not share its secrets this round"), blame)
        vector = masked.vector
        if vector.dtype != self._dtype or vector.shape != (self.masked_length,):
            raise SecAggError(f"a masked input of {vector.shape} {vector.dtype}; this round's "
                              f"are ({self.masked_length},) {self._dtype}", blame)
        if self.params.modulus_bits not in (32, 64) and int(vector.max()) >> self.params.modulus_bits:
            raise SecAggError(f"a masked input with values of {self.params.modulus_bits} bits or "
                              "more", blame)
        add_mod(self._sum, vector, self.params.modulus_bits, out=self._sum)
        self._masked.update(clients)

    def unmask_requests(self) -> dict[int, UnmaskRequest]:
        """Closes stage 3: the dropped set decided, an unmask request for each survivor.

        Refuses when fewer than ``t`` survived: no survivor is asked for a share.
        """
        self._at(2, "unmask_requests")
        survivors = tuple(sorted(self._masked))
        if len(survivors) < self.params.threshold:
            raise RefusedError(
                f"{len(survivors)} clients sent masked input, fewer than the threshold "
                f"{self.params.threshold}: the round is not unmasked (no share is asked for, so "
                "nothing is revealed in part)")
        self._dropped = tuple(c for c in self._shared if c not in self._masked)
        self._stage = 3
        return {c: UnmaskRequest(c, survivors, self._dropped) for c in survivors}

    # -- stage 4: unmasking ------------------------------------------------------------------

    def receive_unmask(self, reply: UnmaskReply) -> None:
        """Takes one survivor's :class:`UnmaskReply`."""
        self._at(3, "receive_unmask")
        self._from(reply.client, self._masked, "unmasking shares")
        if reply.client in self._replies:
            raise SecAggError(f"second unmasking shares from client {reply.client}", reply.client)
        held = tuple(sorted((*self._shared[reply.client], reply.client)))  # its own share too
        want_seeds = tuple(o for o in held if o in self._masked)
        want_keys = tuple(o for o in held if o not in self._masked)
        if tuple(o for o, _ in reply.seed_shares) != want_seeds \
                or tuple(o for o, _ in reply.key_shares) != want_keys:
            raise SecAggError(
                f"client {reply.client} sent shares for {[o for o, _ in reply.seed_shares]} "
                f"(seeds) and {[o for o, _ in reply.key_shares]} (keys); it holds "
                f"{list(want_seeds)} and {list(want_keys)}", reply.client)
        for _, data in (*reply.seed_shares, *reply.key_shares):
            try:
                share = Share.from_bytes(data)
            except ValueError as error:
                raise SecAggError(f"client {reply.client}'s share: {error}", reply.client) from None
            if share.x != reply.client + 1:
                raise SecAggError(f"client {reply.client} sent a share held by another client",
                                  reply.client)
        self._replies[reply.client] = reply

    def finish(self) -> SecAggResult:
        """The exact integer sum of the survivors' quantised inputs.

        Refuses (nothing unmasked) when a survivor's self-mask seed or a
        dropped client's mask key has fewer than ``t`` shares among the
        replies, and (nothing released) when the count check fails
        (:data:`CHECK_ELEMENTS`). ``total`` is the update's length: the
        check elements are stripped. Raises :class:`SecAggError` naming a holder whose share
        rebuilt a secret that fails its commitment (its reply is discarded;
        call again).
        """
        self._at(3, "finish")
        seeds: dict[int, dict[int, Share]] = {o: {} for o in self._masked}
        keys: dict[int, dict[int, Share]] = {o: {} for o in self._dropped}
        for holder, reply in self._replies.items():
            for owner, data in reply.seed_shares:
                seeds[owner][holder] = Share.from_bytes(data)
            for owner, data in reply.key_shares:
                keys[owner][holder] = Share.from_bytes(data)
        short = sorted(o for o, s in (*seeds.items(), *keys.items())
                       if len(s) < self.params.threshold)
        if short:
            raise RefusedError(
                f"the secrets of clients {short} have fewer than {self.params.threshold} shares "
                f"among the {len(self._replies)} replies: the sum is not unmasked (a partial "
                "unmasking would reveal nothing useful and weaken the rest)")
        rebuilt_seeds = {o: self._rebuild(o, s, self._seed_ok) for o, s in seeds.items()}
        rebuilt_keys = {o: self._rebuild(o, s, self._key_ok) for o, s in keys.items()}
        bits = self.params.modulus_bits
        size = self.masked_length
        total = self._sum.copy()
        scratch = np.empty(size, dtype=self._dtype)
        for owner in sorted(rebuilt_seeds):
            sub_mod(total, mask_vector(rebuilt_seeds[owner], size, bits, out=scratch), bits,
                    out=total)
        for gone in sorted(rebuilt_keys):
            key = private_key(rebuilt_keys[gone])  # loaded once for all its neighbours
            for survivor in self._shared[gone]:
                if survivor not in self._masked:
                    continue
                shared = agree(key, self._adverts[survivor].mask_key)
                mask = mask_vector(derive(shared, self.round_seed, PAIRWISE, gone, survivor),
                                   size, bits, out=scratch)
                # The survivor added the pair's mask if its id is the smaller one.
                (sub_mod if survivor < gone else add_mod)(total, mask, bits, out=total)
        contributors = tuple(sorted(self._masked))
        check = total[self.length:]
        if not (check == len(contributors) % (1 << bits)).all():
            # Masks left over: some input was added under the wrong clients.
            raise RefusedError(
                f"the unmasked sum fails its count check ({check.tolist()} where each client "
                f"adds 1, {len(contributors)} contributors): a masked sum was counted under the "
                "wrong clients (a relay or worker misreported whose inputs it added), or a "
                "client sent a malformed input; the sum is not released")
        self._stage = 4
        return SecAggResult(total[:self.length], contributors, self._dropped)

    def _seed_ok(self, owner: int, secret: bytes) -> bool:
        return seed_commitment(secret, self.round_seed, owner) == \
            self._adverts[owner].seed_commitment

    def _key_ok(self, owner: int, secret: bytes) -> bool:
        return public_key(secret) == self._adverts[owner].mask_key

    def _rebuild(self, owner: int, shares: dict[int, Share], ok: _Check) -> bytes:
        t = self.params.threshold
        holders = sorted(shares)
        secret = self._try(shares, holders[:t], owner, ok)
        if secret is not None:
            return secret
        # A bad share among the first t: leave out one party at a time (every holder it
        # plays), rebuilding from the first t of the others. Leaving out single holders
        # would not do: a party playing two holders with bad shares survives each try.
        def party(holder: int) -> int:
            return self._groups.get(holder, -1 - holder)

        suspects = sorted({party(h) for h in holders[:t]})[:_MAX_SUSPECTS]
        for suspect in suspects:
            rest = [h for h in holders if party(h) != suspect]
            if len(rest) >= t and self._try(shares, rest[:t], owner, ok) is not None:
                left_out = [h for h in holders if party(h) == suspect]
                for holder in left_out:
                    self._replies.pop(holder, None)
                raise SecAggError(
                    f"the shares of client {owner}'s secret held by clients {left_out} "
                    + ("" if suspect < 0 else f"(played by party {suspect}) ")
                    + "disagree with the others (their replies are discarded)", left_out[0])
        raise SecAggError(
            f"the shares of client {owner}'s secret rebuild a value that fails its commitment, "
            f"and leaving out any one party does not mend it (holders {holders})", None)

    @staticmethod
    def _try(shares: dict[int, Share], holders: Sequence[int], owner: int,
             ok: _Check) -> Optional[bytes]:
        try:
            secret = shamir_combine([shares[h] for h in holders], len(holders))
        except ValueError:
            return None
        return secret if ok(owner, secret) else None

