"""The secure-aggregation scheme contract suite: what the kernel's round relies on, checked in one process.

Subclass :class:`SecureAggregationContract`, set ``component`` (and
``options``), and pytest collects the checks. Each drives the scheme the
way ``meshkit/train/_rounds/secure.py`` does -- the five steps of
:mod:`meshkit.secure_aggregation`, byte rows between its coordinator side
and one client side per client -- without processes or sockets, so a
failure names the step. What is checked:

* its traits are declared and agree with the round it plans, and the
  parameters a worker rebuilds from the keys request are the coordinator's;
* every row is the width its traits declare;
* the unmasked sum is the exact sum mod ``2**modulus_bits`` of the clients'
  quantised updates, and dequantises to their clipped sum within one
  quantisation step of ``2 clip_range clients / 2**modulus_bits`` each;
* a masked input is not its update, and the masks cancel only in the full
  sum (the sum of all but one masked input is not those clients' sum);
* up to the dropouts it declares (``tolerates_dropouts``, and
  :meth:`Scheme.describe`'s ``survives_losing_clients``) the survivors' sum is
  revealed exactly; past them, or any dropout for a scheme that declares
  none, the round is refused -- never a sum of the wrong clients;
* a scheme with the trait ``party`` gives, with its clients built as the
  parties of several workers (each masked reply one party's sum), the
  same exact sums, a party's sum is not its clients' plain sum, and a
  party lost before masking is a dropout like any other;
* a share sealed wrongly is named (between two clients of one party too):
  its recipient accuses the sender and
  ``judge`` blames the sender, while an accusation of a good share blames
  the accuser; a tampered unmasking share is named (or outvoted), never
  unmasked into a wrong sum; a masked input of the wrong shape is refused
  naming its client;
* a scheme that declares ``integer_inputs`` plans, for ``b``-bit inputs, the
  field of ``b + ceil(log2 clients)`` bits, a worker rebuilds it, and the
  unmasked sum of codes at the top of their range is their exact sum.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence, cast

import attrs
import numpy as np
import pytest

from meshkit.errors import RefusedError
from meshkit.secure_aggregation import (InterleavedScheme, PartyScheme, RoundParams, Scheme,
                                        SchemeClient, SchemeParty, SchemeServer,
                                        SecureAggregationError, SecureAggregationTraits,
                                        SecureResult, add_mod, field_width, scheme_traits,
                                        vector_dtype)
from meshkit.testing.support import ContractBase

__all__ = ["SecureAggregationContract", "Round"]

#: The round's public seed in every check (the kernel draws a fresh one per round).
SEED = bytes(range(32))


def _row(row: Any, width: int, what: str) -> bytes:
    assert isinstance(row, (bytes, bytearray)) and len(row) == width, (
        f"{what}: a row of {len(row) if isinstance(row, (bytes, bytearray)) else repr(row)} "
        f"bytes; the scheme's traits declare {width}")
    return bytes(row)


@attrs.define
class Round:
    """One round driven as the kernel drives it, a method a step, so a check can tamper
    between two. ``Round(scheme, clients, length).run(quantised)`` plays it whole.

    ``parties`` (a scheme with the trait ``party`` only): the clients are
    played by that many workers, round-robin as the kernel plans them, each
    built as one :class:`SchemeParty` and masking as one sum; 0 builds each
    client alone. ``interleave`` (a scheme with that trait, with ``parties``):
    the clients are dealt round-robin in the scheme's ``order(SEED, cohort)``
    and ``plan`` is told ``interleave=parties``, as the kernel does.
    """

    scheme: Scheme
    clients: int
    length: int
    #: > 0: the inputs are integers below 2**input_bits (a scheme with integer_inputs).
    input_bits: int = 0
    parties: int = 0
    interleave: bool = False
    traits: SecureAggregationTraits = attrs.field(init=False)
    params: RoundParams = attrs.field(init=False)
    server: SchemeServer = attrs.field(init=False)
    sides: dict[int, SchemeClient] = attrs.field(init=False)
    adverts: dict[int, bytes] = attrs.field(init=False, factory=dict)
    members: list[int] = attrs.field(init=False, factory=list)
    deliveries: dict[int, list[tuple[int, bytes]]] = attrs.field(init=False, factory=dict)
    excluded: tuple[int, ...] = attrs.field(init=False, default=())
    masked: dict[int, np.ndarray] = attrs.field(init=False, factory=dict)
    #: party -> its clients (round-robin), and the parties built (``parties`` > 0).
    groups: dict[int, list[int]] = attrs.field(init=False, factory=dict)
    built: dict[int, SchemeParty] = attrs.field(init=False, factory=dict)
    #: Each party's masked reply: the clients it adds up, and their sum.
    sums: dict[int, tuple[tuple[int, ...], np.ndarray]] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        self.traits = scheme_traits(self.scheme)
        narrowed = {"input_bits": self.input_bits} if self.input_bits else {}
        cohort = list(range(self.clients))
        dealt: Sequence[int] = cohort
        planned: dict[str, int] = dict(narrowed)
        if self.interleave:
            assert self.traits.interleave and self.parties, (
                "interleave needs a scheme with the trait interleave, and parties > 0")
            dealt = [int(c) for c in cast(InterleavedScheme, self.scheme).order(SEED, cohort)]
            assert sorted(dealt) == cohort, (
                f"order(seed, {cohort}) is {dealt}, not a permutation of the cohort")
            planned["interleave"] = min(self.parties, self.clients)
        if self.parties:
            assert self.traits.party, "parties > 0 needs a scheme with the trait party"
            for i, client in enumerate(dealt):
                self.groups.setdefault(i % self.parties, []).append(client)
            self.groups = {p: sorted(cs) for p, cs in self.groups.items()}
        self.params = self.scheme.plan(
            self.clients, max((len(cs) for cs in self.groups.values()), default=1), **planned)
        self.server = self.scheme.server(
            self.params, cohort, SEED, self.length,
            {c: p for p, cs in self.groups.items() for c in cs} or {c: c for c in cohort})
        # Each client is built as a worker builds it: from the keys request's fields.
        rebuilt = self.scheme.params(
            clients=self.params.clients, degree=self.params.degree,
            threshold=self.params.threshold, clip_range=self.params.clip_range,
            modulus_bits=self.params.modulus_bits, **narrowed)
        if not self.parties:
            self.sides = {c: self.scheme.client(rebuilt, c, SEED, self.length) for c in cohort}
            return
        self.sides = {}
        for party, clients in self.groups.items():
            self.built[party] = cast(PartyScheme, self.scheme).party(rebuilt, clients, SEED,
                                                                     self.length)
            sides = dict(self.built[party].clients)
            assert sorted(sides) == clients, (
                f"party(...) for clients {clients} built clients {sorted(sides)}")
            self.sides.update(sides)

    def advertise(self, lost: Sequence[int] = ()) -> None:
        for client, side in self.sides.items():
            if client not in lost:
                self.adverts[client] = _row(side.advertise(), self.traits.advert_size,
                                            "advertise()")
                self.server.receive_advert(client, self.adverts[client])
        self.members = self.server.members()

    def share(self, lost: Sequence[int] = (), garble: tuple[int, int] | None = None) -> None:
        """Step 2; ``garble = (sender, recipient)``: that sender seals that row wrongly."""
        for client in self.members:
            if client in lost:
                continue
            rows = [(int(r), _row(b, self.traits.sealed_size, "share()"))
                    for r, b in self.sides[client].share(self.members, self.adverts)]
            if garble is not None and garble[0] == client:
                rows = [(r, b if r != garble[1] else bytes(x ^ 0x5A for x in b))
                        for r, b in rows]
            self.server.receive_shares(client, rows)
        self.deliveries = self.server.deliveries()

    def open(self) -> list[tuple[int, int]]:
        """Step 3: every (sender, recipient) accusation, settled: the party at fault excluded."""
        accusations = [(int(s), r) for r in sorted(self.deliveries)
                       for s in self.sides[r].open(self.deliveries[r])]
        faulty = set()
        for sender, recipient in accusations:
            key = _row(self.sides[sender].reveal(recipient), self.traits.reveal_size, "reveal()")
            faulty.add(self.server.judge(sender, recipient, key))
        if faulty:
            self.excluded = tuple(self.server.exclude(sorted(faulty)))
        return accusations

    def mask(self, quantised: dict[int, np.ndarray], lost: Sequence[int] = ()) -> None:
        bits = self.params.modulus_bits
        if self.parties:
            self._mask_parties(quantised, lost)
            return
        for client in sorted(self.deliveries):
            if client in lost or client in self.excluded:
                continue
            vector = self.sides[client].mask(quantised[client], list(self.excluded))
            assert isinstance(vector, np.ndarray) and vector.ndim == 1 \
                and vector.dtype == vector_dtype(bits), (
                    f"mask(): client {client}'s masked input is {vector!r:.80}; it must be a 1-d "
                    f"{vector_dtype(bits)} vector (integers mod 2**{bits})")
            self.masked[client] = vector
            self.server.receive_masked((client,), vector)

    def _mask_parties(self, quantised: dict[int, np.ndarray], lost: Sequence[int]) -> None:
        """Step 4 as a worker plays it: each party told whom it sums, then one sum each."""
        bits = self.params.modulus_bits
        for party, clients in sorted(self.groups.items()):
            summed = [c for c in clients if c in self.deliveries and c not in lost
                      and c not in self.excluded]
            if not summed:
                continue
            self.built[party].summing(summed)
            total = np.zeros(0, vector_dtype(bits))
            for client in summed:
                vector = self.sides[client].mask(quantised[client], list(self.excluded))
                total = vector.copy() if not total.size else add_mod(total, vector, bits,
                                                                     out=total)
            self.sums[party] = (tuple(summed), total)
            self.server.receive_masked(tuple(summed), total)

    def unmask(self, lost: Sequence[int] = (), tamper: int | None = None) -> SecureResult:
        """Step 5; ``tamper``: that holder's first share row has a byte flipped."""
        told = self.server.unmasking()
        for holder in told.holders:
            if holder in lost:
                continue
            rows = [(int(o), int(k), _row(s, self.traits.share_size, "unmask()"))
                    for o, k, s in self.sides[holder].unmask(told.survivors, told.dropped)]
            if holder == tamper and rows:
                owner, kind, share = rows[0]
                rows[0] = (owner, kind, bytes([share[0] ^ 1]) + share[1:])
            self.server.receive_unmask(holder, rows)
        return self.server.finish()

    def until_masked(self, quantised: dict[int, np.ndarray], lost: Sequence[int] = ()) -> None:
        """Steps 1-4, the ``lost`` clients leaving after they shared."""
        self.advertise()
        self.share()
        self.open()
        self.mask(quantised, lost=lost)

    def run(self, quantised: dict[int, np.ndarray]) -> SecureResult:
        self.until_masked(quantised)
        return self.unmask()


