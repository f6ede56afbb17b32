"""The secure round's messages (``secagg_*``, docs/protocol.md §7.2), checked like every trainer message."""

from __future__ import annotations

from typing import Any

import attrs

from meshkit.secure_aggregation import MAX_CLIENT_ID, MAX_CLIENTS, MAX_LENGTH, MAX_ROW
from meshkit.train._messages.fields import (MAX_BUDGET, MAX_COUNT, MAX_SEED, ClientIds, Compress,
                                            Integers, Masked, Rows, _between, _field, _name, _seq,
                                            _shards)


# -- secure aggregation (``[secure_aggregation]``: meshkit.train._rounds.secure) ---------------

def _ids_field(doc: str) -> Any:
    return _field("client ids", doc)


def _width(rows: Any, width: int | None, what: str, count: int | None = None) -> None:
    """Rows of ``width`` bytes (None: the scheme's width, 1 to MAX_ROW, which the round
    checks against the scheme's traits), ``count`` of them when given."""
    if width is None and not 1 <= rows.shape[1] <= MAX_ROW:
        raise ValueError(f"{what} rows are {rows.shape[1]} bytes wide; they must be 1 to "
                         f"{MAX_ROW}")
    if width is not None and rows.shape[1] != width:
        raise ValueError(f"{what} rows are {rows.shape[1]} bytes wide; they must be {width}")
    if count is not None and rows.shape[0] != count:
        raise ValueError(f"{what} has {rows.shape[0]} rows for {count} entries")


def _aligned(message: Any, *names: str) -> None:
    counts = {name: len(getattr(message, name)) for name in names}
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"{name} has {count}" for name, count in counts.items())
        raise ValueError(f"{' and '.join(names)} must have one entry each per row: {shown}")


def _rows_per_entry(message: Any, rows: str, *names: str) -> None:
    """The lists ``names`` hold one entry each per row of ``rows`` (the scheme's width)."""
    _aligned(message, *names)
    _width(getattr(message, rows), None, rows, len(getattr(message, names[0])))


def _any_ids(_: Any, attribute: Any, value: list[int]) -> None:
    if not all(0 <= v <= MAX_CLIENT_ID for v in value):
        raise ValueError(f"{attribute.name} must hold client ids 0..{MAX_CLIENT_ID}")


def _any_ids_field(doc: str) -> Any:
    """Client ids in any order, repeats allowed: one a row (``_ids_field``: sorted, distinct)."""
    return _field("list of client ids", doc, check=_any_ids)


@attrs.frozen(kw_only=True)
class SecAggKeysRequest:
    """Secure round, step 1: start a ClientRound for each of ``clients``; send their adverts."""

    seq: int = _seq(0)
    round: int = _field("int 0..2^31", "the round (named in logs and errors)",
                        check=_between(0, MAX_COUNT))
    clients: ClientIds = _ids_field("the clients this worker plays this round (1 or more)")
    cohort: int = _field("int 2..65536", "the cohort size the round is set up for",
                         check=_between(2, MAX_CLIENTS))
    degree: int = _field("int 0..65536", "neighbours per client (0: complete graph)",
                         check=_between(0, MAX_CLIENTS))
    threshold: int = _field("int 1..65536", "shares that rebuild a client's secret",
                            check=_between(1, MAX_CLIENTS))
    clip_range: float = _field("float (0, 1e12]", "each coordinate of an update is clipped to "
                               "[-clip_range, clip_range] before it is quantised",
                               check=_between(1e-300, 1e12))
    modulus_bits: int = _field("int 1..64", "masked vectors are integers mod 2^modulus_bits",
                               check=_between(1, 64))
    round_seed: Rows = _field("bytes 1x32", "the round's public seed (the graph, the keys' "
                                            "derivations)")
    length: int = _field("int 1..2^31", "elements of an update (the model's float arrays)",
                         check=_between(1, MAX_LENGTH))
    scheme: str | None = _field("string", "the `[secure_aggregation] name` of the round's scheme "
                                "(absent: the default, secagg+)", optional=True,
                                check=lambda _, a, v: None if _name(v, a.name) else None)
    input_bits: int | None = _field("int 1..32", "`[compression]`: the inputs are a compressor's "
                                    "codes below 2^input_bits, and `modulus_bits` is input_bits "
                                    "+ ceil(log2 cohort) (absent: the scheme quantises)",
                                    optional=True, check=_between(1, 32))

    def __attrs_post_init__(self) -> None:
        if not self.clients:
            raise ValueError("clients must name at least one client")
        _width(self.round_seed, 32, "round_seed", 1)


