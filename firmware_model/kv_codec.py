"""The controller's KV codec: int8 and KIVI-style 4-bit quantization of KV pieces, pure numpy.

The unit is a *piece*: ``tokens`` tokens x ``head_dim`` channels of one kv head's K or V (a
device chunk of the KV shim, ``driver/kv/_layout.py``; one of the ``2 x kv_heads`` runs of a
vLLM CPU block). A piece is encoded into a fixed number of bytes, so an encoded chunk has one
size whatever it holds. Elements come in as ``f16``, ``bf16`` or ``f32`` and are decoded into
the same element type. All multi-byte fields are little-endian.

``int8`` -- symmetric, one fp16 scale per token (per token of one head: ``head_dim`` values),
one record per token, so the first v tokens of a piece are its first ``v * (2 + head_dim)`` bytes
(a partial block moves only its valid tokens: :meth:`PieceCodec.prefix_bytes`)::

    record[tokens]:  f16 scale     s_t = fp16(max_c |x[t, c]| / 127)
                     i8  code[head_dim]    q = clip(rint(x / s_t), -127, 127);  x' = q * s_t

  Per token rather than per channel: a token's codes depend on that token alone, so the bytes
  past the valid tokens of a partly filled block (stale frame memory the shim writes whole)
  cannot touch the valid ones, and a tail block re-saved every decode step re-encodes the
  decoded tokens exactly (the largest element always lands on +-127, so the scale and every
  code come back unchanged: no drift); and one scale per ``head_dim`` values costs less than
  one per channel per ``tokens`` values for the usual ``tokens`` (16) < ``head_dim`` (64-128).

``int4`` -- asymmetric, fp16 scale and zero point per group, two codes per byte (KIVI)::

    header u16 valid tokens, u16 mode (1: per channel, 0: per token)
    scale  f16[M]        M = max(head_dim, tokens * head_dim / G),  G = gcd(head_dim, 32)
    zero   f16[M]        x' = z + q * s,  q in 0..15
    codes  u8 [tokens, head_dim / 2]   channel 2i in the low nibble, 2i+1 in the high one

  Keys of a full block are quantized per channel (group: the block's tokens of that channel,
  entry c), values and the keys of a partial block per token (groups of G consecutive
  channels, entry t * head_dim / G + g): KIVI's split (key outliers sit in channels, value
  errors should stay within a token), and, as KIVI keeps the incomplete key group unquantized
  across tokens, a partial key block is not grouped across tokens (its groups would change as
  the block fills). ``z`` is fp16 rounded towards -inf and ``s`` fp16 rounded towards +inf, so
  the group's range [min, max] lies inside [z, z + 15 s].

Error bound (tested): ``|x - x'| <= s / 2`` per element, for the element's own group scale,
up to float32 rounding (x / s is computed in float32); values on the grid come back exactly.
Values beyond the fp16 range saturate there (scales and zeros are fp16).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["FORMATS", "ELEMENTS", "PieceCodec", "decode_elements", "encode_elements"]

FORMATS = ("native", "int8", "int4")
ELEMENTS = {"f16": 2, "bf16": 2, "f32": 4}
VALUE_GROUP = 32  # KIVI's group size along channels; gcd with head_dim where it does not divide
_F16_MAX = np.float32(65504.0)
_HEADER = 4


def encode_elements(x: np.ndarray, elem: str) -> np.ndarray:
    """float32 values as raw element bytes' integer words (u16 for f16/bf16, u32 for f32)."""
    x = np.asarray(x, np.float32)
    if elem == "f32":
        return x.view(np.uint32)
    if elem == "f16":
        return x.astype(np.float16).view(np.uint16)
    u = x.view(np.uint32)  # bf16: round to nearest even on the 16 bits dropped; NaN stays NaN
    out = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), out)


def decode_elements(raw: np.ndarray, elem: str) -> np.ndarray:
    """Raw element bytes (any shape, last axis bytes) as float32 values."""
    if elem == "f32":
        return raw.view(np.float32)
    if elem == "f16":
        return raw.view(np.float16).astype(np.float32)
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _f16_down(v: np.ndarray) -> np.ndarray:
    """The largest fp16 <= v (saturating at the fp16 range), as float32."""
    v = np.clip(v, -_F16_MAX, _F16_MAX)
    h = v.astype(np.float16)
    low = h.astype(np.float32) > v
    h[low] = np.nextafter(h[low], np.float16(-np.inf))
    return h.astype(np.float32)


def _f16_up(v: np.ndarray) -> np.ndarray:
    """The smallest fp16 >= v (v >= 0, saturating at the fp16 maximum), as float32."""
    v = np.minimum(v, _F16_MAX)
    h = v.astype(np.float16)
    high = h.astype(np.float32) < v
    h[high] = np.nextafter(h[high], np.float16(np.inf))
    return h.astype(np.float32)


def _safe(s: np.ndarray) -> np.ndarray:
    return np.where(s > 0, s, np.float32(1))


