"""The tier's blocks kept compressed on the device (``kv_format`` "int8" / "int4").

vLLM-CPU's attention keeps one layer of a block as ``kv_heads`` x (keys, values), each
``block_size x head_size`` elements (``cpu_attn.py`` chunks the page per head), so a layer's
page is ``2 x kv_heads`` *pieces*, key and value in turn: the pieces ``firmware_model.kv_codec``
encodes. Its kernels (the ``vec`` ISA: x86 without AMX, float32 / float16) keep a key piece
channel-major, ``[head_size][block_size]``, and a value piece token-major; keys are transposed
to ``[tokens][channels]`` before encoding and back after decoding
(tests/driver/vllm/test_vllm_tier.py checks this layout against the model's own keys). A store gathers the job's pages of each layer, encodes them
into a staging array and DMAs that; a load DMAs the encoded pages in and decodes them into the
KV blocks before the forward reads them (a layer-wise load: that layer, when it is waited for).
The device's page of layer ``l`` is ``pieces x encoded_bytes``: the region, the chunk count and
the bytes on the link are the encoded sizes.

No vLLM import: the spec passes what it read from vLLM's configuration.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from emulator.dma import Descriptor
from emulator.spec.errors import ConfigError
from firmware_model.kv_codec import PieceCodec

__all__ = ["CodedJob", "PageCodec", "piece_codec"]

_ELEMENTS = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


def piece_codec(kv_format: str, *, model: str, dtype: object, block_size: int) -> PieceCodec:
    """The codec for a model's pieces: ``head_dim`` from its Hugging Face configuration (what
    vLLM loaded: ``model`` is its path or name), elements of the KV cache's ``dtype``."""
    name = str(dtype).removeprefix("torch.")
    if name not in _ELEMENTS:
        raise ConfigError(f"kv_connector_extra_config['kv_format']={kv_format!r} encodes float16, bfloat16 or "
                          f"float32 KV; this engine's KV cache is {name}: leave kv_format out (native)")
    from transformers import AutoConfig

    cfg: Any = AutoConfig.from_pretrained(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return PieceCodec(kv_format, block_size, int(head_dim), _ELEMENTS[name])


class PageCodec:
    """Encodes and decodes one layer's pages of a job (see the module doc)."""

    def __init__(self, codec: PieceCodec, pages: Sequence[int]) -> None:
        self.codec = codec
        bad = [p for p in pages if p % (2 * codec.native_bytes)]
        if bad:
            raise ConfigError(f"a KV page of {bad[0]} bytes is not a whole number of (key, value) pieces of "
                              f"{codec.tokens} tokens x {codec.head_dim} {codec.elem}: this layout cannot be "
                              "stored compressed; leave kv_format out (native)")
        self.pieces = [p // codec.native_bytes for p in pages]
        self.pages = list(pages)
        #: each layer's page on the device (and on the link)
        self.device_pages = [n * codec.encoded_bytes for n in self.pieces]

    @staticmethod
    def block_bytes(codec: PieceCodec, native_block_bytes: int) -> int:
        """A block of every layer on the device, from its native size (the scheduler's view)."""
        return native_block_bytes // codec.native_bytes * codec.encoded_bytes

    def _keys_swapped(self, pieces: np.ndarray, to_tokens: bool) -> np.ndarray:
        """(n, pieces, native bytes) with every key piece (even index) turned between vLLM's
        channel-major and the codec's token-major order."""
        c = self.codec
        item = c.native_bytes // (c.tokens * c.head_dim)
        out = pieces.copy()
        shape = (c.head_dim, c.tokens, item) if to_tokens else (c.tokens, c.head_dim, item)
        keys = pieces[:, 0::2].reshape(pieces.shape[0], -1, *shape).transpose(0, 1, 3, 2, 4)
        out[:, 0::2] = keys.reshape(pieces.shape[0], -1, c.native_bytes)
        return out

    def encode(self, layer: int, raw: np.ndarray) -> np.ndarray:
        """``raw`` (n, page) uint8 -> (n, device page) uint8."""
        n, k = raw.shape[0], self.pieces[layer]
        values = np.tile(np.arange(k) % 2 == 1, n)  # per head: the keys, then the values
        pieces = self._keys_swapped(raw.reshape(n, k, self.codec.native_bytes), to_tokens=True)
        enc = self.codec.encode(pieces.reshape(n * k, self.codec.native_bytes), values)
        return enc.reshape(n, self.device_pages[layer])

    def decode(self, layer: int, enc: np.ndarray) -> np.ndarray:
        n, k = enc.shape[0], self.pieces[layer]
        pieces = self.codec.decode(enc.reshape(n * k, self.codec.encoded_bytes)).reshape(n, k, -1)
        return self._keys_swapped(pieces, to_tokens=False).reshape(n, self.pages[layer])


def _runs(chunks: np.ndarray) -> list[tuple[int, int]]:
    """(first row, rows) of each run of consecutive chunk ids, in job order."""
    cuts = [0, *(np.flatnonzero(np.diff(chunks) != 1) + 1).tolist(), len(chunks)]
    return [(a, b - a) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]


class CodedJob:
    """One job's staging arrays, descriptors and pending decodes.

    ``blocks(layer)`` is the (num_blocks, page) view of layer ``layer``'s KV tensor the pages are
    gathered from and scattered into; ``offsets`` the layers' regions on the device."""

    def __init__(self, codec: PageCodec, blocks: Any, offsets: Sequence[int], kv: np.ndarray,
                 chunks: np.ndarray, is_load: bool) -> None:
        self.codec, self.blocks, self.kv, self.is_load = codec, blocks, kv, is_load
        direction = "read" if is_load else "write"
        self.staging: list[np.ndarray] = []
        self.descriptors: list[tuple[int, list[Descriptor]]] = []
        runs = _runs(chunks)
        for layer, (off, page) in enumerate(zip(offsets, codec.device_pages, strict=True)):
            if is_load:
                enc = np.empty((len(kv), page), np.uint8)
            else:
                enc = codec.encode(layer, blocks(layer)[kv])
            self.staging.append(enc)
            flat = enc.reshape(-1)
            self.descriptors.append((layer, [Descriptor(direction, off + int(chunks[row]) * page, flat, row * page,
                                                        n * page) for row, n in runs]))
        self.pending = set(range(len(offsets))) if is_load else set()

    @property
    def link_bytes(self) -> int:
        return sum(s.nbytes for s in self.staging)

    def land(self, layer: int | None = None) -> None:
        """Decode the loaded pages of ``layer`` (None: every layer not decoded yet) into the KV."""
        for lay in sorted(self.pending) if layer is None else [layer] if layer in self.pending else []:
            self.blocks(lay)[self.kv] = self.codec.decode(lay, self.staging[lay])
            self.pending.discard(lay)
