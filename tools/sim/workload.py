"""What the simulated engine serves: closed-loop clients, each a script of turns.

A turn's prompt is described by who owns its tokens, not by the tokens: ``segments`` is a tuple
of ``(owner, upto)`` — positions below ``upto`` (and above the previous segment's) hold content
that ``owner`` determines, and the last owner also owns every later position (the turn's output,
the next turns). Two requests hold the same KV block ``i`` exactly when the owner of the block's
last position is the same: an owner's content extends its predecessors', as a chained block hash
does. So the prefix cache and the tier find a session's history, a shared system prompt or a
document without a token in sight, and 10,000 sessions cost no hashing.

Workloads:

* :func:`fixed` — the seed's: ``clients`` clients, each sending ``requests`` independent
  ``context``-token sequences (prompt + output) back to back;
* :func:`sessions` — multi-turn chat: ``sessions`` sessions run ``concurrency`` at a time, each
  ``turns`` turns that resend the growing conversation after a think time, opening with one of
  ``system_prompts`` shared system prompts;
* :func:`from_bench` — ``cxlemu bench serve``'s clients (sessions and document clients) at one
  level, for validation against its runs;
* :func:`load_trace` / :func:`write_trace` — the same as a JSON-lines file (``cxlemu trace gen
  sessions`` writes one).
"""
from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from tools.sim.serve_workload import WorkloadConfig, clients

__all__ = ["REST", "ClientScript", "Turn", "fixed", "from_bench", "load_trace", "sessions", "write_trace"]


#: the ``upto`` of a last segment: its owner owns every later position
REST = 1 << 62


@dataclass(frozen=True, slots=True)
class Turn:
    segments: tuple[tuple[Any, int], ...]
    prompt_tokens: int
    output_tokens: int
    think_s: float  # before this turn: after the client's start (turn 0) or its previous turn's end

    def owner_at(self, pos: int) -> Any:
        for owner, upto in self.segments:
            if pos < upto:
                return owner
        return self.segments[-1][0]


@dataclass(frozen=True, slots=True)
class ClientScript:
    """One closed-loop client: its turns in order (a session, a document reader, a slot of
    back-to-back requests). ``kind`` labels it for the metrics ("session" turns after the first
    count as returning)."""

    name: str
    kind: str
    turns: tuple[Turn, ...]


def _check(**values: int) -> None:
    for k, v in values.items():
        if v < 1:
            raise ValueError(f"{k} must be >= 1, got {v}")


def fixed(*, clients: int, context: int, output_tokens: int, requests: int = 4,
          stagger_s: float = 0.0) -> list[ClientScript]:
    """``clients`` clients, each ``requests`` fresh sequences of ``context`` tokens (``context -
    output_tokens`` prompt) back to back: the seed's experiment. Client ``i``'s first request
    arrives at ``i x stagger_s / clients``: a stagger of one request's lifetime spreads the
    clients over it as a long-running benchmark's are (identical clients started together stay in
    lock step: all prefill, then all decode)."""
    _check(clients=clients, context=context, output_tokens=output_tokens, requests=requests)
    if output_tokens >= context:
        raise ValueError(f"output_tokens ({output_tokens}) must be < context ({context})")
    if not stagger_s >= 0:
        raise ValueError(f"stagger_s must be >= 0, got {stagger_s}")
    prompt = context - output_tokens
    return [ClientScript(f"c{i}", "fixed", tuple(Turn(((("r", i, k), REST),), prompt, output_tokens,
                                                      i * stagger_s / clients if k == 0 else 0.0)
                                                 for k in range(requests)))
            for i in range(clients)]


def _session_turns(sid: Any, system: Any, *, system_tokens: int, user_tokens: int, output_tokens: int,
                   turns: int, think: list[float]) -> tuple[Turn, ...]:
    out = []
    for k in range(turns):
        prompt = system_tokens + k * (user_tokens + output_tokens) + user_tokens
        out.append(Turn(((system, system_tokens), (sid, REST)), prompt, output_tokens, think[k]))
    return tuple(out)