@attrs.frozen(kw_only=True)
class SecAggKeysReply:
    """Each client's fresh public keys and self-mask seed commitment."""

    seq: int = _seq()
    clients: ClientIds = _ids_field("the clients advertising, the request's")
    adverts: Rows = _field("bytes nxA", "per client: its advert (A: the scheme's advert_size; "
                                        "secagg+: share key, mask key, seed commitment, 32 "
                                        "bytes each)")
    signer: Rows | None = _field("bytes 1x32", "a signed round (docs/protocol.md §7.2.2): the "
                                 "worker's node key (Ed25519 public key)", optional=True)
    signatures: Rows | None = _field("bytes nx64", "with `signer`: per client, its Ed25519 "
                                     "signature of its advert (§7.2.2)", optional=True)

    def __attrs_post_init__(self) -> None:
        _width(self.adverts, None, "adverts", len(self.clients))
        _signed(self, "signer", "signatures", len(self.clients), one_signer=True)


@attrs.frozen(kw_only=True)
class SecAggShareRequest:
    """Step 2: who advertised, with every advert; each client seals shares for its neighbours."""

    seq: int = _seq(0)
    members: ClientIds = _ids_field("every client that advertised (the graph's members)")
    adverts: Rows = _field("bytes nxA", "each member's advert, in `members` order")
    signers: Rows | None = _field("bytes nx32", "a signed round: the node key that signed "
                                  "each member's advert, in `members` order", optional=True)
    signatures: Rows | None = _field("bytes nx64", "with `signers`: each member's advert "
                                     "signature (§7.2.2)", optional=True)

    def __attrs_post_init__(self) -> None:
        _width(self.adverts, None, "adverts", len(self.members))
        _signed(self, "signers", "signatures", len(self.members))


@attrs.frozen(kw_only=True)
class SecAggShareReply:
    """The sealed shares of this worker's clients, one row per (sender, recipient)."""

    seq: int = _seq()
    senders: Integers = _any_ids_field("the client that sealed each row")
    recipients: Integers = _any_ids_field("the neighbour each row is sealed to")
    sealed: Rows = _field("bytes nxS", "the sealed rows (S: the scheme's sealed_size; secagg+: "
                                       "200, an ephemeral X25519 key, then AES-GCM)")

    def __attrs_post_init__(self) -> None:
        _rows_per_entry(self, "sealed", "senders", "recipients")


@attrs.frozen(kw_only=True)
class SecAggOpenRequest:
    """Step 3: the sealed shares delivered to this worker's clients, to open before anyone masks."""

    seq: int = _seq(0)
    clients: ClientIds = _ids_field("the clients the shares are for (each shared this round)")
    senders: Integers = _any_ids_field("who sealed each delivered row")
    recipients: Integers = _any_ids_field("which of `clients` each row is for")
    sealed: Rows = _field("bytes nxS", "the sealed rows delivered to `clients`")

    def __attrs_post_init__(self) -> None:
        if not self.clients:
            raise ValueError("clients must name at least one client")
        _rows_per_entry(self, "sealed", "senders", "recipients")


@attrs.frozen(kw_only=True)
class SecAggOpenReply:
    """The accusations: each (sender, recipient) whose sealed share did not open."""

    seq: int = _seq()
    senders: Integers = _any_ids_field("the sealer of each share that did not "
                                "open")
    recipients: Integers = _any_ids_field("the client of this worker it did not "
                                   "open for")

    def __attrs_post_init__(self) -> None:
        _aligned(self, "senders", "recipients")


@attrs.frozen(kw_only=True)
class SecAggRevealRequest:
    """Step 3b, only after an accusation: the ephemeral keys this worker's clients sealed with."""

    seq: int = _seq(0)
    senders: Integers = _any_ids_field("the accused sealers (this worker's "
                                "clients)")
    recipients: Integers = _any_ids_field("the accusers, in `senders` order")

    def __attrs_post_init__(self) -> None:
        if not self.senders:
            raise ValueError("senders must name at least one client")
        _aligned(self, "senders", "recipients")


@attrs.frozen(kw_only=True)
class SecAggRevealReply:
    """The ephemeral private key each accused share was sealed with, in the request's order."""

    seq: int = _seq()
    keys: Rows = _field("bytes nxR", "the keys (R: the scheme's reveal_size; secagg+: 32, an "
                                     "X25519 ephemeral private key), each opening one sealed "
                                     "row, nothing else")

    def __attrs_post_init__(self) -> None:
        _width(self.keys, None, "keys")


#: A distributed-DP masking request's fields (all or none).
DDP_FIELDS = ("ddp_scale", "ddp_variance", "ddp_bound", "ddp_half", "ddp_noise")


def _one_of_noise(_: Any, attribute: Any, value: Any) -> None:
    if value not in ("os", "seeded"):
        raise ValueError(f"{attribute.name} must be \"os\" or \"seeded\", got {value!r}")


