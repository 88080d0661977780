"""KV kept compressed on the device (``CxlCache(kv_format=...)``, driver/kv/_codec_store.py): the
store encodes on write and decodes on read, the link and the media carry the encoded bytes."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kv_support import frame_bytes, generate
from transformers import DynamicCache

from driver.kv import CxlCache, MemoryBlockStore
from driver.kv._codec_store import CompressedStore
from driver.kv._store import Extent
from driver.kv.testing import padded_batch
from emulator.spec.errors import ConfigError
from firmware_model.kv_codec import PieceCodec, decode_elements, encode_elements

NEW = 8


def test_kv_format_is_checked_naming_the_allowed_values() -> None:
    with pytest.raises(ConfigError, match=r"kv_format must be one of 'native', 'int8', 'int4'.*got 'fp8'"):
        CxlCache(1 << 20, kv_format="fp8")
    with pytest.raises(ConfigError, match="prefix_sharing=True or use kv_format='int8'"):
        CxlCache(1 << 20, kv_format="int4", prefix_sharing=False)


def store(fmt: str, capacity: int = 1 << 16) -> tuple[CompressedStore, MemoryBlockStore, PieceCodec]:
    codec = PieceCodec(fmt, 4, 16, "f32")
    inner = MemoryBlockStore(capacity)
    s = CompressedStore(inner, codec)
    s.configure(codec.native_bytes)
    return s, inner, codec


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_store_moves_and_holds_encoded_chunks(fmt: str) -> None:
    """Extents of 2 whole chunks and of 1.5 chunks: 3 encoded chunks and the half chunk's 2
    tokens each way (int8: their 2 records; int4: the whole chunk), the pool sized by the
    encoded chunk, every value back within half its scale."""
    s, inner, codec = store(fmt)
    assert s.capacity_chunks == (1 << 16) // codec.encoded_bytes
    assert s.pool is not None
    c = s.pool.alloc(4)
    s.pool.values[c[2:]] = True
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 4, 16)).astype(np.float32)
    host = encode_elements(x.reshape(-1), "f32").view(np.uint8).copy()
    cb = codec.native_bytes
    extents = [Extent(c[0], 2 * cb, 0), Extent(c[2], cb + cb // 2, 2 * cb)]
    s.write(extents, host).wait()
    moved = 3 * codec.encoded_bytes + (2 * (2 + 16) if fmt == "int8" else codec.encoded_bytes)
    assert inner.bytes_written == moved
    back = np.zeros_like(host)
    s.read(extents, back).wait()
    assert inner.bytes_read == moved
    got = decode_elements(back, "f32").reshape(4, 4, 16)
    assert np.all(got[3, 2:] == 0)  # past the half chunk written: nothing read into the buffer
    bound = 0.5 * np.abs(x).max() / (127 if fmt == "int8" else 7.5) * (1 + 2.0 ** -9)
    assert np.abs(got[:3] - x[:3]).max() <= bound and np.abs(got[3, :2] - x[3, :2]).max() <= bound
    assert s.counters == {"native_bytes_read": 3.5 * cb, "native_bytes_written": 3.5 * cb,
                          "link_bytes_read": moved, "link_bytes_written": moved}


def test_a_batched_read_is_decoded_when_its_batch_lands() -> None:
    s, _, codec = store("int8")
    assert s.pool is not None
    c = s.pool.alloc(1)[0]
    host = np.full(codec.native_bytes, 0, np.uint8)
    host.view(np.float32)[:] = 31.75  # 127 x 0.25: on the grid
    s.write([Extent(c, codec.native_bytes, 0)], host).wait()
    out = np.zeros_like(host)
    with s.batched():
        t = s.read([Extent(c, codec.native_bytes, 0)], out)
    seen: list[bool] = []
    t.add_done_callback(lambda: seen.append(bool(out.view(np.float32)[0] == 31.75)))
    assert t.done() and seen == [True]


def logits(model: torch.nn.Module, cache: object, ids: torch.Tensor, mask: torch.Tensor) -> tuple:
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, past_key_values=cache, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


def test_native_keeps_dynamic_caches_tokens(model: torch.nn.Module) -> None:
    ids, mask = padded_batch([16, 9])
    with CxlCache(2 * frame_bytes(2, 24, 4), block_tokens=4, kv_format="native",
                  store=MemoryBlockStore(8 << 20)) as cache:
        assert torch.equal(generate(model, ids, mask, cache, NEW), generate(model, ids, mask, DynamicCache(), NEW))


@pytest.mark.parametrize("fmt,tolerance", [("int8", 3e-3), ("int4", 5e-2)])
def test_compressed_kv_decodes_close_to_dense(model: torch.nn.Module, fmt: str, tolerance: float) -> None:
    """The minimum budget (every decode step loads from the store): the first steps' logits
    stay within ``tolerance`` of dense (logits span +-0.6), and the link moved exactly the
    encoded chunks while the engine asked for the native bytes."""
    ids, mask = padded_batch([16, 9])
    seq, ref = logits(model, DynamicCache(), ids, mask)
    inner = MemoryBlockStore(8 << 20)
    with CxlCache(2 * frame_bytes(2, 24, 4), block_tokens=4, kv_format=fmt, store=inner) as cache:
        got_seq, got = logits(model, cache, ids, mask)
        stats = cache.stats()
    assert torch.equal(got[0], ref[0])  # the first token comes from the prefill's own KV
    first_diff = int((got_seq != seq).any(0).int().argmax()) - ids.shape[1] if not torch.equal(got_seq, seq) else NEW
    assert first_diff >= 4 and (got[1:first_diff] - ref[1:first_diff]).abs().max() <= tolerance
    encoded = PieceCodec(fmt, 4, 16, "f32").encoded_bytes
    assert stats["link_bytes_loaded"] == inner.bytes_read and stats["link_bytes_offloaded"] == inner.bytes_written
    assert stats["device_chunk_bytes"] == encoded
    assert stats["link_bytes_loaded"] < stats["bytes_loaded"] * encoded / 256 * 1.2


def test_the_devices_timed_link_carries_the_encoded_bytes(model: torch.nn.Module) -> None:
    """On a private device the data path's own counters show the encoded bytes, not the native."""
    ids, mask = padded_batch([16])
    with CxlCache(2 * frame_bytes(1, 24, 4), block_tokens=4, kv_format="int8") as cache:
        generate(model, ids, mask, cache, NEW)
        stats = cache.stats()
        store = cache._engine.store  # type: ignore[union-attr]
        link = store.inner.datapath.counters()
    assert isinstance(store, CompressedStore)
    assert link["read_bytes"] == stats["link_bytes_loaded"] > 0
    assert link["write_bytes"] == stats["link_bytes_offloaded"] > 0
    assert stats["bytes_loaded"] > 3 * stats["link_bytes_loaded"]  # 256-byte f32 chunks, 72 encoded
    assert stats["device_bytes_used"] == stats["device_chunks_used"] * 72
