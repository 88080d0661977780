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

``cxlemu bench serve``'s own workload is here too (:class:`WorkloadConfig`, :func:`clients`): what
a serving engine sees when clients come back, seeded, identical in every mode so that tokens can
be compared request by request:

* a *session* client resends its conversation: turn k's prompt is the shared system prompt, then
  every earlier turn's user tokens and the engine's output, then turn k's new user tokens — so
  the prefix grows by one turn each time and the whole earlier context can be reused;
* a *document* client asks ``turns`` questions about one long document of its own: the document
  is the reusable prefix, each question new.

Client ``i`` of a level is a document client when ``i % doc_every == doc_every - 1``. Clients are
closed-loop with think time: a client's first turn arrives at a seeded offset in [0, T), each next
turn a seeded time in [T/2, 3T/2) after its previous one finished, where T (seconds) is
``think_contexts`` x the time the bench's machine takes to prefill one whole client context
(measured by the bench), so the same workload loads a fast and a slow machine alike.
"""
from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

__all__ = ["FIRST_TOKEN_ID", "REST", "Client", "ClientScript", "Turn", "WorkloadConfig", "clients", "fixed",
           "from_bench", "load_trace", "sessions", "system_prompt", "write_trace"]


# --- cxlemu bench serve's clients (token ids: the bench sends them to vLLM) ------------------
FIRST_TOKEN_ID = 4  # ids below are the tokenizer's specials (<pad>, <s>, </s>, <unk>)


@dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    system_tokens: int = 256
    user_tokens: int = 120  # a turn adds user + output tokens, not a multiple of the block: turns'
    output_tokens: int = 16  # decodes cross block boundaries, so vLLM must find (or preempt for) blocks
    turns: int = 4
    doc_tokens: int = 576
    doc_every: int = 4
    think_contexts: float = 3.0  # T; at 1.0 the first turns' burst saturated every mode alike
    vocab: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("system_tokens", "user_tokens", "output_tokens", "turns", "doc_tokens", "doc_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.think_contexts >= 0:
            raise ValueError(f"think_contexts must be >= 0, got {self.think_contexts}")
        if self.vocab <= FIRST_TOKEN_ID + 1:
            raise ValueError(f"vocab must be > {FIRST_TOKEN_ID + 1}, got {self.vocab}")

    @property
    def context_tokens(self) -> int:
        """The most KV one client holds: its last turn's prompt plus its output."""
        session = self.system_tokens + self.turns * (self.user_tokens + self.output_tokens)
        return max(session, self.doc_tokens + self.user_tokens + self.output_tokens)

    def blocks_per_client(self, block_tokens: int) -> int:
        return -(-self.context_tokens // block_tokens)


@dataclass(frozen=True)
class Client:
    """One closed-loop client of one level: its kind and the tokens it will send."""

    level: int
    index: int
    kind: str  # "session" | "doc"
    prefix: tuple[int, ...]  # the system prompt (sessions) or the document (doc clients)
    user: tuple[tuple[int, ...], ...]  # new tokens of each turn
    start: float = 0.0  # first arrival, in units of the think time T
    think: tuple[float, ...] = ()  # before each later turn, in units of T

    def arrival_after(self, turn: int, think_s: float) -> float:
        """Seconds after the level's start (turn 0) or after turn-1's finish (later turns)."""
        return (self.start if turn == 0 else self.think[turn - 1]) * think_s

    @property
    def turns(self) -> int:
        return len(self.user)

    def prompt(self, turn: int, outputs: Sequence[Sequence[int]]) -> list[int]:
        """Turn ``turn``'s prompt, given the outputs of the turns before it."""
        if not 0 <= turn < self.turns:
            raise IndexError(f"client {self.index} has turns 0..{self.turns - 1}, not {turn}")
        if self.kind == "doc":
            return [*self.prefix, *self.user[turn]]
        if len(outputs) < turn:
            raise ValueError(f"session turn {turn} needs the outputs of turns 0..{turn - 1}")
        ids = list(self.prefix)
        for k in range(turn):
            ids += [*self.user[k], *outputs[k]]
        return ids + list(self.user[turn])

    def request_id(self, turn: int) -> str:
        return f"c{self.level}-k{self.index}-t{turn}"


def _tokens(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n))


def system_prompt(cfg: WorkloadConfig) -> tuple[int, ...]:
    return _tokens(random.Random(f"{cfg.seed}:system"), cfg.system_tokens, cfg.vocab)


def clients(cfg: WorkloadConfig, level: int) -> list[Client]:
    """The ``level`` clients of one concurrency level (seeded by seed, level and index)."""
    system = system_prompt(cfg)
    out = []
    for i in range(level):
        rng = random.Random(f"{cfg.seed}:{level}:{i}")
        doc = i % cfg.doc_every == cfg.doc_every - 1
        prefix = _tokens(rng, cfg.doc_tokens, cfg.vocab) if doc else system
        user = tuple(_tokens(rng, cfg.user_tokens, cfg.vocab) for _ in range(cfg.turns))
        start = rng.random()
        think = tuple(0.5 + rng.random() for _ in range(cfg.turns - 1))
        out.append(Client(level, i, "doc" if doc else "session", prefix, user, start, think))
    return out



# --- the simulator's client scripts ------------------------------------------------------------

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
    """``cxlemu bench serve``'s ``level`` clients (:func:`clients`): the
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
