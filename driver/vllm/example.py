"""A vLLM run with its KV offload tier on a cxlemu device: ``python -m driver.vllm.example``.

Serves nothing itself when ``--device`` names a served device (watch it with ``cxlemu monitor
NAME`` meanwhile); without it the tier serves a private device in this process. A seeded random
Llama answers rounds of prompts larger than vLLM's KV space, each round resending the earlier
ones, so their blocks come back from the device; it prints the tier's counters and checks the
tokens against a run of vLLM alone.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m driver.vllm.example", description=__doc__.split("\n")[0])
    p.add_argument("--device", help="a served device (cxlemu serve --name NAME); default: a private one")
    p.add_argument("--policy", default="arc", help="the tier's eviction policy (default arc)")
    p.add_argument("--prefetch", default="layer", choices=("forward", "layer"))
    p.add_argument("--rounds", type=int, default=6, help="rounds of prompts (default 6)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        from driver.vllm._compat import LLM, SamplingParams, TokensPrompt
    except ModuleNotFoundError:
        print("this example needs the vllm extra: pip install -e '.[vllm]' (see the README)", file=sys.stderr)
        return 2
    except ImportError as exc:  # installed but unusable: it says what to do
        print(f"this example needs a working vLLM: {exc}", file=sys.stderr)
        return 2
    from driver.vllm import kv_transfer_config, tier_stats
    from driver.vllm.testing import model_dir, random_prompts

    with tempfile.TemporaryDirectory() as tmp:
        model = str(model_dir(tmp, layers=8, hidden=256, heads=8, kv_heads=4))
        common: dict = {"model": model, "enforce_eager": True, "dtype": "float32", "max_model_len": 1024,
                        "max_num_seqs": 4, "seed": 0, "num_gpu_blocks_override": 12}
        prompts = random_prompts(4 * args.rounds, 300, seed=5, prefix=128)
        sp = SamplingParams(max_tokens=16, temperature=0)

        def rounds(llm: LLM) -> tuple[list[list[int]], float]:
            out, t0 = [], time.perf_counter()
            for r in range(args.rounds):  # each round: four new prompts and the four of the round before
                batch = prompts[4 * r:4 * r + 4] + (prompts[4 * (r - 1):4 * r] if r else [])
                done = llm.generate([TokensPrompt(prompt_token_ids=q) for q in batch], sp, use_tqdm=False)
                out += [list(o.outputs[0].token_ids) for o in done]
            return out, time.perf_counter() - t0

        alone = LLM(**common)
        reference, t_alone = rounds(alone)
        alone.llm_engine.engine_core.shutdown()
        cfg = kv_transfer_config(device=args.device, policy=args.policy, prefetch=args.prefetch,
                                 cxl_bytes_to_use=256 << 20)
        tiered = LLM(**common, kv_transfer_config=cfg)
        got, t_tier = rounds(tiered)
        tiered.llm_engine.engine_core.shutdown()
    from driver.vllm import _stats

    name = args.device or next(iter(_stats._STATS), None)
    stats = tier_stats(name).as_dict() if name else {}
    print(f"vLLM alone: {t_alone:.1f} s; with the tier on {name} ({args.policy}, prefetch {args.prefetch}): "
          f"{t_tier:.1f} s")
    print(f"tier: {stats.get('hits', 0)} hits of {stats.get('lookups', 0)} lookups, "
          f"{stats.get('blocks_loaded', 0)} blocks loaded ({stats.get('bytes_loaded', 0) >> 20} MiB), "
          f"{stats.get('blocks_stored', 0)} stored ({stats.get('bytes_stored', 0) >> 20} MiB), "
          f"{stats.get('evictions', 0)} evicted, {stats.get('failed_loads', 0)} failed loads")
    same = got == reference
    print("tokens identical to vLLM alone" if same else "TOKENS DIFFER from vLLM alone")
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        # the tier ran in the engine's own processes: its counters are theirs; the monitor shows
        # them (the worker publishes its transfers and the scheduler's hits, ManagerCounters)
        print("(vLLM ran its engine in other processes: the counters above are this process's; "
              "watch the run with cxlemu monitor)")
        return 0 if same else 1
    return 0 if same and stats.get("blocks_loaded", 0) > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
