"""What compression composes with under secure aggregation, decided by both sides' traits."""

from __future__ import annotations

import pytest

import meshkit.plugins
from meshkit import RefusedError
from meshkit.compression import CompressionPlan, check_compression
from meshkit.secure_aggregation import SecureAggregationTraits


def _plan(name: str, **options) -> CompressionPlan:
    return CompressionPlan(name, options, meshkit.plugins.create("compression", name, options))


def _scheme(integer_inputs: bool) -> SecureAggregationTraits:
    return SecureAggregationTraits(modulus_bits=32, advert_size=96, sealed_size=200,
                                   share_size=70, reveal_size=32,
                                   integer_inputs=integer_inputs)


def test_dense_quantisation_composes_with_a_scheme_that_masks_integer_inputs():
    check_compression(_plan("quantize", bits=8), where="job.toml", private_client_clip=False,
                      secure=_scheme(True))


@pytest.mark.parametrize("plan, integer_inputs, words", [
    (lambda: _plan("top-k", fraction=0.01), True,
     ["CompressionTraits.sparse", "coordinates each client moved"]),
    (lambda: _plan("quantize", bits=8, rotate=True), True,
     ["CompressionTraits.integer_field", "rotate = false"]),
    (lambda: _plan("quantize", bits=4), False,
     ["SecureAggregationTraits.integer_inputs"]),
])
def test_what_cannot_sum_in_the_field_is_refused_naming_the_trait(plan, integer_inputs, words):
    with pytest.raises(RefusedError) as caught:
        check_compression(plan(), where="job.toml", private_client_clip=False,
                          secure=_scheme(integer_inputs))
    message = str(caught.value)
    for word in ["job.toml", "with [secure_aggregation]", *words]:
        assert word in message, (word, message)
