"""Mooncake's public request traces (kvcache-ai/Mooncake, ``FAST25-release/traces``), read as they are.

One JSON object a line: ``timestamp`` (arrival, ms from the trace's start), ``input_length``
(prompt tokens), ``output_length`` (generated tokens), ``hash_ids`` (one id per 512-token block of
the prompt, a prefix chain: two requests sharing their first k ids share their first k x 512
tokens). A 512-token trace block is 32 of vLLM's 16-token blocks; the last one of a prompt holds
what is left of it (``input_length - 512 x (len(hash_ids) - 1)`` tokens).

:func:`load` gives :class:`TraceRequest` records (``--speed`` divides the arrival times);
:func:`to_scripts` turns them into the engine's open-loop clients (``cxlemu sim serve --workload
trace``): one client a request, its turn arriving at the request's time, block ``j``'s owner the
hash id of the trace block holding the block's last token, so equal keys mean equal prefixes.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tools.sim.workload import REST, ClientScript, Turn, TraceError

__all__ = ["TRACE_BLOCK_TOKENS", "MooncakeTraceError", "TraceRequest", "capped_hit_tokens", "is_mooncake", "load",
           "read", "theoretical_hit_rate", "to_scripts"]

#: tokens per hash id in Mooncake's traces (its README: "block size 512")
TRACE_BLOCK_TOKENS = 512


class MooncakeTraceError(TraceError):
    """A Mooncake trace line that cannot be read: ``line`` is its number (1-based), the message
    says what is wrong and what the line must hold."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: arrival in ns (speed applied), prompt and output tokens, the prompt's
    512-token block ids."""

    index: int
    arrival_ns: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, i: int) -> int:
        """Prompt tokens in trace block ``i`` (512 but for the last one)."""
        return min(TRACE_BLOCK_TOKENS, self.input_length - i * TRACE_BLOCK_TOKENS)


_FIELDS = "timestamp (ms), input_length, output_length and hash_ids"


def _whole(rec: dict[str, Any], key: str, no: int, low: int) -> int:
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise MooncakeTraceError(no, f"{key} must be a whole number, got {v!r} (a line holds {_FIELDS})")
    if v < low:
        raise MooncakeTraceError(no, f"{key} must be >= {low}, got {v}")
    return v


def _record(no: int, line: str, index: int, speed: float, last_ms: float) -> TraceRequest:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as exc:
        raise MooncakeTraceError(no, f"not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(rec, dict):
        raise MooncakeTraceError(no, f"expected an object with {_FIELDS}, got {type(rec).__name__}")
    ts = rec.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise MooncakeTraceError(no, f"timestamp must be a number of ms >= 0, got {ts!r}")
    if ts < last_ms:
        raise MooncakeTraceError(no, f"timestamp {ts} is before the previous line's {last_ms}: a trace is in "
                                     "arrival order")
    prompt = _whole(rec, "input_length", no, 1)
    output = _whole(rec, "output_length", no, 1)
    ids = rec.get("hash_ids")
    if not isinstance(ids, list) or any(isinstance(h, bool) or not isinstance(h, int) for h in ids):
        raise MooncakeTraceError(no, f"hash_ids must be a list of whole numbers, got {ids!r}")
    need = -(-prompt // TRACE_BLOCK_TOKENS)
    if len(ids) != need:
        raise MooncakeTraceError(no, f"{prompt} prompt tokens are {need} blocks of {TRACE_BLOCK_TOKENS}, but "
                                     f"hash_ids has {len(ids)}")
    return TraceRequest(index, ts * 1e6 / speed, prompt, output, tuple(ids))


def read(lines: Iterable[str], speed: float = 1.0) -> Iterator[TraceRequest]:
    """Parse Mooncake JSON lines (blank lines skipped); arrival times divided by ``speed``.
    Raises :class:`MooncakeTraceError` naming the first bad line."""
    if not (isinstance(speed, (int, float)) and math.isfinite(speed) and speed > 0):
        raise ValueError(f"speed must be a number > 0, got {speed!r}")
    last = 0.0
    index = 0
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        req = _record(no, line, index, speed, last)
        last = req.arrival_ns * speed / 1e6
        index += 1
        yield req


def load(path: str, speed: float = 1.0, limit: int | None = None) -> list[TraceRequest]:
    """The requests of the trace at ``path`` (the first ``limit``); an empty trace is an error."""
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for req in read(f, speed):
            out.append(req)
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise MooncakeTraceError(0, "the trace holds no requests")
    return out


def is_mooncake(first_line: str) -> bool:
    """Whether a trace's first line is Mooncake's format (it has ``hash_ids``), not a session trace."""
    try:
        rec = json.loads(first_line)
    except json.JSONDecodeError:
        return False
    return isinstance(rec, dict) and "hash_ids" in rec


def theoretical_hit_rate(requests: Sequence[TraceRequest], block_tokens: int = 16) -> float:
    """Prompt tokens an unbounded prefix cache serves / prompt tokens: a block hits when its id
    was seen before and every earlier block of the request hit; the hit tokens of a request are
    capped at ``input_length - 1`` in whole ``block_tokens`` blocks, as vLLM caps them."""
    seen: set[int] = set()
    hit = total = 0
    for r in requests:
        n = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            n += 1
        hit += capped_hit_tokens(r, n, block_tokens)
        total += r.input_length
        seen.update(r.hash_ids)
    return hit / total if total else 0.0


def capped_hit_tokens(r: TraceRequest, blocks: int, block_tokens: int = 16) -> int:
    """Tokens of ``r``'s first ``blocks`` trace blocks an engine of ``block_tokens``-token blocks
    can use: whole engine blocks, at most ``input_length - 1`` tokens (one is always computed)."""
    tokens = min(blocks * TRACE_BLOCK_TOKENS, r.input_length)
    return min(tokens, r.input_length - 1) // block_tokens * block_tokens


def to_scripts(requests: Sequence[TraceRequest]) -> list[ClientScript]:
    """The engine's open-loop clients: one a request, arriving at its time (``think_s``), its
    prompt's segments the trace blocks (owner ``("mc", hash id)``), the output its own."""
    out = []
    for r in requests:
        segs = [(("mc", h), min((i + 1) * TRACE_BLOCK_TOKENS, r.input_length)) for i, h in enumerate(r.hash_ids)]
        segs.append((("mc-out", r.index), REST))
        out.append(ClientScript(f"r{r.index}", "trace", (Turn(tuple(segs), r.input_length, r.output_length,
                                                              r.arrival_ns / 1e9),)))
    return out
