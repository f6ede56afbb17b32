"""The compression contract suite: what every ``[compression]`` compressor must do.

Subclass :class:`CompressionContract` and point it at your compressor::

    class TestMySketch(CompressionContract):
        component = "my-sketch"
        options = {"width": 64}

What it checks (:mod:`meshkit.compression` states the contract): the
compressor declares its :class:`~meshkit.compression.CompressionTraits`;
``encode`` returns 1-d arrays, each of the dtype and at most the length
``bounds`` declares, for vectors from one element up; it is a pure function
of the vector and the seed (the same fields, bit for bit); ``decode`` gives
a float32 vector of the size asked for; an optional ``decode_chunks`` gives
``decode``'s float32 values in order, at most ``step`` at a time; what it sends is smaller than the
float32 vector on a model-sized key; a payload whose lengths disagree with
the size (a hostile or broken peer's) is a ``ValueError``, never an
allocation or a wrong answer; and every trait it declares holds:
``unbiased`` (the mean of many encodings is within five pooled standard
errors of the vector, coordinate by coordinate), ``contractive`` (never a longer vector
than it was given), ``sparse = False`` (the payload's size does not depend on
which coordinates are large). Through the kernel, an update round-trips
(:func:`meshkit.compression.encode_update` then
:func:`~meshkit.compression.decode_contribution`) to the same state a decoder
alone gives, and a ``stateful`` compressor's residual is exactly what it left
out. An ``integer_field`` compressor's codes fit ``field_bits`` and the decoded
sum of several clients' codes is unbiased for the sum of their vectors.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pytest

from meshkit.compression import (CompressionTraits, compression_traits, decode_contribution,
                                 decode_field_sum, encode_update, field_codes, residual_name)
from meshkit.testing.support import ContractBase

__all__ = ["CompressionContract"]

#: Vector sizes every compressor must take (1 element, odd, a power of two, model-sized).
SIZES = (1, 7, 256, 5000)
#: Encodings averaged for the unbiasedness check.
DRAWS = 400


def _vector(size: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(size).astype(np.float32)
    x[:: max(1, size // 5)] *= 8  # a few large coordinates, as real updates have
    return x


class CompressionContract(ContractBase):
    """Conformance tests every meshkit compressor must pass."""

    kind: ClassVar[str] = "compression"

    def test_it_declares_its_traits(self) -> None:
        compressor = self.make()
        assert isinstance(getattr(compressor, "traits", None), CompressionTraits), (
            f"{type(compressor).__name__} must declare traits = "
            f"meshkit.compression.CompressionTraits(...): the kernel composes it by them")

    @pytest.mark.parametrize("size", SIZES)
    def test_fields_fit_their_declared_bounds(self, size: int) -> None:
        compressor = self.make()
        fields = compressor.encode(_vector(size), seed=3)
        bounds = compressor.bounds(size)
        assert set(fields) == set(bounds), (
            f"encode gave fields {sorted(fields)}, bounds declares {sorted(bounds)}")
        for name, array in fields.items():
            dtype, most = bounds[name]
            assert isinstance(array, np.ndarray) and array.ndim == 1, (
                f"field {name!r} must be a 1-d array, got {type(array).__name__}")
            assert array.dtype == np.dtype(dtype), (name, array.dtype, dtype)
            assert array.size <= most, f"field {name!r} has {array.size} > {most} elements"

    @pytest.mark.parametrize("size", SIZES)
    def test_decode_gives_a_float32_vector_of_the_size(self, size: int) -> None:
        compressor = self.make()
        out = compressor.decode(compressor.encode(_vector(size), seed=1), size)
        assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (size,)
        assert np.isfinite(out).all()

    @pytest.mark.parametrize("size", SIZES)
    @pytest.mark.parametrize("step", (1, 100, 4096, 1 << 16))
    def test_decode_chunks_gives_decodes_values_in_order(self, size: int, step: int) -> None:
        compressor = self.make()
        chunks = getattr(compressor, "decode_chunks", None)
        if chunks is None:
            pytest.skip("no decode_chunks: a linear fold decodes each key whole")
        fields = compressor.encode(_vector(size), seed=5)
        parts = list(chunks(fields, size, step))
        at = 0
        for start, part in parts:
            assert start == at and isinstance(part, np.ndarray) and part.ndim == 1 \
                and 0 < part.size <= step, (
                f"decode_chunks must give the vector in order, at most {step} coordinates "
                f"at a time: a chunk at {start} of {getattr(part, 'shape', None)}, the next "
                f"was due at {at}")
            at += part.size
        assert at == size, f"decode_chunks gave {at} of {size} coordinates"
        whole = compressor.decode(fields, size)
        # The same float32 values decode gives: a linear fold of chunks is then the fold
        # of the decoded vector, bit for bit (meshkit.compression.CompressedSum).
        np.testing.assert_array_equal(
            np.concatenate([p.astype(np.float32) for _, p in parts]), whole)

    def test_encode_is_a_pure_function_of_the_vector_and_the_seed(self) -> None:
        x = _vector(5000)
        first, second = self.make().encode(x, seed=11), self.make().encode(x.copy(), seed=11)
        assert sorted(first) == sorted(second)
        for name in first:
            assert first[name].tobytes() == second[name].tobytes(), name

    def test_what_it_sends_is_smaller_than_float32(self) -> None:
        compressor = self.make()
        sent = sum(a.nbytes for a in compressor.encode(_vector(5000), seed=0).values())
        assert sent < 5000 * 4, f"{sent} bytes for a 20000-byte float32 vector"

    def test_a_payload_whose_lengths_disagree_is_refused(self) -> None:
        compressor = self.make()
        fields = compressor.encode(_vector(256), seed=0)
        for name in fields:
            cut = {**fields, name: fields[name][:-1] if fields[name].size else fields[name]}
            if cut[name].size == fields[name].size:
                continue
            with pytest.raises(ValueError):
                compressor.decode(cut, 256)

    def test_an_unbiased_compressor_is_unbiased(self) -> None:
        compressor = self.make()
        if not compression_traits(compressor).unbiased:
            pytest.skip("it does not declare unbiased")
        x = _vector(64, seed=5)
        draws = np.stack([compressor.decode(compressor.encode(x, seed=s), x.size)
                          for s in range(DRAWS)]).astype(np.float64)
        # The standard error pooled over the coordinates: a coordinate close to a level
        # rounds the other way so rarely that its own sample spread may read 0.
        mean = draws.mean(axis=0)
        err = np.sqrt(draws.var(axis=0, ddof=1).mean() / DRAWS)
        bad = np.abs(mean - x) > 5 * err + 1e-6 * np.abs(x).max()
        assert not bad.any(), (f"coordinates {np.flatnonzero(bad)[:5]}: the mean of {DRAWS} "
                               f"encodings is outside five standard errors of the vector")

    def test_a_contractive_compressor_never_lengthens(self) -> None:
        compressor = self.make()
        if not compression_traits(compressor).contractive:
            pytest.skip("it does not declare contractive")
        for seed in range(20):
            x = _vector(300, seed)
            y = compressor.decode(compressor.encode(x, seed=seed), x.size)
            assert np.linalg.norm(y.astype(np.float64)) <= np.linalg.norm(
                x.astype(np.float64)) * (1 + 1e-6)

    def test_a_dense_compressor_sends_the_same_size_whatever_the_values(self) -> None:
        compressor = self.make()
        if compression_traits(compressor).sparse:
            pytest.skip("it declares sparse")
        sizes = {sum(a.nbytes for a in compressor.encode(_vector(500, s), seed=s).values())
                 for s in range(5)}
        assert len(sizes) == 1, sizes

    def test_an_update_round_trips_through_the_payload(self) -> None:
        compressor = self.make()
        start: dict[str, Any] = {"w": np.ones((20, 30), np.float32), "b": np.zeros(7),
                                 "steps": np.array([3]), "meta": {"v": 1}}
        fitted = {"w": start["w"] + _vector(600).reshape(20, 30), "b": np.arange(7.0),
                  "steps": np.array([4]), "meta": {"v": 1}}
        payload, residual = encode_update(compressor, start, fitted, seed=9)
        state, back = decode_contribution(compressor, payload, start)
        assert sorted(state) == sorted(start)
        assert state["steps"].tolist() == [4] and state["meta"] == {"v": 1}
        assert state["w"].dtype == np.float32 and state["w"].shape == (20, 30)
        assert state["b"].dtype == np.float64
        if compression_traits(compressor).stateful:
            assert sorted(back) == sorted(residual) == [residual_name("b"), residual_name("w")]
            sent = state["w"].astype(np.float64) - start["w"]
            full = fitted["w"].astype(np.float64) - start["w"]
            left = back[residual_name("w")].astype(np.float64).reshape(20, 30)
            np.testing.assert_allclose(sent + left, full, rtol=0, atol=1e-4)
        else:
            assert back == {} and residual == {}

    def test_an_integer_field_compressor_sums_on_one_grid(self) -> None:
        """``integer_field``: codes below ``2**field_bits``, one per coordinate, a pure
        function of the vector and the seed; the decoded sum of several clients' codes is
        unbiased for the sum of their (clipped) vectors."""
        compressor = self.make()
        if not compression_traits(compressor).integer_field:
            pytest.skip("it does not declare integer_field")
        bits = compressor.field_bits
        assert isinstance(bits, int) and 1 <= bits <= 32, (
            f"field_bits must be an int 1..32, got {bits!r}")
        clip = 4.0
        xs = [np.clip(_vector(64, seed=c), -clip, clip) for c in range(3)]
        codes = [field_codes(compressor, x, seed=9, clip_range=clip, dtype=np.dtype(np.uint32))
                 for x in xs]
        again = field_codes(compressor, xs[0].copy(), seed=9, clip_range=clip,
                            dtype=np.dtype(np.uint32))
        assert again.tobytes() == codes[0].tobytes(), "encode_field is not a pure function"
        draws = []
        for s in range(DRAWS):
            total = np.zeros(xs[0].size, np.uint64)
            for c, x in enumerate(xs):
                total += field_codes(compressor, x, seed=1000 * s + c, clip_range=clip,
                                     dtype=np.dtype(np.uint64))
            draws.append(decode_field_sum(compressor, total, clip_range=clip, count=len(xs)))
        stacked = np.stack(draws)
        mean, want = stacked.mean(axis=0), np.sum(xs, axis=0, dtype=np.float64)
        err = np.sqrt(stacked.var(axis=0, ddof=1).mean() / DRAWS)
        bad = np.abs(mean - want) > 5 * err + 1e-9 * clip
        assert not bad.any(), (f"coordinates {np.flatnonzero(bad)[:5]}: the decoded sum of "
                               f"{DRAWS} encodings is outside five standard errors of the sum")
