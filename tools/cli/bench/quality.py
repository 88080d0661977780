"""`cxlemu bench quality`: each KV mode's needle and recall accuracy and perplexity on the trained
yardstick against dense attention (``tools.bench.quality``)."""
from __future__ import annotations

import sys
from typing import Any

from tools.cli._common import CliError, need_extra, print_json

DEFAULT_CONTEXTS = [2048, 4096, 8192]
DEFAULT_MODES = ["dense", "hot", "h2o", "int8", "int4"]


def register_quality(bench: Any) -> None:
    p = bench.add_parser("quality", help="accuracy and perplexity of each KV mode (hot pages, H2O, int8, "
                                         "int4) against dense, on a model trained to attend far")
    p.add_argument("--context", type=int, action="append",
                   help="context tokens (repeatable; default 2048, 4096, 8192)")
    p.add_argument("--mode", action="append",
                   help=f"KV modes (repeatable; default {', '.join(DEFAULT_MODES)}); dense always runs first")
    p.add_argument("--examples", type=int, default=16, help="held-out documents per context (default 16)")
    p.add_argument("--page-budget", type=float, default=0.1,
                   help="fraction of the pages hot attention reads and H2O keeps (default 0.1)")
    p.add_argument("--selector",
                   help="hot attention's page selector: a built-in name or 'package.module:Class' (default quest)")
    p.add_argument("--block-tokens", type=int,
                   help="tokens per KV page of the modes that read pages from the device (default 16, Quest's)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--markdown", action="store_true", help="a markdown table (for BENCHMARKS.md)")
    p.add_argument("--json", action="store_true", help="JSON instead of a table")
    p.set_defaults(func=cmd_quality)


def check_documents(contexts: list[int], examples: int, threads: int) -> None:
    """``--context`` (each one a document fits), ``--examples`` and ``--threads``, or CliError."""
    from tools.quality.tasks import make_document

    for c in contexts:
        try:
            make_document(c, 0)
        except ValueError as exc:
            raise CliError(f"--context {c}: {exc}") from None
    if examples < 1:
        raise CliError(f"--examples must be >= 1, got {examples}")
    if threads < 1:
        raise CliError(f"--threads must be >= 1, got {threads}")


def cmd_quality(args: Any) -> int:
    contexts = args.context or DEFAULT_CONTEXTS
    check_documents(contexts, args.examples, args.threads)
    if not 0 < args.page_budget <= 1:
        raise CliError(f"--page-budget is a fraction in (0, 1], got {args.page_budget}")
    if args.block_tokens is not None and args.block_tokens < 1:
        raise CliError(f"--block-tokens must be >= 1, got {args.block_tokens}")
    from tools.bench import quality

    modes = list(dict.fromkeys(["dense"] + (args.mode or DEFAULT_MODES)))
    unknown = [m for m in modes if m not in quality.MODES]
    if unknown:
        raise CliError(f"unknown mode {unknown[0]!r}: choose from {', '.join(quality.MODES)}")
    torch = need_extra("torch", "kv", "bench quality")
    need_extra("transformers", "kv", "bench quality")
    from tools.quality import model as yardstick

    quality.check_modes(modes)  # a mode this checkout's CxlCache lacks is refused before any work
    given = {"block_tokens": args.block_tokens, "selector": args.selector}
    pages = quality.Pages(**{k: v for k, v in given.items() if v is not None})
    _check_selector(pages.selector)
    torch.set_num_threads(args.threads)
    model = yardstick.load()
    from rich.console import Console

    with Console(stderr=True).status("bench quality") as status:
        rows = quality.run(model, contexts=contexts, examples=args.examples, modes=modes,
                           page_budget=args.page_budget, pages=pages,
                           progress=lambda m: status.update(f"bench quality: {m}"))
    if args.json:
        print_json([r.to_dict() for r in rows])
    elif args.markdown:
        print(markdown(rows))
    else:
        Console(width=None if sys.stdout.isatty() else 140).print(render(rows))
    dense_exact = all(r.agreement == 1.0 for r in rows if r.mode == "dense")
    return 0 if dense_exact else 1


def _check_selector(spec: str) -> None:
    """An unknown selector, or a class that lacks the protocol, is one line before any work."""
    from driver.kv.selectors import resolve_selector

    try:
        resolve_selector(spec)
    except (TypeError, ValueError) as exc:
        raise CliError(f"--selector {spec}: {exc}") from None


_COLUMNS = ("mode", "page budget", "kv format", "context", "examples", "needle acc", "recall acc", "perplexity",
            "agrees with DynamicCache", "MB read / doc", "s")


def _cells(r: Any) -> list[str]:
    return [r.mode, f"{r.page_budget:g}", r.kv_format, str(r.context), str(r.examples), f"{r.needle_acc:.3f}",
            f"{r.recall_acc:.3f}", f"{r.perplexity:.4f}", f"{r.agreement:.3f}", f"{r.mb_loaded:.2f}",
            f"{r.seconds:.0f}"]


def _goal_cells(g: Any) -> list[str]:
    return [g.mode, str(g.context), f"{g.needle_ratio:.3f}", f"{g.recall_ratio:.3f}", f"{g.ppl_ratio:.4f}",
            "met" if g.met else "NOT met"]


