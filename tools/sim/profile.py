"""Step times from measured operator profiles: Vidur's (microsoft/vidur, MIT; ``data/vidur/README.md``
says which files, which commit and how they were trimmed).

Vidur profiled every token-level operator of a transformer layer on real accelerators (A100 and
H100, 1 to 8-way tensor parallel) at 1 to 4,096 tokens (32,768 for Llama-3): the two RMS norms, the
QKV projection, the rotary embedding, the output projection, the MLP's up (gate and up) projection,
activation and down projection, and the residual add. :class:`ProfileCost` is Vidur's block time:

    step = layers x (the sum of those operators' median times at the step's tokens, linear
           between the profiled token counts; past the largest, in proportion to the tokens)
         + the attention kernel + the LM head                            (roofline: see below)
         + 2 x layers x all-reduce of tokens x hidden x 2 bytes          (tp > 1: Vidur's measured
           NCCL all-reduce on a DGX at that size, linear between sizes; none measured: the ring
           formula of ``hardware.allreduce_ns``)
         + the per-step overhead                                         (as the roofline's)

The attention kernel's own profiles (Vidur's ``attention.csv``) are not in the stored copy of the
repository that was available (the snapshot lists the files but lacks their contents), so the
kernel's time is the roofline's: ``max(4 x layers x hidden x pairs / tp / (peak x mfu), the
accelerator's KV bytes / (HBM x mbu))``; and the LM head, which Vidur leaves out, is ``max(2 x
hidden x vocab x sampled / tp / (peak x mfu), its weights / tp / (HBM x mbu))``. At 2,048 tokens
of Llama-2-7B these are 5 % of the step.

:func:`step_cost` picks the profile where one exists for (model, accelerator) and the roofline
elsewhere.
"""
from __future__ import annotations

import csv
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tools.sim import hardware as hw

__all__ = ["COST_MODELS", "NETWORKS", "OPERATORS", "PROFILED", "OperatorProfile", "ProfileCost", "load_allreduce",
           "load_profile", "step_cost"]

DATA = Path(__file__).parent / "data" / "vidur"
#: (model, accelerator) -> Vidur's profile folder (``compute/<accelerator>/<Hugging Face id>``)
PROFILED: dict[tuple[str, str], str] = {
    ("llama-2-7b", "a100-80gb"): "a100/meta-llama/Llama-2-7b-hf",
    ("llama-2-70b", "a100-80gb"): "a100/meta-llama/Llama-2-70b-hf",
    ("llama-3-8b", "a100-80gb"): "a100/meta-llama/Meta-Llama-3-8B",
    ("llama-3-70b", "a100-80gb"): "a100/meta-llama/Meta-Llama-3-70B",
    ("llama-2-7b", "h100"): "h100/meta-llama/Llama-2-7b-hf",
    ("llama-2-70b", "h100"): "h100/meta-llama/Llama-2-70b-hf",
}
#: accelerator -> Vidur's all-reduce profile (``network/<name>``: a DGX's NVSwitch, tp on one node)
NETWORKS = {"a100-80gb": "a100_dgx", "h100": "h100_dgx"}
#: a layer's operators in Vidur's ``mlp.csv`` (Vidur's block time, the attention kernel aside)
OPERATORS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
             "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
COST_MODELS = ("roofline", "profile")


def _proportional_interp(x: float, xs: np.ndarray, ys: np.ndarray, *, floor: bool) -> float:
    """``ys`` at ``x``: linear between the points; past the last, in proportion to x (the largest
    profiled size runs at the operator's full throughput); below the first, the first's value
    (``floor``: a latency) or in proportion (a time per token)."""
    if x > xs[-1]:
        return float(ys[-1] * x / xs[-1])
    if x < xs[0]:
        return float(ys[0] if floor else ys[0] * x / xs[0])
    return float(np.interp(x, xs, ys))


@dataclass(frozen=True, eq=False)
class OperatorProfile:
    """One layer's measured time (ms, the operators summed) against its tokens; duplicates averaged."""

    tokens: np.ndarray
    layer_ms: np.ndarray
    source: str

    def layer_ns(self, tokens: int) -> float:
        return _proportional_interp(tokens, self.tokens, self.layer_ms, floor=False) * 1e6


def _table(path: Path, key: str, value: Any, group: str, want: int) -> tuple[np.ndarray, np.ndarray]:
    """(sorted x, y averaged over rows of equal x) of the rows of ``path`` whose ``group`` column is ``want``."""
    sums: dict[int, list[float]] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            if int(row[group]) == want:
                sums.setdefault(int(row[key]), []).append(value(row))
    xs = sorted(sums)
    return np.array(xs, dtype=float), np.array([sum(sums[x]) / len(sums[x]) for x in xs])