@dataclass(frozen=True)
class PieceCodec:
    """Encodes and decodes pieces of ``tokens`` x ``head_dim`` elements of type ``elem``."""

    fmt: str
    tokens: int
    head_dim: int
    elem: str = "f16"

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"kv_format must be one of {FORMATS}, got {self.fmt!r}")
        if self.elem not in ELEMENTS:
            raise ValueError(f"element type must be one of {tuple(ELEMENTS)}, got {self.elem!r}")
        if self.tokens < 1 or self.head_dim < 1:
            raise ValueError(f"a piece needs tokens >= 1 and head_dim >= 1, got {self.tokens} x {self.head_dim}")
        if self.fmt == "int4" and self.head_dim % 2:
            raise ValueError(f"int4 packs two channels per byte: head_dim must be even, got {self.head_dim}")

    @property
    def group(self) -> int:
        """Channels per int4 per-token group."""
        return math.gcd(self.head_dim, VALUE_GROUP)

    @property
    def _meta(self) -> int:
        """M: (scale, zero) entries of an int4 piece."""
        return max(self.head_dim, self.tokens * self.head_dim // self.group)

    @property
    def native_bytes(self) -> int:
        return self.tokens * self.head_dim * ELEMENTS[self.elem]

    @property
    def encoded_bytes(self) -> int:
        t, d = self.tokens, self.head_dim
        if self.fmt == "int8":
            return 2 * t + t * d
        if self.fmt == "int4":
            return _HEADER + 4 * self._meta + t * d // 2
        return self.native_bytes

    def prefix_bytes(self, valid: int) -> int | None:
        """Encoded bytes holding the first ``valid`` tokens alone, where the format has such a
        prefix (int8's per-token records, native); None for int4 (a key block is one group)."""
        if self.fmt == "int8":
            return valid * (2 + self.head_dim)
        if self.fmt == "native":
            return valid * self.native_bytes // self.tokens
        return None

    # ------------------------------------------------------------------ bytes in, bytes out
    def encode(self, raw: np.ndarray, values: np.ndarray, valid: int | None = None) -> np.ndarray:
        """``raw`` (n, native_bytes) uint8 pieces -> (n, encoded_bytes) uint8. ``values[i]``:
        piece i holds V (else K). ``valid``: tokens holding KV (the rest are padded with the
        last valid token; None: all)."""
        n = raw.shape[0]
        x = decode_elements(np.ascontiguousarray(raw), self.elem).reshape(n, self.tokens, self.head_dim)
        v = self.tokens if valid is None else valid
        if not 1 <= v <= self.tokens:
            raise ValueError(f"valid tokens must be in 1..{self.tokens}, got {valid}")
        if v < self.tokens:
            x = np.concatenate([x[:, :v], np.repeat(x[:, v - 1:v], self.tokens - v, axis=1)], axis=1)
        return self.quantize(x, np.asarray(values, bool), v)

    def decode(self, enc: np.ndarray) -> np.ndarray:
        """(n, encoded_bytes) uint8 -> (n, native_bytes) uint8."""
        x = self.dequantize(enc)
        n = enc.shape[0]
        words = encode_elements(x.reshape(n, -1), self.elem)
        return words.view(np.uint8).reshape(n, self.native_bytes)

    def decode_into(self, enc: np.ndarray, out: np.ndarray) -> None:
        """:meth:`decode` straight into ``out``, (n, native_bytes) uint8 (a load's destination):
        f32 and f16 elements are written by the dequantizing arithmetic itself, no copy."""
        n = enc.shape[0]
        if self.elem == "bf16" or self.fmt == "native":
            out[:] = self.decode(enc)
            return
        view = out.view(np.float32 if self.elem == "f32" else np.float16).reshape(n, self.tokens, self.head_dim)
        self.dequantize(enc, out=view)

    # ------------------------------------------------------------------ values in, values out
    def quantize(self, x: np.ndarray, values: np.ndarray, valid: int | None = None) -> np.ndarray:
        """float32 (n, tokens, head_dim) -> (n, encoded_bytes) uint8."""
        if self.fmt == "native":
            return encode_elements(x.reshape(x.shape[0], -1), self.elem).view(np.uint8)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            if self.fmt == "int8":
                return self._q8(x)
            return self._q4(x, values, self.tokens if valid is None else valid)

    def dequantize(self, enc: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """(n, encoded_bytes) uint8 -> float32 (n, tokens, head_dim), or into ``out`` (float32
        or float16 of that shape)."""
        enc = np.ascontiguousarray(enc)
        n, t, d = enc.shape[0], self.tokens, self.head_dim
        if out is None:
            out = np.empty((n, t, d), np.float32)
        with np.errstate(invalid="ignore", over="ignore"):  # a NaN scale: garbage past the valid tokens
            if self.fmt == "native":
                out[...] = decode_elements(enc, self.elem).reshape(n, t, d)
            elif self.fmt == "int8":
                rec = enc.reshape(n, t, 2 + d)
                s = rec[:, :, :2].copy().view(np.float16).astype(np.float32)  # (n, t, 1)
                np.multiply(rec[:, :, 2:].view(np.int8), s, out=out, casting="unsafe")  # int8 -> float32 in the loop
            else:
                self._dq4(enc, out)
        return out

    def _q8(self, x: np.ndarray) -> np.ndarray:
        n, t, d = x.shape
        amax = np.max(np.abs(x), axis=2)
        s16 = np.minimum(amax / np.float32(127), _F16_MAX).astype(np.float16)
        # nearest fp16 keeps amax within 127 +- 0.06 codes (so it encodes as +-127: re-encoding
        # is exact); only a subnormal scale can round so far down that codes pass 127.5: one up
        low = s16.astype(np.float32) * np.float32(127.5) < amax
        s16[low] = np.nextafter(s16[low], np.float16(np.inf))
        s = s16.astype(np.float32)
        q = np.clip(np.rint(x / _safe(s)[:, :, None]), -127, 127)
        q[np.isnan(q)] = 0
        out = np.empty((n, t, 2 + d), np.uint8)
        out[:, :, :2] = s16.view(np.uint8).reshape(n, t, 2)
        out[:, :, 2:] = q.astype(np.int8).view(np.uint8)
        return out.reshape(n, self.encoded_bytes)

    def _groups(self, x: np.ndarray, per_channel: bool) -> np.ndarray:
        """x (n, t, d) as (n, groups, group size): a channel's tokens, or G channels of a token."""
        n, t, d = x.shape
        if per_channel:
            return x.transpose(0, 2, 1)
        return x.reshape(n, t * d // self.group, self.group)

    def _q4(self, x: np.ndarray, values: np.ndarray, valid: int) -> np.ndarray:
        n, t, d = x.shape
        m = self._meta
        per_channel = ~values & (valid == t)  # KIVI: full key blocks per channel
        scale = np.zeros((n, m), np.float32)
        zero = np.zeros((n, m), np.float32)
        q = np.empty((n, t, d), np.uint8)
        for mode in (True, False):
            sel = np.flatnonzero(per_channel == mode)
            if not sel.size:
                continue
            g = self._groups(x[sel], mode)
            z = _f16_down(np.min(g, axis=2))
            span = np.minimum(np.max(g, axis=2), _F16_MAX) - z
            s = _f16_up(span / np.float32(15))
            s[(s == 0) & (span > 0)] = np.float32(2.0 ** -24)  # span / 15 underflowed: fp16's least step
            codes = np.clip(np.rint((g - z[:, :, None]) / _safe(s)[:, :, None]), 0, 15)
            codes[np.isnan(codes)] = 0
            codes = codes.astype(np.uint8)
            q[sel] = codes.transpose(0, 2, 1) if mode else codes.reshape(sel.size, t, d)
            scale[sel, :s.shape[1]], zero[sel, :z.shape[1]] = s, z
        out = np.empty((n, self.encoded_bytes), np.uint8)
        header = np.empty((n, 2), np.uint16)
        header[:, 0], header[:, 1] = valid, per_channel
        out[:, :_HEADER] = header.view(np.uint8)
        out[:, _HEADER:_HEADER + 2 * m] = scale.astype(np.float16).view(np.uint8)
        out[:, _HEADER + 2 * m:_HEADER + 4 * m] = zero.astype(np.float16).view(np.uint8)
        out[:, _HEADER + 4 * m:] = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(n, t * d // 2)
        return out

    def _dq4(self, enc: np.ndarray, out: np.ndarray) -> None:
        n, t, d, m = enc.shape[0], self.tokens, self.head_dim, self._meta
        per_channel = enc[:, :_HEADER].view(np.uint16)[:, 1].astype(bool)
        s = enc[:, _HEADER:_HEADER + 2 * m].view(np.float16).astype(np.float32)
        z = enc[:, _HEADER + 2 * m:_HEADER + 4 * m].view(np.float16).astype(np.float32)
        packed = enc[:, _HEADER + 4 * m:].reshape(n, t, d // 2)
        q = np.empty((n, t, d), np.float32)
        q[:, :, 0::2], q[:, :, 1::2] = packed & 0x0F, packed >> 4
        k = t * d // self.group
        if per_channel.all():  # a layer of full key blocks: one pass, no gather
            np.multiply(q, s[:, None, :d], out=q)
            np.add(q, z[:, None, :d], out=out, casting="unsafe")
        elif not per_channel.any():  # values, or partial key blocks
            g = q.reshape(n, k, self.group)
            np.multiply(g, s[:, :k, None], out=g)
            np.add(g, z[:, :k, None], out=out.reshape(n, k, self.group), casting="unsafe")
        else:
            i = np.flatnonzero(per_channel)
            out[i] = z[i, None, :d] + q[i] * s[i, None, :d]
            i = np.flatnonzero(~per_channel)
            g = q[i].reshape(i.size, k, self.group)
            out[i] = (z[i, :k, None] + g * s[i, :k, None]).reshape(i.size, t, d)
