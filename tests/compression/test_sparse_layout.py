"""top-k's packed layouts (``meshkit_compression.sparse``): indices as uint8 gaps with fillers,
values as 8- or 4-bit codes with one scale a key -- what they send, what they decode to, and
what a hostile payload gets (a ValueError from the decoder, a ProtocolError for its worker)."""

from __future__ import annotations

import numpy as np
import pytest

import meshkit.plugins
from meshkit.compression import (SEP, CompressedSum, decode_contribution, encode_update,
                                 residual_name)
from meshkit.errors import ConfigError, ProtocolError

LAYOUTS = [(index, bits) for index in ("u32", "gap8") for bits in (32, 8, 4)]


def _top(fraction=0.05, **options):
    return meshkit.plugins.create("compression", "top-k", {"fraction": fraction, **options})


def _spiky(size, seed=0):
    x = np.random.default_rng(seed).standard_normal(size).astype(np.float32)
    x[::97] *= 20
    return x


def test_the_defaults_keep_todays_fields_and_bits():
    top = _top(0.01)
    x = _spiky(3000)
    fields = top.encode(x, seed=0)
    assert sorted(fields) == ["index", "value"]
    assert fields["index"].dtype == np.uint32 and fields["value"].dtype == np.float32
    assert fields["index"].size == 30
    kept = fields["index"].astype(np.int64)
    assert fields["value"].tobytes() == x[kept].tobytes()
    assert top.bounds(3000) == {"index": (np.dtype(np.uint32), 30),
                                "value": (np.dtype(np.float32), 30)}


@pytest.mark.parametrize("index, bits", LAYOUTS)
def test_every_layout_keeps_the_same_coordinates(index, bits):
    x = _spiky(5000, seed=2)
    plain = _top(0.02).decode(_top(0.02).encode(x, seed=1), x.size)
    top = _top(0.02, index=index, value_bits=bits)
    out = top.decode(top.encode(x, seed=1), x.size)
    kept = np.flatnonzero(plain)
    assert np.flatnonzero(out).tolist() == [i for i in kept if out[i] != 0]
    assert set(np.flatnonzero(out)) <= set(kept)
    if bits == 32:
        assert out.tobytes() == plain.tobytes()
    else:  # to the nearest code: within half a step of the value
        step = np.float32(np.abs(x[kept]).max()) / {8: 127, 4: 7}[bits]
        assert np.abs(out[kept] - x[kept]).max() <= step / 2 * (1 + 1e-5)


def test_gaps_past_255_are_bridged_by_fillers_of_gap_255_and_value_0():
    x = np.zeros(2000, np.float32)
    x[[3, 700, 701, 1999]] = [5.0, -4.0, 3.0, 2.0]
    top = _top(4 / 2000, index="gap8", value_bits=8)
    fields = top.encode(x, seed=0)
    # 3: gap 4; 700: 697 = 255 + 255 + 187; 701: 1; 1999: 1298 = 5 * 255 + 23
    assert fields["gap"].tolist() == [4, 255, 255, 187, 1, 255, 255, 255, 255, 255, 23]
    codes = fields["code"].tolist()
    assert codes[0] == 127 and codes[1:3] == [0, 0] and codes[5:10] == [0] * 5
    assert fields["gap"].size <= top.bounds(2000)["gap"][1] == 4 + 2000 // 255
    out = top.decode(fields, 2000)
    assert np.flatnonzero(out).tolist() == [3, 700, 701, 1999]
    np.testing.assert_allclose(out[[3, 700, 701, 1999]], [5.0, -4.0, 3.0, 2.0],
                               rtol=0, atol=5.0 / 127 / 2 * 1.0001)


def test_the_fillers_stay_within_the_declared_bound_at_the_worst_spacing():
    size = 255 * 40 + 17
    x = np.zeros(size, np.float32)
    x[-1] = 1.0  # one kept coordinate at the very end: the most fillers a key can need
    top = _top(1 / size, index="gap8", value_bits=4)
    fields = top.encode(x, seed=0)
    assert fields["gap"].size == 1 + (size - 1) // 255 <= top.bounds(size)["gap"][1]
    assert top.decode(fields, size)[-1] == 1.0


