"""The step cost models against published measurements (``cxlemu sim check``).

TensorRT-LLM's performance page published first-token latencies measured on A100 SXM4 80GB, FP16,
batch 1: the time of one prefill of the prompt. Each row here is one of them, and beside it what
the simulator's two cost models (:mod:`tools.sim.profile`: Vidur's measured operators; the
roofline of :mod:`tools.sim.hardware`) give for that prefill, with their default efficiencies and
per-step overhead. LLaMA-7B (v1) has Llama-2-7B's shape; the page's LLaMA-70B is Llama-2-70B.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tools.sim import hardware as hw
from tools.sim.profile import step_cost

__all__ = ["PUBLISHED", "Published", "check"]

TRT_LLM = ("NVIDIA TensorRT-LLM performance page: first-token latency, A100 SXM4 80GB, FP16, "
           "batch 1 (LLaMA-7B; LLaMA-70B with tensor parallelism 4)")


@dataclass(frozen=True)
class Published:
    model: str
    accelerator: str
    tp: int
    input_tokens: int
    batch: int
    published_ms: float
    source: str = TRT_LLM


PUBLISHED = (
    Published("llama-2-7b", "a100-80gb", 1, 128, 1, 16.0),
    Published("llama-2-7b", "a100-80gb", 1, 2048, 1, 133.0),
    Published("llama-2-70b", "a100-80gb", 4, 128, 1, 47.0),
    Published("llama-2-70b", "a100-80gb", 4, 2048, 1, 377.0),
)


def prefill_ms(kind: str, row: Published) -> float:
    """One step prefilling ``batch`` prompts of ``input_tokens`` and sampling their first tokens."""
    b = hw.Batch()
    for _ in range(row.batch):
        b.add(row.input_tokens, 0, True)
    cost = step_cost(kind, row.model, hw.MODELS[row.model], row.accelerator, tp=row.tp)
    return cost.step_ns(b) / 1e6


def check(rows: tuple[Published, ...] = PUBLISHED) -> list[dict[str, Any]]:
    """Per published row: its fields, each cost model's milliseconds, their ratios to the published
    figure, and which cost the "profile" model really used (the roofline where Vidur has no profile)."""
    out = []
    for r in rows:
        profile, roofline = prefill_ms("profile", r), prefill_ms("roofline", r)
        used = step_cost("profile", r.model, hw.MODELS[r.model], r.accelerator, tp=r.tp).describe()["kind"]
        out.append({"model": r.model, "accelerator": r.accelerator, "tp": r.tp, "input_tokens": r.input_tokens,
                    "batch": r.batch, "published_ms": r.published_ms, "profile_ms": profile, "roofline_ms": roofline,
                    "profile_ratio": profile / r.published_ms, "roofline_ratio": roofline / r.published_ms,
                    "profile_used": used, "source": r.source})
    return out