def sessions(*, sessions: int, concurrency: int, turns: int = 4, system_tokens: int = 1024,
             system_prompts: int = 4, user_tokens: int = 256, output_tokens: int = 128, think_s: float = 5.0,
             seed: int = 0) -> list[ClientScript]:
    """Multi-turn sessions, ``concurrency`` open at once: each slot runs its share of the sessions
    one after another. Think times are seeded, uniform in [T/2, 3T/2); each slot's first session
    starts at a seeded offset in [0, T)."""
    _check(sessions=sessions, concurrency=concurrency, turns=turns, system_prompts=system_prompts,
           user_tokens=user_tokens, output_tokens=output_tokens)
    if system_tokens < 0 or think_s < 0:
        raise ValueError("system_tokens and think_s must be >= 0")
    rng = random.Random(f"sessions:{seed}")
    slots: list[list[Turn]] = [[] for _ in range(min(concurrency, sessions))]
    for s in range(sessions):
        slot = s % len(slots)
        think = [think_s * (rng.random() if s < len(slots) else 0.5 + rng.random())]
        think += [think_s * (0.5 + rng.random()) for _ in range(turns - 1)]
        system = ("sys", rng.randrange(system_prompts))
        slots[slot] += _session_turns(("s", s), system, system_tokens=system_tokens, user_tokens=user_tokens,
                                      output_tokens=output_tokens, turns=turns, think=think)
    return [ClientScript(f"slot{i}", "session", tuple(t)) for i, t in enumerate(slots)]


def from_bench(workload: WorkloadConfig, level: int, think_s: float) -> list[ClientScript]:
    """``cxlemu bench serve``'s ``level`` clients (``tools.sim.serve_workload.clients``): the
    same kinds, prompt lengths, arrival offsets and think times."""
    out = []
    for c in clients(workload, level):
        think = [c.arrival_after(k, think_s) for k in range(c.turns)]
        if c.kind == "doc":
            turns = tuple(Turn(((("doc", level, c.index), workload.doc_tokens), (("q", level, c.index, k), REST)),
                               workload.doc_tokens + workload.user_tokens, workload.output_tokens, think[k])
                          for k in range(c.turns))
        else:
            turns = _session_turns(("s", level, c.index), ("sys", 0), system_tokens=workload.system_tokens,
                                   user_tokens=workload.user_tokens, output_tokens=workload.output_tokens,
                                   turns=c.turns, think=think)
        out.append(ClientScript(f"k{c.index}", c.kind, turns))
    return out


# --- trace files -------------------------------------------------------------------------------
def write_trace(scripts: Iterable[ClientScript], f: TextIO) -> int:
    """One JSON line per turn: client, kind, turn, think_s, prompt_tokens, output_tokens and the
    segments (owners as JSON lists). Returns the lines written."""
    n = 0
    for s in scripts:
        for k, t in enumerate(s.turns):
            f.write(json.dumps({"client": s.name, "kind": s.kind, "turn": k, "think_s": t.think_s,
                                "prompt_tokens": t.prompt_tokens, "output_tokens": t.output_tokens,
                                "segments": [[list(o) if isinstance(o, tuple) else o, u] for o, u in t.segments]})
                    + "\n")
            n += 1
    return n


class TraceError(ValueError):
    """A session trace line that cannot be read; says which line and what to change."""


def _frozen(x: Any) -> Any:
    return tuple(_frozen(v) for v in x) if isinstance(x, list) else x


def _lines(f: TextIO) -> Iterator[tuple[int, dict[str, Any]]]:
    for no, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"line {no}: not JSON ({exc.msg})") from None
        if not isinstance(rec, dict):
            raise TraceError(f"line {no}: expected an object, got {type(rec).__name__}")
        yield no, rec


def load_trace(f: TextIO) -> list[ClientScript]:
    """Read :func:`write_trace`'s format (turns of a client in order, clients in any order)."""
    clients: dict[str, tuple[str, list[Turn]]] = {}
    for no, rec in _lines(f):
        try:
            name, kind, turn = str(rec["client"]), str(rec.get("kind", "session")), int(rec["turn"])
            prompt, output = int(rec["prompt_tokens"]), int(rec["output_tokens"])
            think = float(rec.get("think_s", 0.0))
            segs = tuple((_frozen(o), int(u)) for o, u in rec["segments"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"line {no}: needs client, turn, prompt_tokens, output_tokens and segments "
                             f"[[owner, upto], ...] ({type(exc).__name__}: {exc})") from None
        if prompt < 1 or output < 1 or think < 0 or not segs:
            raise TraceError(f"line {no}: prompt_tokens and output_tokens must be >= 1, think_s >= 0, "
                             "segments non-empty")
        kind_turns = clients.setdefault(name, (kind, []))[1]
        if turn != len(kind_turns):
            raise TraceError(f"line {no}: client {name}'s turn {turn} follows turn {len(kind_turns) - 1}: "
                             "turns of a client must come in order from 0")
        kind_turns.append(Turn(segs, prompt, output, think))
    if not clients:
        raise TraceError("the trace holds no turns")
    return [ClientScript(name, kind, tuple(turns)) for name, (kind, turns) in clients.items()]