def test_4_bit_codes_pack_two_a_byte_and_an_odd_count_pads_with_zero():
    x = np.array([7.0, -7.0, 3.0, 0.5, -1.0], np.float32)
    top = _top(1.0, index="u32", value_bits=4)
    fields = top.encode(x, seed=0)
    assert fields["code"].tolist() == [0x97, 0x03 | (0 << 4), 0x0F]  # 7,-7 | 3,0 | -1,pad
    assert fields["scale"].tolist() == [1.0]
    assert top.decode(fields, 5).tolist() == [7.0, -7.0, 3.0, 0.0, -1.0]


def test_without_error_feedback_the_codes_round_at_random_unbiased():
    x = _spiky(64, seed=4)
    top = _top(0.25, index="gap8", value_bits=4, error_feedback=False)
    draws = np.stack([top.decode(top.encode(x, seed=s), x.size) for s in range(600)])
    assert len({d.tobytes() for d in draws[:20]}) > 1  # the seed matters
    plain = _top(0.25, error_feedback=False)
    kept = np.flatnonzero(plain.decode(plain.encode(x, seed=0), x.size))
    assert set(np.flatnonzero(draws.any(axis=0))) == set(kept)  # the same coordinates
    err = np.sqrt(draws[:, kept].var(axis=0, ddof=1).mean() / len(draws))
    assert np.abs(draws[:, kept].mean(axis=0) - x[kept]).max() < 5 * err + 1e-6
    ef = _top(0.25, index="gap8", value_bits=4)
    assert ef.encode(x, seed=1)["code"].tobytes() == ef.encode(x, seed=2)["code"].tobytes()


@pytest.mark.parametrize("index, bits", LAYOUTS)
def test_the_residual_is_exactly_what_the_payload_left_out(index, bits):
    top = _top(0.04, index=index, value_bits=bits)
    rng = np.random.default_rng(7)
    start = {"w": rng.standard_normal((40, 50)).astype(np.float32)}
    fitted = {"w": start["w"] + _spiky(2000, seed=3).reshape(40, 50) * 0.01}
    old = {"w": rng.standard_normal(2000).astype(np.float32) * 0.001}
    payload, kept = encode_update(top, start, fitted, seed=5, residual=old)
    u = (fitted["w"].astype(np.float64).ravel() - start["w"].astype(np.float64).ravel()
         ).astype(np.float32) + old["w"]
    fields = {k.split(SEP)[1]: v for k, v in payload.items()
              if k.startswith(f"w{SEP}") and k != residual_name("w")}
    want = u - top.decode(fields, u.size)
    assert kept[residual_name("w")].tobytes() == want.tobytes()
    state, back = decode_contribution(top, payload, start)
    assert back[residual_name("w")].tobytes() == want.tobytes()
    if bits != 32:  # rounded to the nearest code: the residual holds the rounding error
        assert np.abs(want[np.flatnonzero(top.decode(fields, u.size))]).max() > 0


def _payload(index, bits, size=3000, fraction=0.01, ef=False):
    top = _top(fraction, index=index, value_bits=bits, error_feedback=ef)
    start = {"w": np.zeros(size, np.float32)}
    payload, _ = encode_update(top, start, {"w": _spiky(size, seed=1)}, seed=3)
    return top, start, payload