@attrs.frozen(kw_only=True)
class SecAggMaskRequest:
    """Step 4: fit each client, then mask its quantised update with the neighbours that shared."""

    seq: int = _seq(0)
    clients: ClientIds = _ids_field("the clients to fit and mask (each shared this round)")
    seeds: Integers = _field("list of int 0..2^64-1", "each client's fit seed, in `clients` "
                              "order", check=lambda _, a, v: _each(a, v, 0, MAX_SEED))
    shards: int = _shards()
    excluded: ClientIds = _ids_field("clients taken out of the round after the shares were "
                                     "opened: nobody masks with them")
    time_budget: float | None = _field("float (0, 1e7]", "seconds each fit may take",
                                       optional=True, check=_between(1e-9, MAX_BUDGET))
    clip_norm: float | None = _field("float (0, 1e300]", "`[privacy] clip = \"client\"`: clip "
                                     "each update to this L2 norm first", optional=True,
                                     check=_between(1e-300, 1e300))
    compress: Compress | None = _field("compressor", "`[compression]`: quantise each update "
                                       "onto the round's shared grid with this compressor "
                                       "(docs/compression.md, \"Under secure aggregation\"), "
                                       "not the scheme; `raw` is unused here", optional=True)
    ddp_scale: float | None = _field("float (0, 1e300]", "`[privacy] placement = "
                                     "\"distributed\"`: grid steps per unit of the clipped "
                                     "update (s)", optional=True, check=_between(1e-300, 1e300))
    ddp_variance: float | None = _field("float (0, 1e300]", "the Skellam variance each client "
                                        "adds to each coordinate on the grid", optional=True,
                                        check=_between(1e-300, 1e300))
    ddp_bound: float | None = _field("float (0, 1e300]", "the L2 norm on the grid conditional "
                                     "rounding keeps each update within (the accounted "
                                     "sensitivity)", optional=True,
                                     check=_between(1e-300, 1e300))
    ddp_half: int | None = _field("int 1..2^53", "each noised coordinate is offset by this "
                                  "into [0, 2 ddp_half], the client's share of the field",
                                  optional=True, check=_between(1, 1 << 53))
    ddp_noise: str | None = _field("\"os\" or \"seeded\"", "the noise's randomness: the "
                                   "OS's, or the client's fit seed (testing only)",
                                   optional=True, check=_one_of_noise)

    def __attrs_post_init__(self) -> None:
        if not self.clients:
            raise ValueError("clients must name at least one client")
        ddp = [getattr(self, k) is None for k in DDP_FIELDS]
        if any(ddp) and not all(ddp):
            raise ValueError("the ddp_* fields come all together or not at all")
        if not all(ddp) and (self.clip_norm is None or self.compress is not None):
            raise ValueError("ddp_* fields need clip_norm, and exclude compress")
        _aligned(self, "clients", "seeds")
        if set(self.clients) & set(self.excluded):
            raise ValueError("a client to mask cannot be excluded")
        if any(c >= self.shards for c in self.clients):
            raise ValueError(f"a client id must be below shards = {self.shards}")


@attrs.frozen(kw_only=True)
class SecAggMaskReply:
    """The modular sum of this worker's clients' masked inputs (a worker folds its own)."""

    seq: int = _seq()
    clients: ClientIds = _ids_field("the clients whose masked inputs `vector` adds up")
    vector: Masked = _field("uint32, uint64 or uint8 array", "their masked inputs' sum mod "
                            "2^modulus_bits: the uint32 (modulus_bits 32) or uint64 (64) "
                            "array itself, else packed into bytes, modulus_bits bits an "
                            "element (§7.2, the types)")
    elements: int | None = _field("int 1..2^31", "present exactly when `vector` is packed: "
                                  "its elements", optional=True, check=_between(1, MAX_LENGTH))

    def __attrs_post_init__(self) -> None:
        if not self.clients:
            raise ValueError("clients must name at least one client")
        _packing(self.vector, self.elements)


def _survivors(message: Any) -> None:
    if not message.clients or set(message.clients) - set(message.survivors):
        raise ValueError("clients must be survivors, at least one")
    if set(message.survivors) & set(message.dropped):
        raise ValueError("a client cannot be both a survivor and dropped")


@attrs.frozen(kw_only=True)
class SecAggConfirmRequest:
    """Step 5a, a signed round only: the survivor set, for each survivor to sign (§7.2.2)."""

    seq: int = _seq(0)
    clients: ClientIds = _ids_field("this worker's survivors, who confirm")
    survivors: ClientIds = _ids_field("every client whose masked input is in the sum")
    dropped: ClientIds = _ids_field("every client that shared but sent no masked input")

    def __attrs_post_init__(self) -> None:
        _survivors(self)