_GOAL_COLUMNS = ("mode", "context", "needle / dense", "recall / dense", "ppl / dense", "goal")

_WHY_COLUMNS = ("mode", "context", "needles lost / gained vs dense", "recall lost / gained vs dense (sign test p)",
                "answer page read (needle / recall)", "by layer", "needle misses: unread / read",
                "recall misses: unread / read", "lost: unread", "doc's values read at recall, by layer",
                "ppl tail: chosen pages holding a fact (of pages chosen)", "predicted")


_GUESS_COLUMNS = ("mode", "context", "recall: right", "another unanswered value of the doc", "a value already answered",
                  "a value not in the doc", "a uniform guess among the unanswered values: right")


def _guess_cells(r: Any) -> list[str]:
    from tools.bench.quality_reads import guess_chance
    from tools.quality.tasks import RECALL_PAIRS

    return [r.mode, str(r.context), f"{r.recall_acc:.3f}", _opt(r.recall_unasked, "{:.3f}"),
            _opt(r.recall_answered, "{:.3f}"), _opt(r.recall_foreign, "{:.3f}"), f"{guess_chance(RECALL_PAIRS):.3f}"]


def _opt(x: Any, fmt: str = "{}") -> str:
    return "-" if x is None else fmt.format(x)


def _why_cells(r: Any) -> list[str]:
    """The diagnosis of one sparse row (``tools.bench.quality_reads``)."""
    lost_unread = None if r.needle_lost_unread is None else f"{r.needle_lost_unread} + {r.recall_lost_unread}"
    layers = None if r.answer_page_read_by_layer is None else " / ".join(
        f"{x:.2f}" for x in r.answer_page_read_by_layer)
    values = None if r.recall_values_read_by_layer is None else " / ".join(
        f"{x:.2f}" for x in r.recall_values_read_by_layer)
    label = r.mode if r.selector is None else f"{r.mode} ({r.selector}, {r.block_tokens}-token pages)"
    from tools.bench.quality_reads import sign_test

    recall = f"{r.recall_lost} / {r.recall_gained} ({sign_test(r.recall_lost, r.recall_gained):.2f})"
    return [label, str(r.context), f"{r.needle_lost} / {r.needle_gained}", recall,
            f"{_opt(r.needle_page_read, '{:.2f}')} / {_opt(r.recall_page_read, '{:.2f}')}", _opt(layers),
            f"{_opt(r.needle_miss_unread)} / {_opt(r.needle_miss_read)}",
            f"{_opt(r.recall_miss_unread)} / {_opt(r.recall_miss_read)}", _opt(lost_unread), _opt(values),
            "-" if r.tail_fact_share is None else f"{r.tail_fact_share:.2f} (of {r.tail_pages_chosen:.1f})",
            _opt(r.predicted, "{:.3f}")]


def render(rows: list[Any]) -> Any:
    """The rows and the goals as rich tables (pure)."""
    from rich.console import Group
    from rich.table import Table

    from tools.bench.quality import goals

    t = Table(title="bench quality: the trained yardstick through each KV mode")
    for col in _COLUMNS:
        t.add_column(col, justify="left" if col in ("mode", "kv format") else "right")
    for r in rows:
        t.add_row(*_cells(r))
    g = Table(title="goals against dense (hot: acc >= 0.99x, ppl <= 1.01x; int8: acc >= 0.99x, ppl <= 1.005x; "
                    "int4: ppl <= 1.03x)")
    for col in _GOAL_COLUMNS:
        g.add_column(col)
    for goal in goals(rows):
        g.add_row(*_goal_cells(goal))
    w = Table(title="why answers were lost: paired with dense's, and whether every layer (some KV head) read the "
                    "answer's source page")
    for col in _WHY_COLUMNS:
        w.add_column(col)
    for r in rows:
        if r.mode != "dense":
            w.add_row(*_why_cells(r))
    guesses = Table(title="what the recall answers were (fractions of the recall queries)")
    for col in _GUESS_COLUMNS:
        guesses.add_column(col)
    for r in rows:
        guesses.add_row(*_guess_cells(r))
    return Group(t, g, w, guesses)


def markdown(rows: list[Any]) -> str:
    """The rows and the goals as markdown tables."""
    from tools.bench.quality import goals

    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    found = goals(rows)
    if found:
        lines += ["", "| " + " | ".join(_GOAL_COLUMNS) + " |", "|" + "---|" * len(_GOAL_COLUMNS)]
        lines += ["| " + " | ".join(_goal_cells(g)) + " |" for g in found]
    why = [r for r in rows if r.mode != "dense"]
    if why:
        lines += ["", "| " + " | ".join(_WHY_COLUMNS) + " |", "|" + "---|" * len(_WHY_COLUMNS)]
        lines += ["| " + " | ".join(_why_cells(r)) + " |" for r in why]
    lines += ["", "| " + " | ".join(_GUESS_COLUMNS) + " |", "|" + "---|" * len(_GUESS_COLUMNS)]
    lines += ["| " + " | ".join(_guess_cells(r)) + " |" for r in rows]
    return "\n".join(lines)
