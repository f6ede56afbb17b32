"""The secure-aggregation contract: what a scheme plugin implements and the kernel's round drives.

A *secure-aggregation scheme* (kind ``secure_aggregation``, hook
``meshkit_secure_aggregation()``, table ``[secure_aggregation]`` with
``name``) masks each client's quantised update so that the coordinator
learns only the round's sum. The kernel keeps the round driver
(``meshkit/train/_rounds/secure.py``, ``_worker/secure.py``,
``_relay/secure.py``), the messages it carries (``meshkit/train/_messages/secure.py``)
and this contract; the built-in scheme ``secagg+`` is the ``meshkit_secagg``
plugin. What lives where:

* ``_contract.py``: :class:`SecureAggregationTraits`, the :class:`Scheme`,
  :class:`SchemeServer` and :class:`SchemeClient` protocols (and, for a
  scheme with the trait ``party``, :class:`PartyScheme` and
  :class:`SchemeParty`; with ``interleave``, :class:`InterleavedScheme`), the records they
  return, :class:`SecureAggregationError` (a :class:`~meshkit.ProtocolError`
  that names the client at fault);
* ``_field.py``: the arithmetic of the field every scheme sums in, the
  integers mod ``2**modulus_bits`` (:func:`add_mod`, :func:`vector_dtype`):
  a worker and a host relay fold masked vectors with it, knowing no scheme;
  and how a masked vector travels, ``modulus_bits`` bits an element
  (:func:`to_wire`, :func:`from_wire`);
* ``_signed.py``: signed rounds, for every scheme: the bytes a node key signs
  for a client's advert and for the survivor set it confirms
  (:func:`advert_message`, :func:`confirm_message`), the :class:`Roster` of
  keys that count, and the checks (:func:`check_adverts`,
  :func:`check_confirmations`) with their errors (:class:`SignatureError`,
  :class:`EquivocationError`).

docs/secure-aggregation.md is the user's guide and threat model;
docs/writing-a-plugin.md shows a scheme plugin;
:class:`meshkit.testing.SecureAggregationContract` checks one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshkit._lazy import on_first_use

if TYPE_CHECKING:
    from meshkit.secure_aggregation._contract import (MAX_CLIENT_ID, MAX_CLIENTS, MAX_LENGTH, MAX_ROW,
                                                      InterleavedScheme, PartyScheme,
                                                      RoundParams,
                                                      Scheme, SchemeChoice, SchemeClient,
                                                      SchemeParty, SchemeServer, choose,
                                                      SecureAggregationError,
                                                      SecureAggregationTraits, SecureResult,
                                                      Unmasking, scheme_traits)
    from meshkit.secure_aggregation._field import (add_mod, field_width, from_wire, pack,
                                                   packed_size, to_wire, unpack, vector_dtype)
    from meshkit.secure_aggregation._signed import (EquivocationError, Roster, SignatureError,
                                                    advert_message, check_adverts,
                                                    check_confirmations, confirm_message,
                                                    confirm_messages, sign,
                                                    verify)

#: Where each public name lives, imported on first use (a plain round never needs the
#: signed rosters and their cryptography; every process a run starts paid for all of
#: it: docs/benchmarks.md, "ci2"). The imports above are the same names for the type
#: checker (tests/kernel/test_lazy_imports.py keeps the two in step).
_WHERE: dict[str, str] = {
    "MAX_CLIENT_ID": "meshkit.secure_aggregation._contract",
    "MAX_CLIENTS": "meshkit.secure_aggregation._contract",
    "MAX_LENGTH": "meshkit.secure_aggregation._contract",
    "MAX_ROW": "meshkit.secure_aggregation._contract",
    "PartyScheme": "meshkit.secure_aggregation._contract",
    "InterleavedScheme": "meshkit.secure_aggregation._contract",
    "RoundParams": "meshkit.secure_aggregation._contract",
    "Scheme": "meshkit.secure_aggregation._contract",
    "SchemeChoice": "meshkit.secure_aggregation._contract",
    "SchemeClient": "meshkit.secure_aggregation._contract",
    "SchemeParty": "meshkit.secure_aggregation._contract",
    "SchemeServer": "meshkit.secure_aggregation._contract",
    "choose": "meshkit.secure_aggregation._contract",
    "SecureAggregationError": "meshkit.secure_aggregation._contract",
    "SecureAggregationTraits": "meshkit.secure_aggregation._contract",
    "SecureResult": "meshkit.secure_aggregation._contract",
    "Unmasking": "meshkit.secure_aggregation._contract",
    "scheme_traits": "meshkit.secure_aggregation._contract",
    "add_mod": "meshkit.secure_aggregation._field",
    "field_width": "meshkit.secure_aggregation._field",
    "from_wire": "meshkit.secure_aggregation._field",
    "pack": "meshkit.secure_aggregation._field",
    "packed_size": "meshkit.secure_aggregation._field",
    "to_wire": "meshkit.secure_aggregation._field",
    "unpack": "meshkit.secure_aggregation._field",
    "vector_dtype": "meshkit.secure_aggregation._field",
    "EquivocationError": "meshkit.secure_aggregation._signed",
    "Roster": "meshkit.secure_aggregation._signed",
    "SignatureError": "meshkit.secure_aggregation._signed",
    "advert_message": "meshkit.secure_aggregation._signed",
    "check_adverts": "meshkit.secure_aggregation._signed",
    "check_confirmations": "meshkit.secure_aggregation._signed",
    "confirm_message": "meshkit.secure_aggregation._signed",
    "confirm_messages": "meshkit.secure_aggregation._signed",
    "sign": "meshkit.secure_aggregation._signed",
    "verify": "meshkit.secure_aggregation._signed",
}

__all__ = ["SecureAggregationTraits", "Scheme", "SchemeServer", "SchemeClient", "SchemeParty",
           "PartyScheme", "InterleavedScheme", "RoundParams",
           "Unmasking", "SecureResult", "SecureAggregationError", "scheme_traits",
           "SchemeChoice", "choose",
           "MAX_CLIENTS", "MAX_CLIENT_ID", "MAX_LENGTH", "MAX_ROW", "add_mod", "vector_dtype",
           "pack", "unpack", "packed_size", "to_wire", "from_wire", "field_width",
           "Roster", "SignatureError", "EquivocationError", "advert_message", "confirm_message",
           "confirm_messages",
           "sign", "verify", "check_adverts", "check_confirmations"]


if not TYPE_CHECKING:  # the type checker reads the imports above instead
    __getattr__, __dir__ = on_first_use(__name__, _WHERE, globals())
