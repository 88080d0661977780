"""The controller's KV codec (firmware_model/kv_codec.py): sizes, byte layout, error bounds."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from firmware_model.kv_codec import PieceCodec, decode_elements, encode_elements

SLACK = 1 + 2.0 ** -16  # x / s is computed in float32


def raw_of(x: np.ndarray, elem: str = "f32") -> np.ndarray:
    return encode_elements(x.reshape(x.shape[0], -1), elem).view(np.uint8)


def test_encoded_sizes_are_exact() -> None:
    """int8: a record per token (fp16 scale, a byte per value); int4: header, M (scale, zero), nibbles."""
    assert PieceCodec("int8", 16, 128, "f16").encoded_bytes == 16 * 2 + 16 * 128 == 2080
    assert PieceCodec("int4", 16, 128, "f16").encoded_bytes == 4 + 4 * 128 + 16 * 64 == 1540
    assert PieceCodec("int4", 16, 64, "f32").encoded_bytes == 4 + 4 * 64 + 16 * 32 == 772
    # head_dim 16 < the 32-channel group: groups of 16, M = max(16, 16 tokens x 1 group) = 16
    assert PieceCodec("int4", 16, 16, "f32").encoded_bytes == 4 + 4 * 16 + 16 * 8 == 196
    # few channels per group and long blocks: the per-token entries set M
    assert PieceCodec("int4", 64, 80, "f16").group == 16
    assert PieceCodec("int4", 64, 80, "f16").encoded_bytes == 4 + 4 * (64 * 5) + 64 * 40
    assert PieceCodec("native", 16, 128, "bf16").encoded_bytes == 16 * 128 * 2


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match=r"one of \('native', 'int8', 'int4'\)"):
        PieceCodec("int2", 16, 64)
    with pytest.raises(ValueError, match="head_dim must be even"):
        PieceCodec("int4", 16, 63)
    with pytest.raises(ValueError, match="valid tokens"):
        PieceCodec("int8", 4, 8, "f32").encode(np.zeros((1, 128), np.uint8), np.zeros(1, bool), valid=5)


def test_int8_layout_byte_for_byte() -> None:
    """One token [254, -127, 0.5, 0] and one of zeros: scales 2.0 and 0, codes 127 -127 0 0."""
    c = PieceCodec("int8", 2, 4, "f32")
    x = np.array([[[254.0, -127.0, 0.5, 0.0], [0, 0, 0, 0]]], np.float32)
    enc = c.encode(raw_of(x), np.array([False]))
    assert enc.shape == (1, 2 * (2 + 4))  # a record per token: scale, then its codes
    assert enc[0, [0, 1, 6, 7]].copy().view(np.float16).tolist() == [2.0, 0.0]
    assert enc[0, 2:6].view(np.int8).tolist() == [127, -64, 0, 0]  # -127/2 = -63.5 -> -64 (even)
    assert enc[0, 8:12].view(np.int8).tolist() == [0, 0, 0, 0]
    assert c.prefix_bytes(1) == 6 and PieceCodec("int4", 2, 4).prefix_bytes(1) is None
    assert decode_elements(c.decode(enc), "f32")[0].tolist() == [254.0, -128.0, 0.0, 0.0, 0, 0, 0, 0]


def test_int4_layout_byte_for_byte() -> None:
    """A key block per channel, a value block per token: header, scales, zeros, packed nibbles."""
    c = PieceCodec("int4", 2, 2, "f32")  # group = gcd(2, 32) = 2, M = max(2, 2 * 2 / 2) = 2
    x = np.array([[[0.0, 10.0], [15.0, 40.0]]], np.float32)
    key = c.encode(raw_of(x), np.array([False]))
    hdr, s, z, codes = key[0, :4], key[0, 4:8], key[0, 8:12], key[0, 12:]
    assert hdr.view(np.uint16).tolist() == [2, 1]  # 2 valid tokens, per channel
    assert s.view(np.float16).tolist() == [1.0, 2.0]  # channel 0: 0..15, channel 1: 10..40
    assert z.view(np.float16).tolist() == [0.0, 10.0]
    assert codes.tolist() == [0x00, 0xFF]  # token 0: (0, 0); token 1: (15, 15)
    value = c.encode(raw_of(x), np.array([True]))
    assert value[0, :4].view(np.uint16).tolist() == [2, 0]  # per token
    # token 0 spans 0..10, token 1 15..40: scales rounded up to fp16 (0.6665 -> 0.66699, 1.6667 -> 1.667)
    scales = value[0, 4:8].view(np.float16).astype(np.float32)
    assert scales.tolist() == [np.float32(np.float16(0.667)), np.float32(np.float16(1.667))]
    assert np.all(scales * 15 >= [10, 25]) and value[0, 8:12].view(np.float16).tolist() == [0.0, 15.0]
    assert value[0, 12:].tolist() == [0xF0, 0xF0]  # each token: (0, 15)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("kind", [False, True])
@settings(max_examples=60, deadline=None)
@given(x=arrays(np.float32, (3, 8, 16), elements=st.floats(-1000, 1000, width=32)))
def test_round_trip_error_is_at_most_half_a_scale(fmt: str, kind: bool, x: np.ndarray) -> None:
    """Every element of every group comes back within half its group's scale."""
    c = PieceCodec(fmt, 8, 16, "f32")
    enc = c.encode(raw_of(x), np.full(3, kind))
    err = np.abs(c.dequantize(enc) - x)
    assert np.all(err <= scale_of(c, enc) / 2 * SLACK + 1e-6 * np.abs(x))


