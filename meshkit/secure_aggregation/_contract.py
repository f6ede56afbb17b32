"""What a secure-aggregation scheme declares and implements, for the kernel's round to drive it.

Rule: the kernel's secure round (``meshkit/train/_rounds/secure.py`` on the
coordinator, ``_worker/secure.py`` on a worker) carries a scheme's bytes
between its two sides and decides by its :class:`SecureAggregationTraits`
only; it never names a scheme. The round has the shape of the SecAgg family
(Bonawitz et al. 2017, Bell et al. 2020), five steps, each a request to every
worker and a reply:

1. *keys*: each client's :meth:`SchemeClient.advertise` (one row of
   ``advert_size`` bytes) goes to :meth:`SchemeServer.receive_advert`;
   :meth:`SchemeServer.members` closes the step;
2. *share*: every member's advert goes to every client,
   :meth:`SchemeClient.share` answers rows of ``sealed_size`` bytes for other
   clients (none for a scheme that shares no secret), routed by
   :meth:`SchemeServer.receive_shares` / :meth:`SchemeServer.deliveries`;
3. *open*: each client opens what was delivered to it
   (:meth:`SchemeClient.open`) and names the senders whose rows did not
   open; the kernel settles each accusation before anyone masks, asking the
   accused for a key of ``reveal_size`` bytes (:meth:`SchemeClient.reveal`)
   and the server who is at fault (:meth:`SchemeServer.judge`), and takes the
   party at fault out (:meth:`SchemeServer.exclude`);
4. *mask*: each client's update, quantised by :meth:`Scheme.quantize`, is
   masked (:meth:`SchemeClient.mask`); workers and relays add masked vectors
   mod ``2**modulus_bits`` (:func:`meshkit.secure_aggregation.add_mod`) and
   the server folds them (:meth:`SchemeServer.receive_masked`). A scheme
   with the trait ``party`` is told, before any of a worker's clients
   masks, which of them that worker adds into its one reply
   (:meth:`SchemeParty.summing`);
5. *unmask*: :meth:`SchemeServer.unmasking` says who is asked and who
   survived, each asked client answers rows of ``share_size`` bytes
   (:meth:`SchemeClient.unmask`), and :meth:`SchemeServer.finish` returns the
   exact integer sum, dequantised by :meth:`Scheme.dequantize`.

A malformed or refused row is a :class:`SecureAggregationError` naming the
client at fault when it can: the kernel drops that client's rank and goes on.
Too few clients left to unmask without weakening the guarantee is a
:class:`~meshkit.RefusedError`: the round has no result.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Protocol, Sequence

import attrs
import numpy as np

from meshkit import plugins
from meshkit.errors import ProtocolError

__all__ = ["SecureAggregationTraits", "Scheme", "SchemeServer", "SchemeClient", "SchemeParty",
           "PartyScheme", "InterleavedScheme", "RoundParams",
           "Unmasking", "SecureResult", "SecureAggregationError", "scheme_traits",
           "SchemeChoice", "choose",
           "MAX_CLIENTS", "MAX_CLIENT_ID", "MAX_LENGTH", "MAX_ROW"]

#: The largest cohort one secure round may have.
MAX_CLIENTS = 1 << 16
#: Client ids are 0 to this (the wire's bound; a run's clients number far fewer).
MAX_CLIENT_ID = (1 << 32) - 2
#: The longest vector one secure round may sum (elements).
MAX_LENGTH = 1 << 31
#: The widest row (advert, sealed share, unmasking share, revealed key) a scheme may declare.
MAX_ROW = 1 << 16


class SecureAggregationError(ProtocolError):
    """A scheme's message that does not fit its protocol; ``client`` is the client at fault.

    The kernel drops the rank that played ``client`` (or sent the message,
    when ``client`` is None) with this as its reason, and the round goes on.
    """

    def __init__(self, message: str, client: Optional[int] = None) -> None:
        super().__init__(message)
        self.client = client


def _flag(_: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"SecureAggregationTraits.{attribute.name} must be True or False, got "
                        f"{value!r}")


def _between(low: int, high: int) -> Any:
    def check(_: Any, attribute: Any, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"SecureAggregationTraits.{attribute.name} must be an integer "
                             f"{low} to {high}, got {value!r}")
    return check


@attrs.frozen(kw_only=True)
class SecureAggregationTraits:
    """What a scheme declares it is (frozen; the kernel's only reading of one).

    * ``modulus_bits``: the field: masked vectors, and the sum the scheme
      reveals, are integers mod ``2**modulus_bits`` (1 to 64); a worker and a
      relay add them there;
    * ``advert_size``, ``sealed_size``, ``share_size``, ``reveal_size``: the
      bytes of one row of each step (a key advert, a share sealed to a
      neighbour, an unmasking share, a revealed key), 1 to :data:`MAX_ROW`;
      the kernel refuses a row of any other width before the scheme sees it;
    * ``tolerates_dropouts``: a client lost after it advertised leaves the
      round and the others' sum is still revealed (SecAgg+ rebuilds its
      masks from threshold shares). Without it, a round that loses a client
      is refused naming this trait, and ``meshkit check`` says so;
    * ``threshold``: the scheme rebuilds secrets from ``threshold`` of their
      shares (``meshkit check`` shows the threshold and how many losses a
      round survives: :meth:`Scheme.describe`);
    * ``min_clients``, ``max_clients``: the cohort sizes it serves (at least
      3: with two clients each learns the other's update from the sum); a
      configuration that samples outside them is refused naming the trait;
    * ``integer_inputs``: the scheme masks integers the kernel quantised
      itself (a compressor's codes on a grid every client shares, below
      ``2**input_bits``) in a field the round narrows to
      ``input_bits + ceil(log2 clients)`` bits (:func:`field_width`):
      :meth:`Scheme.plan` and :meth:`Scheme.params` take ``input_bits`` and
      :meth:`Scheme.quantize` / :meth:`Scheme.dequantize` are not used.
      Without it ``[compression]`` with this scheme is refused naming the
      trait.
    * ``party``: the scheme builds the clients one worker plays in a round
      together (:meth:`PartyScheme.party`, a :class:`SchemeParty`), and is
      told which of them the worker sums into its one masked reply before
      they mask, so it may skip work among them that the sum cancels or
      that one of them already did (SecAgg+: the pairwise masks between two
      of them). Without it, each client is built alone (:meth:`Scheme.client`).
    * ``interleave``: the scheme orders each round's cohort
      (:meth:`InterleavedScheme.order`, from the round's seed) and the kernel
      places it on the live workers round-robin in that order, telling
      :meth:`Scheme.plan` and :meth:`Scheme.describe` how many workers it
      interleaved (SecAgg+: a member's ring neighbours then fall on the
      workers evenly, and ``degree = "auto"`` needs far fewer of them).
      Without it, or with clients pinned to workers, the kernel places the
      cohort round-robin in client order.
    """

    modulus_bits: int = attrs.field(validator=_between(1, 64))
    advert_size: int = attrs.field(validator=_between(1, MAX_ROW))
    sealed_size: int = attrs.field(validator=_between(1, MAX_ROW))
    share_size: int = attrs.field(validator=_between(1, MAX_ROW))
    reveal_size: int = attrs.field(validator=_between(1, MAX_ROW))
    tolerates_dropouts: bool = attrs.field(default=False, validator=_flag)
    threshold: bool = attrs.field(default=False, validator=_flag)
    min_clients: int = attrs.field(default=3, validator=_between(3, MAX_CLIENTS))
    max_clients: int = attrs.field(default=MAX_CLIENTS, validator=_between(3, MAX_CLIENTS))
    integer_inputs: bool = attrs.field(default=False, validator=_flag)
    party: bool = attrs.field(default=False, validator=_flag)
    interleave: bool = attrs.field(default=False, validator=_flag)


class RoundParams(Protocol):
    """What every party of one round agrees on (the public fields of the keys request).

    ``clients`` the cohort size; ``degree`` the neighbours each client masks
    with (0: every other client); ``threshold`` the shares that rebuild a
    secret (1 for a scheme without); ``clip_range`` the coordinate clip
    before quantising; ``modulus_bits`` the field.
    """

    @property
    def clients(self) -> int: ...
    @property
    def degree(self) -> int: ...
    @property
    def threshold(self) -> int: ...
    @property
    def clip_range(self) -> float: ...
    @property
    def modulus_bits(self) -> int: ...


@attrs.frozen
class Unmasking:
    """Step 5's request: ``holders`` are asked; every one is told the same two sets."""

    holders: tuple[int, ...]
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]


@attrs.frozen(eq=False)
class SecureResult:
    """What :meth:`SchemeServer.finish` reveals: the sum of the ``contributors``' inputs.

    ``total`` is the exact integer sum mod ``2**modulus_bits`` of their
    quantised updates; ``dropped`` shared their secrets but sent no masked
    input (their masks were cancelled).
    """

    total: np.ndarray
    contributors: tuple[int, ...]
    dropped: tuple[int, ...] = ()


class SchemeServer(Protocol):
    """The coordinator's side of one round (module docstring, steps 1-5), called in order.

    Every ``receive_*`` raises :class:`SecureAggregationError` for a row it
    refuses (naming the client at fault); a step that leaves too few clients
    raises :class:`~meshkit.RefusedError`.
    """

    def receive_advert(self, client: int, advert: bytes) -> None: ...
    def members(self) -> list[int]:
        """Close step 1: the clients whose advert was accepted, sorted."""
    def receive_shares(self, client: int, rows: Sequence[tuple[int, bytes]]) -> None:
        """``rows`` are ``(recipient, sealed)`` pairs sealed by ``client``."""
    def deliveries(self) -> dict[int, list[tuple[int, bytes]]]:
        """Close step 2: each client that may mask, with its ``(sender, sealed)`` rows."""
    def judge(self, sender: int, recipient: int, key: Optional[bytes]) -> int:
        """The client at fault for an accusation: ``sender`` or ``recipient``."""
    def exclude(self, clients: Iterable[int]) -> tuple[int, ...]:
        """Take ``clients`` out before masking; return every client taken out."""
    def receive_masked(self, clients: tuple[int, ...], vector: np.ndarray) -> None:
        """The sum mod ``2**modulus_bits`` of ``clients``' masked inputs."""
    def unmasking(self) -> Unmasking: ...
    def receive_unmask(self, holder: int, rows: Sequence[tuple[int, int, bytes]]) -> None:
        """``rows`` are ``(owner, kind, share)`` from ``holder``."""
    def finish(self) -> SecureResult: ...


class SchemeClient(Protocol):
    """One client's side of one round (module docstring, steps 1-5)."""

    def advertise(self) -> bytes: ...
    def share(self, members: Sequence[int], adverts: Mapping[int, bytes]
              ) -> list[tuple[int, bytes]]:
        """``(recipient, sealed)`` rows for this client's neighbours among ``members``."""
    def open(self, delivered: Sequence[tuple[int, bytes]]) -> tuple[int, ...]:
        """Open the ``(sender, sealed)`` rows; return the senders whose rows did not open."""
    def reveal(self, recipient: int) -> bytes:
        """The key that opens what this client sealed to ``recipient`` (and nothing else)."""
    def mask(self, quantised: np.ndarray, excluded: Sequence[int]) -> np.ndarray:
        """The masked input, never masking with the ``excluded`` clients."""
    def unmask(self, survivors: Sequence[int], dropped: Sequence[int]
               ) -> list[tuple[int, int, bytes]]:
        """``(owner, kind, share)`` rows that unmask the survivors' sum."""


class SchemeParty(Protocol):
    """The clients one worker plays in one round, built together (the trait ``party``).

    ``clients`` maps each client id to its :class:`SchemeClient`, which the
    worker drives step by step as it would a client built alone. Before a
    mask request's clients mask, the worker calls :meth:`summing` with
    exactly the clients whose masked inputs it adds, mod
    ``2**modulus_bits``, into its one reply, and it sends that sum or
    nothing. Their masked inputs may then leave out what cancels in that
    sum: each is a masked input only as part of it, and the sum is what the
    clients' separate masked inputs would add up to, bit for bit.
    """

    @property
    def clients(self) -> Mapping[int, SchemeClient]: ...
    def summing(self, clients: Sequence[int]) -> None:
        """The clients (sorted) whose masked inputs the worker adds into one reply."""


class Scheme(Protocol):
    """What a ``meshkit_secure_aggregation`` factory builds (from ``[secure_aggregation]``).

    The coordinator calls :meth:`plan` (refusing a cohort it cannot serve
    with a :class:`~meshkit.ConfigError` naming the option, or a
    :class:`~meshkit.RefusedError`), then :meth:`server`; a worker rebuilds
    the round's parameters from the keys request (:meth:`params`) and plays
    each client with :meth:`client`. A worker builds the scheme with its
    default options: everything a client needs travels in
    :class:`RoundParams`.
    """

    traits: SecureAggregationTraits

    def plan(self, clients: int, per_worker: int = 1, input_bits: int = 0) -> RoundParams:
        """The round's parameters; ``input_bits`` > 0 (a scheme with the trait
        ``integer_inputs`` only): the inputs are integers below ``2**input_bits`` and
        the field is :func:`field_width` of them and ``clients`` bits wide."""
    def params(self, *, clients: int, degree: int, threshold: int, clip_range: float,
               modulus_bits: int, input_bits: int = 0) -> RoundParams:
        """The parameters a keys request carries (``input_bits`` as in :meth:`plan`)."""
    def describe(self, params: RoundParams, loads: Sequence[int]) -> dict[str, Any]:
        """What ``meshkit check`` shows of a round whose workers play ``loads`` clients each."""
    def server(self, params: RoundParams, cohort: Sequence[int], round_seed: bytes,
               length: int, groups: Mapping[int, int]) -> SchemeServer:
        """``groups[c]`` is the rank that plays client c (a bad share is searched by rank)."""
    def client(self, params: RoundParams, client: int, round_seed: bytes,
               length: int) -> SchemeClient: ...
    def quantize(self, values: np.ndarray, params: RoundParams) -> np.ndarray:
        """A float update as integers mod ``2**modulus_bits`` (clipped to ``clip_range``)."""
    def dequantize(self, total: np.ndarray, params: RoundParams,
                   contributors: int) -> np.ndarray:
        """The float64 sum of ``contributors`` clipped updates whose quantised sum is ``total``."""


class InterleavedScheme(Scheme, Protocol):
    """A :class:`Scheme` with the trait ``interleave``: it says how to place a cohort.

    Unless the run pins clients to workers (``[partitioner] name = "local"``),
    the kernel draws the round's seed first, asks :meth:`order`, and places
    the cohort on its ``W`` live workers round-robin in that order (position
    ``i`` on the ``i mod W``-th); it then calls ``plan(..., interleave=W)``
    and, for ``meshkit check``, ``describe(..., interleave=W)``, so the
    scheme may plan for that placement (a ring graph's neighbours fall on
    the workers evenly, not at random).
    """

    def order(self, round_seed: bytes, cohort: Sequence[int]) -> Sequence[int]:
        """The ``cohort`` (a permutation of it) in the order the kernel interleaves."""
    def plan(self, clients: int, per_worker: int = 1, input_bits: int = 0,
             interleave: int = 0) -> RoundParams:
        """As :meth:`Scheme.plan`; ``interleave`` > 0: placed on that many workers."""
    def describe(self, params: RoundParams, loads: Sequence[int],
                 interleave: int = 0) -> dict[str, Any]:
        """As :meth:`Scheme.describe`; ``interleave`` as in :meth:`plan`."""


class PartyScheme(Scheme, Protocol):
    """A :class:`Scheme` with the trait ``party``: one worker's clients are built together."""

    def party(self, params: RoundParams, clients: Sequence[int], round_seed: bytes,
              length: int) -> SchemeParty:
        """The ``clients`` (sorted) one worker plays this round, as one :class:`SchemeParty`."""


@attrs.frozen
class SchemeChoice:
    """The scheme a run selected (``[secure_aggregation] name``) and the scheme it built."""

    name: str
    scheme: Scheme = attrs.field(eq=False)

    @property
    def traits(self) -> SecureAggregationTraits:
        return scheme_traits(self.scheme)


def choose(name: str, options: Mapping[str, Any] | None = None) -> SchemeChoice:
    """The scheme ``name`` built with ``options`` through the plugins (tests, notebooks)."""
    return SchemeChoice(name, plugins.create("secure_aggregation", name, options))


def scheme_traits(scheme: Any) -> SecureAggregationTraits:
    """``scheme.traits``, checked: a scheme must declare its field and row widths."""
    traits = scheme.traits if hasattr(scheme, "traits") else None
    if not isinstance(traits, SecureAggregationTraits):
        raise TypeError(f"{type(scheme).__name__}.traits is {traits!r}; a secure-aggregation "
                        f"scheme declares meshkit.secure_aggregation.SecureAggregationTraits"
                        f"(modulus_bits=..., advert_size=..., ...)")
    return traits