@functools.lru_cache(maxsize=64)
def load_profile(model: str, accelerator: str, tp: int) -> OperatorProfile | None:
    """The layer profile of (model, accelerator) at ``tp``; None where Vidur measured none."""
    folder = PROFILED.get((model, accelerator))
    if folder is None:
        return None
    path = DATA / "compute" / folder / "mlp.csv"
    xs, ys = _table(path, "num_tokens", lambda r: sum(float(r[f"{op}_median_ms"]) for op in OPERATORS),
                    "num_tensor_parallel_workers", tp)
    if not len(xs):
        return None
    return OperatorProfile(xs, ys, f"vidur data/profiling/compute/{folder}/mlp.csv, tp {tp}")


@functools.lru_cache(maxsize=16)
def load_allreduce(accelerator: str, tp: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(bytes, ms) of Vidur's measured all-reduces over ``tp`` accelerators of one node; None where none."""
    net = NETWORKS.get(accelerator)
    if net is None or tp == 1:
        return None
    xs, ys = _table(DATA / "network" / net / "all_reduce.csv", "size_bytes",
                    lambda r: float(r["all_reduce_median_ms"]), "num_workers", tp)
    return (xs, ys) if len(xs) else None


@dataclass(frozen=True, eq=False)
class ProfileCost:
    """A step's time from a measured layer profile (see the module's docstring for the sum)."""

    model: hw.ModelShape
    acc: hw.Accelerator
    profile: OperatorProfile
    allreduce: tuple[np.ndarray, np.ndarray] | None = None
    tp: int = 1
    mfu: float = hw.DEFAULT_MFU
    mbu: float = hw.DEFAULT_MBU
    overhead_us: float = hw.DEFAULT_OVERHEAD_US

    def allreduce_ns(self, nbytes: float) -> float:
        if self.tp == 1:
            return 0.0
        if self.allreduce is None:
            return hw.allreduce_ns(self.acc, self.tp, nbytes)
        return _proportional_interp(nbytes, *self.allreduce, floor=True) * 1e6

    def parts_ns(self, b: hw.Batch) -> dict[str, float]:
        """The step's time by part, ns: the profiled layers, attention, LM head, all-reduces, overhead."""
        m, acc, tp = self.model, self.acc, self.tp
        flops_s, bytes_s = acc.tflops * 1e12 * self.mfu, acc.hbm_gbps * 1e9 * self.mbu
        attention = max(4.0 * m.layers * m.hidden * b.pairs / tp / flops_s,
                        m.kv_bytes_per_token_per_gpu(tp) * b.context / bytes_s)
        head = max(2.0 * m.hidden * m.vocab * b.sampled / tp / flops_s,
                   m.hidden * m.vocab * m.dtype_bytes / tp / bytes_s) if b.sampled else 0.0
        return {"layers": m.layers * self.profile.layer_ns(b.tokens), "attention": attention * 1e9,
                "lm_head": head * 1e9, "allreduce": 2 * m.layers * self.allreduce_ns(b.tokens * m.hidden * 2),
                "overhead": self.overhead_us * 1e3}

    def step_ns(self, b: hw.Batch) -> float:
        if b.seqs == 0:
            return 0.0
        return sum(self.parts_ns(b).values())

    def describe(self) -> dict[str, Any]:
        return {"kind": "profile", "source": self.profile.source, "accelerator": self.acc.to_dict(), "tp": self.tp,
                "allreduce": "measured" if self.allreduce is not None else "ring formula",
                "mfu": self.mfu, "mbu": self.mbu, "overhead_us": self.overhead_us}


def step_cost(kind: str, model: str, shape: hw.ModelShape, accelerator: str, *, tp: int = 1,
              mfu: float = hw.DEFAULT_MFU, mbu: float = hw.DEFAULT_MBU,
              overhead_us: float = hw.DEFAULT_OVERHEAD_US) -> hw.StepCost:
    """``kind`` "profile": :class:`ProfileCost` where Vidur profiled (model, accelerator) at ``tp``,
    else the roofline; "roofline": the roofline. ValueError names the kinds."""
    if kind not in COST_MODELS:
        raise ValueError(f"unknown cost model {kind!r}: choose from {', '.join(COST_MODELS)}")
    acc = hw.ACCELERATORS[accelerator]
    profile = load_profile(model, accelerator, tp) if kind == "profile" else None
    if profile is None:
        return hw.Roofline(shape, acc, mfu, mbu, overhead_us, tp)
    hw.Roofline(shape, acc, mfu, mbu, overhead_us, tp)  # the same checks: mfu, mbu, the split, NVLink
    return ProfileCost(shape, acc, profile, load_allreduce(accelerator, tp), tp, mfu, mbu, overhead_us)