def scale_of(c: PieceCodec, enc: np.ndarray) -> np.ndarray:
    """Each element's scale, read back from the encoded layout."""
    n, t, d = enc.shape[0], c.tokens, c.head_dim
    if c.fmt == "int8":
        s = enc.reshape(n, t, 2 + d)[:, :, :2].copy().view(np.float16).astype(np.float32)
        return np.broadcast_to(s, (n, t, d))
    m = max(d, t * d // c.group)
    s = enc[:, 4:4 + 2 * m].view(np.float16).astype(np.float32)
    out = np.empty((n, t, d), np.float32)
    for i in range(n):
        if enc[i, :4].view(np.uint16)[1]:
            out[i] = np.broadcast_to(s[i, :d], (t, d))
        else:
            out[i] = np.repeat(s[i, :t * d // c.group], c.group).reshape(t, d)
    return out


@pytest.mark.parametrize("elem", ["f16", "bf16", "f32"])
def test_values_on_the_grid_come_back_exactly(elem: str) -> None:
    """int8: q * s with a +-127 per token; int4: z + q * s with 0 and 15 per group."""
    rng = np.random.default_rng(1)
    c8 = PieceCodec("int8", 4, 32, elem)
    q = rng.integers(-127, 128, (2, 4, 32)).astype(np.float32)
    q[:, :, 0] = 127
    x8 = q * np.float32(0.25)
    assert np.array_equal(decode_elements(c8.decode(c8.encode(raw_of(x8, elem), np.zeros(2, bool))), elem),
                          decode_elements(raw_of(x8, elem), elem))
    c4 = PieceCodec("int4", 4, 32, elem)
    q4 = rng.integers(0, 16, (2, 4, 32)).astype(np.float32)
    q4[:, 0], q4[:, 1] = 0, 15  # every channel (key groups) has its 0 and 15
    q4[:, :, 0], q4[:, :, 1] = 0, 15  # every token (value groups of 32) too
    x4 = np.float32(-2.0) + q4 * np.float32(0.125)
    for values in (False, True):
        back = c4.encode(raw_of(x4, elem), np.full(2, values))
        assert np.array_equal(decode_elements(c4.decode(back), elem), decode_elements(raw_of(x4, elem), elem))


@settings(max_examples=40, deadline=None)
@given(x=arrays(np.float32, (2, 4, 16), elements=st.floats(-300, 300, width=32)))
def test_int8_reencodes_its_own_output_unchanged(x: np.ndarray) -> None:
    """A tail block re-saved from decoded values gets the same bytes: no drift step to step."""
    c = PieceCodec("int8", 4, 16, "f16")
    raw = raw_of(x, "f16")
    enc = c.encode(raw, np.zeros(2, bool))
    if np.any(np.abs(c.dequantize(enc)).max(axis=2) < 2.0 ** -14 * 127):
        return  # a subnormal scale (|x| < 0.002): outside the claim
    assert np.array_equal(c.encode(c.decode(enc), np.zeros(2, bool)), enc)


def test_a_partial_block_ignores_what_lies_past_its_valid_tokens() -> None:
    """Stale bytes after the valid tokens (NaN, huge) change nothing valid; int4 keys of a
    partial block go per token (header: 3 valid, mode 0)."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(1, 8, 16)).astype(np.float32)
    junk = x.copy()
    junk[0, 3:] = np.nan
    junk[0, 5:, 2] = 1e30
    for fmt in ("int8", "int4"):
        c = PieceCodec(fmt, 8, 16, "f32")
        a = c.dequantize(c.encode(raw_of(x), np.array([False]), valid=3))[0, :3]
        b = c.dequantize(c.encode(raw_of(junk), np.array([False]), valid=3))[0, :3]
        assert np.array_equal(a, b) and np.all(np.abs(a - x[0, :3]) <= 0.2)
    enc = PieceCodec("int4", 8, 16, "f32").encode(raw_of(junk), np.array([False]), valid=3)
    assert enc[0, :4].view(np.uint16).tolist() == [3, 0]


def test_int8_whole_block_with_nan_garbage_keeps_other_tokens() -> None:
    """Per token: a NaN token (uninitialised frame memory past the valid ones) stays its own."""
    x = np.ones((1, 4, 8), np.float32)
    x[0, 3] = np.nan
    c = PieceCodec("int8", 4, 8, "f32")
    out = c.dequantize(c.encode(raw_of(x), np.array([True])))
    clean = c.dequantize(c.encode(raw_of(np.ones((1, 4, 8), np.float32)), np.array([True])))
    assert np.array_equal(out[0, :3], clean[0, :3]) and np.all(np.abs(clean - 1) <= 1 / 254)


@pytest.mark.parametrize("elem", ["f16", "bf16"])
def test_bf16_and_f16_element_conversion_round_trips(elem: str) -> None:
    words = np.arange(0, 1 << 16, 97, dtype=np.uint16)
    x = decode_elements(words.view(np.uint8), elem)
    finite = np.isfinite(x)
    assert np.array_equal(encode_elements(x, elem)[finite], words[finite])
