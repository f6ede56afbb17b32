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
  :class:`SchemeServer` and :class:`SchemeClient` protocols, the records they
  return, :class:`SecureAggregationError` (a :class:`~meshkit.ProtocolError`
  that names the client at fault);
* ``_field.py``: the arithmetic of the field every scheme sums in, the
  integers mod ``2**modulus_bits`` (:func:`add_mod`, :func:`vector_dtype`):
  a worker and a host relay fold masked vectors with it, knowing no scheme;
  and how a masked vector travels, ``modulus_bits`` bits an element
  (:func:`to_wire`, :func:`from_wire`).

docs/secure-aggregation.md is the user's guide and threat model;
docs/writing-a-plugin.md shows a scheme plugin;
:class:`meshkit.testing.SecureAggregationContract` checks one.
"""

from __future__ import annotations

from meshkit.secure_aggregation._contract import (MAX_CLIENT_ID, MAX_CLIENTS, MAX_LENGTH, MAX_ROW, RoundParams,
                                                  Scheme, SchemeChoice, SchemeClient,
                                                  SchemeServer, choose,
                                                  SecureAggregationError,
                                                  SecureAggregationTraits, SecureResult,
                                                  Unmasking, scheme_traits)
from meshkit.secure_aggregation._field import (add_mod, field_width, from_wire, pack,
                                               packed_size, to_wire, unpack, vector_dtype)

__all__ = ["SecureAggregationTraits", "Scheme", "SchemeServer", "SchemeClient", "RoundParams",
           "Unmasking", "SecureResult", "SecureAggregationError", "scheme_traits",
           "SchemeChoice", "choose",
           "MAX_CLIENTS", "MAX_CLIENT_ID", "MAX_LENGTH", "MAX_ROW", "add_mod", "vector_dtype",
           "pack", "unpack", "packed_size", "to_wire", "from_wire", "field_width"]