@attrs.frozen(kw_only=True)
class SecAggConfirmReply:
    """Each client's signature of the survivor and dropped sets it was told."""

    seq: int = _seq()
    clients: ClientIds = _ids_field("the clients confirming, the request's")
    signer: Rows = _field("bytes 1x32", "the worker's node key (the one that signed their "
                                        "adverts)")
    signatures: Rows = _field("bytes nx64", "per client, its Ed25519 signature of the sets "
                                            "(§7.2.2)")

    def __attrs_post_init__(self) -> None:
        _signed(self, "signer", "signatures", len(self.clients), one_signer=True)


@attrs.frozen(kw_only=True)
class SecAggUnmaskRequest:
    """Step 5: whose masked input is in the sum (survivors) and who dropped after sharing."""

    seq: int = _seq(0)
    clients: ClientIds = _ids_field("this worker's survivors, who answer")
    survivors: ClientIds = _ids_field("every client whose masked input is in the sum")
    dropped: ClientIds = _ids_field("every client that shared but sent no masked input")
    confirmed: ClientIds | None = _field("client ids", "a signed round: the survivors whose "
                                         "confirmation the coordinator collected (§7.2.2)",
                                         optional=True)
    confirm_signers: Rows | None = _field("bytes nx32", "with `confirmed`: the node key of "
                                          "each confirmation, in `confirmed` order",
                                          optional=True)
    confirm_signatures: Rows | None = _field("bytes nx64", "with `confirmed`: each "
                                             "confirmation's signature", optional=True)

    def __attrs_post_init__(self) -> None:
        _survivors(self)
        if (self.confirmed is None) != (self.confirm_signers is None):
            raise ValueError("confirmed and confirm_signers are given together or not at all")
        _signed(self, "confirm_signers", "confirm_signatures", len(self.confirmed or ()))
        if set(self.confirmed or ()) - set(self.survivors):
            raise ValueError("a confirmation from a client that is not a survivor")


@attrs.frozen(kw_only=True)
class SecAggUnmaskReply:
    """The shares each survivor holds: of the survivors' self-mask seeds, the dropped's keys."""

    seq: int = _seq()
    holders: Integers = _any_ids_field("the survivor holding each share row")
    owners: Integers = _any_ids_field("whose secret each row is a share of")
    kinds: Integers = _field("list of int 0..1", "0: a self-mask seed's share, 1: a mask "
                              "key's", check=lambda _, a, v: _each(a, v, 0, 1))
    shares: Rows = _field("bytes nxH", "the unmasking shares (H: the scheme's share_size; "
                                      "secagg+: 70, a Shamir share)")

    def __attrs_post_init__(self) -> None:
        _rows_per_entry(self, "shares", "holders", "owners", "kinds")


def _signed(message: Any, signers: str, signatures: str, count: int,
            one_signer: bool = False) -> None:
    """Signatures (64 bytes, ``count`` of them) given exactly with their signer keys (32 bytes:
    one row, or one a signature)."""
    keys, sigs = getattr(message, signers), getattr(message, signatures)
    if (keys is None) != (sigs is None):
        raise ValueError(f"{signers} and {signatures} are given together or not at all")
    if keys is None:
        return
    _width(keys, 32, signers, 1 if one_signer else count)
    _width(sigs, 64, signatures, count)


def _packing(vector: Any, elements: int | None) -> None:
    """A packed (uint8) masked vector names its elements; a whole one does not."""
    if (vector.dtype == "uint8") != (elements is not None):
        raise ValueError("elements must be given exactly when the vector is packed (uint8)")


def _each(attribute: Any, values: list[int], low: int, high: int) -> None:
    if not all(low <= v <= high for v in values):
        raise ValueError(f"{attribute.name} must hold integers {low}..{high}")


#: The secure round's ops (docs/protocol.md §7.2).
SECURE_REQUESTS: dict[str, type] = {
    "secagg_keys": SecAggKeysRequest,
    "secagg_share": SecAggShareRequest,
    "secagg_open": SecAggOpenRequest,
    "secagg_reveal": SecAggRevealRequest,
    "secagg_mask": SecAggMaskRequest,
    "secagg_confirm": SecAggConfirmRequest,
    "secagg_unmask": SecAggUnmaskRequest,
}
SECURE_REPLIES: dict[str, type] = {
    "secagg_keys": SecAggKeysReply,
    "secagg_share": SecAggShareReply,
    "secagg_open": SecAggOpenReply,
    "secagg_reveal": SecAggRevealReply,
    "secagg_mask": SecAggMaskReply,
    "secagg_confirm": SecAggConfirmReply,
    "secagg_unmask": SecAggUnmaskReply,
}