def _hostile():
    """(layout, how the payload is broken, what the refusal says)."""
    g, c, s, v = f"w{SEP}gap", f"w{SEP}code", f"w{SEP}scale", f"w{SEP}value"

    def gaps_past_n(p):
        p[g] = p[g].copy()
        p[g][-1] = 255
        p[g][:-1] = np.maximum(p[g][:-1], 200)

    def zero_gap(p):
        p[g] = p[g].copy()
        p[g][3] = 0

    def code(p, value):
        p[c] = p[c].copy()
        p[c][0] = value

    return [
        (("gap8", 8), gaps_past_n, "past the key's 3000"),
        (("gap8", 8), zero_gap, "a gap is 0"),
        (("gap8", 8), lambda p: p.update({g: p[g][:-1]}), "code bytes for"),
        (("gap8", 8), lambda p: p.update({g: p[g][:20], c: p[c][:20]}), "20 gaps"),
        (("gap8", 32), lambda p: p.update({v: p[v][:-1]}), "values for"),
        (("gap8", 8), lambda p: p.update({s: np.array([np.nan], np.float32)}), "the scale"),
        (("gap8", 8), lambda p: p.update({s: np.array([np.inf], np.float32)}), "the scale"),
        (("gap8", 8), lambda p: p.update({s: np.array([-1.0], np.float32)}), "the scale"),
        (("gap8", 8), lambda p: p.update({s: np.array([3e37], np.float32)}), "levels stay"),
        (("gap8", 8), lambda p: code(p, -128), "beyond ±127"),
        (("gap8", 4), lambda p: code(p, 0x88), "beyond ±7"),
        (("u32", 4), lambda p: p.update({c: p[c][:-1]}), "code bytes for"),
        (("u32", 8), lambda p: p.update({f"w{SEP}index": p[f"w{SEP}index"][::-1].copy()}),
         "ascending, distinct"),
    ]


@pytest.mark.parametrize("layout, break_it, words", _hostile())
def test_a_hostile_payload_is_refused_by_the_decoder_and_costs_its_worker(layout, break_it,
                                                                        words):
    top, start, payload = _payload(*layout)
    break_it(payload)
    fields = {k.split(SEP)[1]: v for k, v in payload.items()}
    with pytest.raises(ValueError, match=words):
        top.decode(fields, 3000)
    with pytest.raises(ProtocolError, match="client 4"):
        decode_contribution(top, payload, start, what="client 4")
    folded = CompressedSum(top, start, step=500)
    with pytest.raises(ProtocolError, match="client 4"):
        folded.add(payload, 1.0, source="client 4")
    assert folded.count == 0 and not folded.sums["w"].any()


def test_a_payload_over_the_declared_length_is_refused_before_decoding():
    top, start, payload = _payload("gap8", 8)
    most = top.bounds(3000)["gap"][1]
    payload[f"w{SEP}gap"] = np.ones(most + 1, np.uint8)
    with pytest.raises(ProtocolError, match=f"at most {most} elements"):
        decode_contribution(top, payload, start, what="client 2")


def test_an_odd_count_whose_padding_nibble_is_not_zero_is_refused():
    top = _top(1.0, index="u32", value_bits=4, error_feedback=False)
    fields = top.encode(np.arange(1, 6, dtype=np.float32), seed=0)
    fields["code"] = fields["code"].copy()
    fields["code"][-1] |= 0x10
    with pytest.raises(ValueError, match="padding nibble"):
        top.decode(fields, 5)


@pytest.mark.parametrize("index, bits, ef, contractive", [
    ("u32", 32, False, True), ("gap8", 32, False, True), ("gap8", 8, False, False),
    ("u32", 4, False, False), ("gap8", 32, True, False)])
def test_only_float32_values_without_feedback_are_contractive(index, bits, ef, contractive):
    traits = _top(0.1, index=index, value_bits=bits, error_feedback=ef).traits
    assert traits.contractive is contractive and traits.sparse and not traits.unbiased
    assert traits.stateful is ef


@pytest.mark.parametrize("options, words", [
    ({"value_bits": 16}, "value_bits must be 32, 8 or 4"),
    ({"value_bits": True}, "value_bits"),
    ({"index": "u16"}, "index"),
])
def test_an_unknown_layout_is_refused_naming_the_choices(options, words):
    with pytest.raises((ConfigError, ValueError), match=words):
        meshkit.plugins.create("compression", "top-k", options)


def test_gap8_with_8_bit_values_sends_at_most_a_quarter_of_the_default_per_entry():
    size = 50000
    x = _spiky(size, seed=9)
    default = sum(a.nbytes for a in _top(0.05).encode(x, seed=0).values())
    packed = _top(0.05, index="gap8", value_bits=8)
    sent = sum(a.nbytes for a in packed.encode(x, seed=0).values())
    most = sum(np.dtype(d).itemsize * n for d, n in packed.bounds(size).values())
    assert sent <= most <= default / 4 + (size // 255) * 2 + 4
