"""Secure aggregation (SecAgg+): the coordinator learns the sum of a round's updates, never one update.

Pure and sans-io: no socket, no clock, no thread. The round engine carries
the messages; everything it needs is here. What lives where:

* ``_params.py``: :class:`SecAggParams` (cohort, degree, threshold,
  clip range, modulus; the modulus headroom refusal) and
  :func:`choose_degree` (degree and threshold from the tolerated dropout
  and corruption, Bell et al. 2020);
* ``_quantize.py``: :func:`quantize` / :func:`dequantize`, fixed point
  mod ``2**modulus_bits``;
* ``_masks.py``: :func:`mask_vector` (ChaCha20 keyed with a 256-bit seed),
  :func:`add_mod`, :func:`sub_mod` (what a relay folds with);
* ``_shamir.py``: :func:`shamir_split` / :func:`shamir_combine` over
  GF(2**521 - 1);
* ``_graph.py``: :func:`neighbours`, the k-regular random Harary graph
  from the round's public seed;
* ``_agreement.py``: X25519 agreement, HKDF-SHA256, AES-GCM sealing of shares;
* ``_messages.py``: every message, its bounds, :class:`SecAggError`, :func:`decode`;
* ``_client.py`` / ``_server.py``: :class:`ClientRound` and
  :class:`ServerRound`, the two state machines;
* ``_simulate.py``: :func:`simulate_round`, a whole round in one process
  (tests, benchmarks).

docs/secure-aggregation.md is the threat model: what this protects, what it
does not, and how to choose the parameters.
"""

from __future__ import annotations

from meshkit.secagg._client import ClientRound
from meshkit.secagg._graph import neighbours
from meshkit.secagg._masks import SEED_SIZE, add_mod, mask_vector, sub_mod, vector_dtype
from meshkit.secagg._messages import (MAX_CLIENT_ID, MESSAGES, SEALED_SIZE, KeyAdvert, MaskedInput,
                                      MaskedSum, Roster, SealedShares, SecAggError, ShareBundle,
                                      ShareDelivery, UnmaskReply, UnmaskRequest, decode,
                                      payload_bytes)
from meshkit.secagg._params import (CHECK_ELEMENTS, MAX_CLIENTS, MAX_LENGTH, MIN_LEVEL_BITS,
                                    SecAggParams, choose_degree, masked_length)
from meshkit.secagg._quantize import dequantize, quantize
from meshkit.secagg._server import SecAggResult, ServerRound
from meshkit.secagg._simulate import STAGES, Simulation, simulate_round
from meshkit.secagg._shamir import PRIME, SHARE_SIZE, Share, shamir_combine, shamir_split

__all__ = [
    "SecAggParams", "choose_degree", "MAX_CLIENTS", "MAX_LENGTH", "MIN_LEVEL_BITS",
    "CHECK_ELEMENTS", "masked_length",
    "quantize", "dequantize",
    "mask_vector", "add_mod", "sub_mod", "vector_dtype", "SEED_SIZE",
    "PRIME", "Share", "SHARE_SIZE", "shamir_split", "shamir_combine",
    "neighbours",
    "SecAggError", "KeyAdvert", "Roster", "SealedShares", "ShareBundle", "ShareDelivery",
    "MaskedInput", "MaskedSum", "UnmaskRequest", "UnmaskReply", "MESSAGES", "decode",
    "MAX_CLIENT_ID", "SEALED_SIZE",
    "payload_bytes", "ClientRound", "ServerRound", "SecAggResult",
    "simulate_round", "Simulation", "STAGES",
]
