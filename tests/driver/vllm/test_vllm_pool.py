"""Two vLLM engine processes share one device's KV pool (issue 25's acceptance): each on a host
port of its own (``shared=True``), the second engine's first request for a prompt the first one
prefilled is served from the pool, with vLLM alone's tokens; killing the first mid-run leaves
the second serving the same tokens; an engine of another model never matches those blocks.

One device (two host ports, the pool in a Dynamic Capacity extent) served in this process; each
engine a spawned process running vLLM in-process (``tools.bench._pool_engine``), the 4-layer
random Llama of ``driver.vllm.testing`` and 10 KV blocks of 128 tokens. Skipped without vLLM.
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

if importlib.util.find_spec("vllm") is None:  # not imported here: only the engine processes need it (~15 s)
    pytest.skip("vLLM is not installed (pip install -e '.[vllm]', see README)", allow_module_level=True)

from driver.vllm.testing import model_dir, random_prompts
from tools.bench._pool_engine import EngineError, EngineProcess, EngineSpec

KV_BLOCKS = 10
NEW_TOKENS = 12
PROMPTS = random_prompts(6, 300, seed=3)  # two whole blocks of 128 tokens each, and 44 more
TIER = 32 << 20  # each engine's own tier; the pool holds 64 MiB


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("llamas")
    return str(model_dir(root / "a")), str(model_dir(root / "b", seed=1))  # same shapes, other weights


@pytest.fixture(scope="module")
def pool_device() -> Iterator[str]:
    from tools.bench.pool_serve import pool_device as serve_pool

    name = f"vp{os.getpid() % 100000}"
    with serve_pool(name, hosts=2, static_bytes=256 << 20, pool_bytes=64 << 20, slot_bytes=256 << 10) as dev:
        yield dev


def test_two_engines_share_the_pool_and_survive_each_other(models: tuple[str, str], pool_device: str) -> None:
    """Both connector paths: A through vLLM's OffloadingConnector with the tier's spec, B through
    CxlConnector (then the OffloadingConnector for model b and the refused hash).

    Engine A (host 0) prefills prompts 0-3 from nothing (no cached token: what vLLM alone
    computes, the reference); engine B (host 1) gets prompt 0 from the pool: its first request
    for it reports both whole blocks cached and A's tokens. A is killed while it serves prompts
    4-5; B serves prompts 1-3 from what A published, with the same tokens. B then runs model b
    on the same port: prompt 0's blocks (model a's) never match; and B refuses to start with a
    block hash another process would not reproduce."""
    model_a, model_b = models
    a, b = EngineProcess(), EngineProcess()
    shared = {"device": pool_device, "shared": True, "tier_bytes": TIER, "kv_blocks": KV_BLOCKS}
    try:
        a.send("start", EngineSpec(model_dir=model_a, host=0, connector="offloading", **shared))
        b.send("start", EngineSpec(model_dir=model_a, host=1, **shared))
        a.reply("ready"), b.reply("ready")
        first, tier_a = a.run(PROMPTS[:4], NEW_TOKENS)
        ref = [o["tokens"] for o in first]
        assert [o["cached"] for o in first] == [0] * 4  # computed, nothing loaded: vLLM alone's tokens
        assert len({tuple(t) for t in ref}) == len(ref) and all(len(set(t)) > NEW_TOKENS // 2 for t in ref), \
            "the random model's greedy outputs must vary, or equality proves nothing"
        assert tier_a["pool_published"] == 8, tier_a  # two whole blocks of each prompt
        got, tier_b = b.run(PROMPTS[:1], NEW_TOKENS)
        assert got[0]["tokens"] == ref[0]
        assert got[0]["cached"] == 256, (got[0]["cached"], tier_b)  # both blocks, from A's prefill
        assert (tier_b["pool_hits"], tier_b["pool_loaded"], tier_b["blocks_loaded"]) == (2, 2, 2), tier_b

        a.send("run", PROMPTS[4:], NEW_TOKENS)  # killed mid-run: after its first prompt
        a.reply("progress")
        a.kill()
        after, tier_b = b.run(PROMPTS[1:4], NEW_TOKENS)
        assert [o["tokens"] for o in after] == ref[1:4]
        assert [o["cached"] for o in after] == [256] * 3 and tier_b["pool_errors"] == 0, (after, tier_b)

        b.stop()
        b.send("start", EngineSpec(model_dir=model_b, host=1, connector="offloading", **shared))
        b.reply("ready")
        other, tier_b = b.run(PROMPTS[:1], NEW_TOKENS)
        assert other[0]["cached"] == 0 and other[0]["tokens"] != ref[0]
        assert tier_b["pool_lookups"] >= 1 and tier_b["pool_hits"] == 0, tier_b  # looked, never matched

        b.stop()  # a hash seeded per process (unless PYTHONHASHSEED is shared) is refused at start
        b.send("start", EngineSpec(model_dir=model_a, host=1, hash_algo="xxhash", connector="offloading", **shared))
        with pytest.raises(EngineError, match=r"NondeterministicBlockHash.*prefix_caching_hash_algo 'xxhash' does "
                                               r"not give the same block hash in every process"):
            b.reply("ready")
    finally:
        a.close(), b.close()