class SecureAggregationContract(ContractBase):
    """Conformance tests every secure-aggregation scheme must pass (module docstring)."""

    kind: ClassVar[str] = "secure_aggregation"
    #: Clients in each checked round (at least the scheme's ``min_clients``).
    clients: ClassVar[int] = 8
    #: Elements of each client's update.
    length: ClassVar[int] = 257

    def updates(self, scheme: Scheme, params: RoundParams, seed: int = 0
                ) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
        """Float updates (some past ``clip_range``) and their quantised form, per client."""
        rng = np.random.default_rng(seed)
        floats = {c: rng.normal(0.0, params.clip_range * 0.6, self.length)
                  for c in range(self.clients)}
        return floats, {c: scheme.quantize(x, params) for c, x in floats.items()}

    def exact(self, quantised: dict[int, np.ndarray], clients: Sequence[int],
              bits: int) -> np.ndarray:
        total = np.zeros(next(iter(quantised.values())).shape, vector_dtype(bits))
        for client in clients:
            add_mod(total, quantised[client], bits, out=total)
        return total

    def round(self) -> Round:
        scheme = self.make()
        assert scheme_traits(scheme).min_clients <= self.clients, (
            f"the scheme serves at least {scheme_traits(scheme).min_clients} clients; set "
            f"`clients` on the suite")
        return Round(scheme, self.clients, self.length)

    def test_the_traits_are_declared_and_the_round_agrees_with_them(self) -> None:
        play = self.round()
        assert play.params.modulus_bits == play.traits.modulus_bits, (
            f"plan() sums mod 2**{play.params.modulus_bits}, the traits declare "
            f"modulus_bits = {play.traits.modulus_bits}")
        assert play.params.clients == self.clients, (
            f"plan({self.clients}) set up a round of {play.params.clients} clients")
        rebuilt = play.scheme.params(
            clients=play.params.clients, degree=play.params.degree,
            threshold=play.params.threshold, clip_range=play.params.clip_range,
            modulus_bits=play.params.modulus_bits)
        fields = ("clients", "degree", "threshold", "clip_range", "modulus_bits")
        assert [getattr(rebuilt, f) for f in fields] == [getattr(play.params, f)
                                                         for f in fields], (
            "params(...) from the keys request's fields is not the round plan() made: a "
            "worker would play another round")

    def test_the_unmasked_sum_is_the_exact_sum_of_the_quantised_updates(self) -> None:
        play = self.round()
        floats, quantised = self.updates(play.scheme, play.params)
        result = play.run(quantised)
        everyone = list(range(self.clients))
        assert tuple(result.contributors) == tuple(everyone), (
            f"every client masked; the result names {result.contributors}")
        np.testing.assert_array_equal(
            result.total, self.exact(quantised, everyone, play.params.modulus_bits),
            err_msg="the unmasked total is not the sum mod 2**modulus_bits of the clients' "
                    "quantised updates")
        clipped = sum(np.clip(x, -play.params.clip_range, play.params.clip_range)
                      for x in floats.values())
        step = 2 * play.params.clip_range * self.clients / 2.0 ** play.params.modulus_bits
        got = play.scheme.dequantize(result.total, play.params, self.clients)
        np.testing.assert_allclose(got, clipped, rtol=0, atol=self.clients * step + 1e-12,
                                   err_msg="dequantize(the sum) is not the clipped updates' sum "
                                           "to within a quantisation step each")

    def test_a_masked_input_hides_its_update_and_masks_cancel_only_in_the_full_sum(self) -> None:
        play = self.round()
        _, quantised = self.updates(play.scheme, play.params)
        play.until_masked(quantised)
        bits = play.params.modulus_bits
        for client, vector in play.masked.items():
            size = min(vector.size, quantised[client].size)
            same = np.mean(vector[:size] == quantised[client][:size])
            assert same < 0.5, (
                f"client {client}'s masked input equals its quantised update in {same:.0%} of "
                f"its coordinates: it is not masked")
        some = sorted(play.masked)[1:]
        partial = np.zeros(next(iter(play.masked.values())).shape, vector_dtype(bits))
        for client in some:
            add_mod(partial, play.masked[client], bits, out=partial)
        size = quantised[0].size
        assert not np.array_equal(partial[:size], self.exact(quantised, some, bits)), (
            "the masked inputs of all clients but one add up to their plain sum: the masks "
            "cancel in a partial sum, so the coordinator learns who-knows-what by leaving one out")

    def test_dropouts_up_to_the_declared_tolerance_reveal_the_survivors_sum(self) -> None:
        play = self.round()
        _, quantised = self.updates(play.scheme, play.params)
        lost = []
        if play.traits.tolerates_dropouts:
            facts = play.scheme.describe(play.params, [1] * self.clients)
            tolerated = int(facts["survives_losing_clients"])
            assert 0 <= tolerated < self.clients, (
                f"describe() says a round survives losing {tolerated} of {self.clients} clients")
            lost = list(range(1, 1 + min(tolerated, self.clients - 3)))
        if not lost:
            pytest.skip("the scheme declares no dropout it survives")
        play.until_masked(quantised, lost=lost)
        result = play.unmask(lost=lost)
        survivors = [c for c in range(self.clients) if c not in lost]
        assert tuple(result.contributors) == tuple(survivors) and set(result.dropped) == set(
            lost), (f"{lost} dropped before masking; the result names contributors "
                    f"{result.contributors} and dropped {result.dropped}")
        np.testing.assert_array_equal(
            result.total, self.exact(quantised, survivors, play.params.modulus_bits),
            err_msg="with the declared dropouts, the total is not the survivors' exact sum")

    def test_a_dropout_past_the_tolerance_is_refused_never_a_wrong_sum(self) -> None:
        play = self.round()
        _, quantised = self.updates(play.scheme, play.params)
        tolerated = 0
        if play.traits.tolerates_dropouts:
            tolerated = int(play.scheme.describe(play.params, [1] * self.clients)[
                "survives_losing_clients"])
        lost = list(range(1, 2 + tolerated))
        if self.clients - len(lost) < 1:
            pytest.skip("the scheme survives losing every client but one")
        play.until_masked(quantised, lost=lost)
        try:
            result = play.unmask(lost=lost)
        except (RefusedError, SecureAggregationError):
            return
        survivors = [c for c in range(self.clients) if c not in lost]
        np.testing.assert_array_equal(
            result.total, self.exact(quantised, list(result.contributors),
                                     play.params.modulus_bits),
            err_msg=f"{len(lost)} clients dropped, past the {tolerated} the scheme declares, "
                    f"and it revealed a total that is not its contributors' sum")
        assert set(result.contributors) <= set(survivors)

    def test_clients_built_as_parties_sum_exactly_and_a_lost_party_is_a_dropout(self) -> None:
        if not scheme_traits(self.make()).party:
            pytest.skip("the scheme builds each client alone (no trait party)")
        play = Round(self.make(), self.clients, self.length, parties=3)
        _, quantised = self.updates(play.scheme, play.params)
        bits = play.params.modulus_bits
        lost: list[int] = []
        if play.traits.tolerates_dropouts:
            loads = [len(cs) for cs in play.groups.values()]
            tolerated = int(play.scheme.describe(play.params, loads)["survives_losing_clients"])
            if len(play.groups[2]) <= tolerated:
                lost = list(play.groups[2])  # a worker lost before masking: all its clients
        play.until_masked(quantised, lost=lost)
        for party, (clients, total) in play.sums.items():
            size = quantised[0].size
            assert not np.array_equal(total[:size], self.exact(quantised, clients, bits)), (
                f"party {party}'s masked sum is its clients' {list(clients)} plain sum")
        result = play.unmask(lost=lost)
        survivors = [c for c in range(self.clients) if c not in lost]
        assert tuple(result.contributors) == tuple(survivors), (
            f"parties {sorted(play.groups)} ({lost} lost) masked; the result names "
            f"{result.contributors}")
        np.testing.assert_array_equal(
            result.total, self.exact(quantised, survivors, bits),
            err_msg="with the clients built as parties, each masking as one sum, the total is "
                    "not the survivors' exact sum")

    def test_an_interleaving_scheme_orders_the_cohort_and_survives_what_it_declares(
            self) -> None:
        if not scheme_traits(self.make()).interleave:
            pytest.skip("the kernel deals its cohort in client order (no trait interleave)")
        scheme = cast(InterleavedScheme, self.make())
        cohort = list(range(self.clients))
        first = [int(c) for c in scheme.order(SEED, cohort)]
        assert sorted(first) == cohort, f"order(seed, {cohort}) is {first}: not a permutation"
        assert [int(c) for c in scheme.order(SEED, cohort)] == first, (
            "order(...) is not a function of the seed and the cohort: the kernel and the "
            "scheme's own graph would disagree")
        play = Round(scheme, self.clients, self.length, parties=3, interleave=True)
        _, quantised = self.updates(play.scheme, play.params)
        loads = [len(cs) for cs in play.groups.values()]
        lost: list[int] = []
        if play.traits.tolerates_dropouts and scheme.describe(
                play.params, loads, interleave=3)["survives_losing_workers"] >= 1:
            lost = list(play.groups[1])  # the workers it survives losing: lose one
        play.until_masked(quantised, lost=lost)
        result = play.unmask(lost=lost)
        survivors = [c for c in cohort if c not in lost]
        assert tuple(result.contributors) == tuple(survivors), (
            f"dealt along order(...) over 3 parties ({lost} lost), the result names "
            f"{result.contributors}")
        np.testing.assert_array_equal(
            result.total, self.exact(quantised, survivors, play.params.modulus_bits),
            err_msg="dealt along order(...) and planned with interleave, the total is not the "
                    "survivors' exact sum")

    def test_a_share_sealed_wrongly_is_named_and_its_sender_blamed(self) -> None:
        play = self.round()
        play.advertise()
        play.share()
        senders = {s for rows in play.deliveries.values() for s, _ in rows}
        if not senders:
            pytest.skip("the scheme seals no share to another client")
        recipient = min(play.deliveries)
        sender = play.deliveries[recipient][0][0]
        play = self.round()
        accused = _open_garbled(play, sender, recipient)
        if accused is None:
            return  # refused already: the server would not route it
        assert sender in accused, (
            f"client {sender} sealed garbage to client {recipient}, whose open() named "
            f"{list(accused)}")
        key = play.sides[sender].reveal(recipient)
        assert play.server.judge(sender, recipient, key) == sender, (
            "judge() did not blame the sender of a share that does not open under its key")

    def test_a_share_garbled_between_two_clients_of_one_party_is_named(self) -> None:
        if not scheme_traits(self.make()).party:
            pytest.skip("the scheme builds each client alone (no trait party)")
        play = Round(self.make(), self.clients, self.length, parties=2)
        play.advertise()
        play.share()
        pairs = [(s, r) for r, rows in play.deliveries.items() for s, _ in rows
                 if s % 2 == r % 2]
        if not pairs:
            pytest.skip("the scheme seals no share between two clients of one party")
        sender, recipient = pairs[0]
        accused = _open_garbled(Round(self.make(), self.clients, self.length, parties=2),
                                sender, recipient)
        if accused is None:
            return  # refused already: the server would not route it
        assert sender in accused, (
            f"client {sender} sealed garbage to client {recipient}, both played by one party; "
            f"{recipient}'s open() named {list(accused)}: a party's clients must open what "
            f"the coordinator delivers, not trust what their peer meant to send")

    def test_an_accusation_of_a_good_share_blames_the_accuser(self) -> None:
        play = self.round()
        play.advertise()
        play.share()
        rows = [(r, s) for r, got in play.deliveries.items() for s, _ in got]
        if not rows:
            pytest.skip("the scheme seals no share to another client")
        recipient, sender = rows[0]
        key = play.sides[sender].reveal(recipient)
        assert play.server.judge(sender, recipient, key) == recipient, (
            "judge() blamed the sender of a share that opens: a liar could evict any client")

    def test_a_tampered_unmasking_share_is_named_or_outvoted_never_unmasked_wrongly(
            self) -> None:
        play = self.round()
        _, quantised = self.updates(play.scheme, play.params)
        play.until_masked(quantised)
        try:
            result = play.unmask(tamper=0)
        except SecureAggregationError as exc:
            assert exc.client == 0, (
                f"client 0's unmasking share was tampered; the error blames {exc.client}: {exc}")
            return
        np.testing.assert_array_equal(
            result.total, self.exact(quantised, list(result.contributors),
                                     play.params.modulus_bits),
            err_msg="a tampered unmasking share was unmasked into a wrong total")

    def test_a_masked_input_of_the_wrong_shape_is_refused_naming_its_client(self) -> None:
        play = self.round()
        play.advertise()
        play.share()
        play.open()
        client = min(play.deliveries)
        bad = np.zeros(self.length // 2, vector_dtype(play.params.modulus_bits))
        with pytest.raises(SecureAggregationError) as caught:
            play.server.receive_masked((client,), bad)
        assert caught.value.client == client, (
            f"a masked input of the wrong length from client {client} blamed "
            f"{caught.value.client}")

    def test_integer_inputs_are_summed_exactly_in_the_narrow_field(self) -> None:
        scheme = self.make()
        if not scheme_traits(scheme).integer_inputs:
            pytest.skip("it does not declare integer_inputs")
        bits = 8
        play = Round(scheme, self.clients, self.length, input_bits=bits)
        field = field_width(bits, self.clients)
        assert play.params.modulus_bits == field, (
            f"plan({self.clients}, input_bits={bits}) sums mod 2**"
            f"{play.params.modulus_bits}; {bits}-bit inputs of {self.clients} clients need "
            f"exactly {field} (meshkit.secure_aggregation.field_width)")
        rng = np.random.default_rng(4)
        codes = {c: rng.integers(0, 1 << bits, self.length).astype(vector_dtype(field))
                 for c in range(self.clients)}
        for c in codes:
            codes[c][:3] = (1 << bits) - 1  # every client at the top: the sum still fits
        result = play.run(codes)
        want = np.sum([codes[c].astype(np.int64) for c in range(self.clients)], axis=0)
        assert int(want.max()) < 1 << field
        np.testing.assert_array_equal(
            result.total.astype(np.int64), want,
            err_msg="the unmasked total of integer inputs is not their exact sum")


def _open_garbled(play: Round, sender: int, recipient: int) -> Sequence[int] | None:
    """What ``recipient`` accuses once ``sender``'s share to it was garbled on the way
    (None: the server refused to route the garbled share at all)."""
    play.advertise()
    play.share(garble=(sender, recipient))
    if recipient not in play.deliveries:
        return None
    return list(play.sides[recipient].open(play.deliveries[recipient]))
