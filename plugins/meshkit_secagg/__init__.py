"""The built-in secure-aggregation scheme ``secagg+`` (SecAgg+): the coordinator learns the sum of a
round's updates, never one update.

Written as a third-party plugin would be, against the kernel's contract
(:mod:`meshkit.secure_aggregation`): ``scheme.py`` is all the kernel's round
sees of it (:class:`SecAggPlus`, built by the ``meshkit_secure_aggregation``
hook below from ``options.py``). The protocol itself is pure and sans-io: no
socket, no clock, no thread. What lives where:

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

import importlib
from typing import Any, Iterable

import meshkit

from meshkit_secagg.options import SecAggPlusOptions

#: Every public name, and the module it is imported from on first use (numpy and
#: cryptography stay unimported until a round needs them: listing plugins is fast).
_LAZY = {
    **dict.fromkeys(["SecAggParams", "choose_degree", "MAX_CLIENTS", "MAX_LENGTH",
                     "MIN_LEVEL_BITS", "CHECK_ELEMENTS", "masked_length"],
                    "meshkit_secagg._params"),
    **dict.fromkeys(["quantize", "dequantize"], "meshkit_secagg._quantize"),
    **dict.fromkeys(["mask_vector", "add_mod", "sub_mod", "vector_dtype", "SEED_SIZE"],
                    "meshkit_secagg._masks"),
    **dict.fromkeys(["PRIME", "Share", "SHARE_SIZE", "shamir_split", "shamir_combine"],
                    "meshkit_secagg._shamir"),
    "neighbours": "meshkit_secagg._graph",
    **dict.fromkeys(["SecAggError", "KeyAdvert", "Roster", "SealedShares", "ShareBundle",
                     "ShareDelivery", "MaskedInput", "MaskedSum", "UnmaskRequest",
                     "UnmaskReply", "MESSAGES", "decode", "MAX_CLIENT_ID", "SEALED_SIZE",
                     "payload_bytes"], "meshkit_secagg._messages"),
    **dict.fromkeys(["ClientRound", "cancelled_pairs"], "meshkit_secagg._client"),
    **dict.fromkeys(["ServerRound", "SecAggResult"], "meshkit_secagg._server"),
    **dict.fromkeys(["simulate_round", "Simulation", "STAGES"], "meshkit_secagg._simulate"),
    **dict.fromkeys(["SecAggPlus", "survivable_workers", "AUTO_DROPOUT"],
                    "meshkit_secagg.scheme"),
}

__all__ = [*_LAZY, "SecAggPlusOptions", "secagg_plus", "meshkit_secure_aggregation"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'meshkit_secagg' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def secagg_plus(options: SecAggPlusOptions) -> Any:
    """SecAgg+ (Bell et al. 2020); ``degree = 0`` is SecAgg's complete graph (Bonawitz et al. 2017)."""
    from meshkit_secagg.scheme import SecAggPlus

    return SecAggPlus(options)


@meshkit.hookimpl
def meshkit_secure_aggregation() -> Iterable[meshkit.Component]:
    return [meshkit.Component(
        "secagg+", secagg_plus, SecAggPlusOptions,
        summary="SecAgg+: pairwise masks over a k-regular graph, Shamir-shared secrets; "
                "survives dropouts (Bell et al. 2020)",
        also_known_as=("SecAggPlusWorkflow", "SecAggWorkflow"))]
