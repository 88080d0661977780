"""`cxlemu quality train`: rebuild the quality yardstick's weights (``tools.quality``); `cxlemu
quality probe`: where its attention goes when it answers (``tools.quality.probe``)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tools.cli._common import CliError, need_extra, print_json


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("quality", help="rebuild the quality yardstick (a small Llama that attends far)")
    sub = p.add_subparsers(dest="quality", metavar="ACTION", parser_class=type(p))
    sub.required = True
    t = sub.add_parser("train", help="train the yardstick from its seed (deterministic; about 430 CPU-s on 1 thread)")
    t.add_argument("--out", type=Path, help="write the weights here instead of the shipped tools/quality/data/")
    t.add_argument("--steps", type=int, help="training steps (default: the shipped run's)")
    t.add_argument("--check", action="store_true",
                   help="train into a temporary folder and compare the sha256 with the shipped weights'")
    t.set_defaults(func=cmd_train)
    pr = sub.add_parser("probe", help="where the yardstick's attention goes at the needle and recall answers "
                                      "(dense attention, held-out documents)")
    pr.add_argument("--context", type=int, action="append", help="context tokens (repeatable; default 2048)")
    pr.add_argument("--examples", type=int, default=16, help="held-out documents per context (default 16)")
    pr.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    pr.add_argument("--json", action="store_true", help="JSON rows instead of a markdown table")
    pr.set_defaults(func=cmd_probe)


def _monitor(step: int, model: Any) -> None:
    """Held-out accuracy at 512 and 2048 tokens while training (4 documents each; seeds past
    the bench's, which training never draws)."""
    from tools.bench.quality import EVAL_SEED
    from tools.quality.evaluate import forward_accuracy

    text = ", ".join(f"{n}: needle {a:.2f} recall {b:.2f}"
                     for n in (512, 2048) for a, b in [forward_accuracy(model, n, 4, EVAL_SEED + 1_000_000)])
    print(f"step {step}: held-out {text}", file=sys.stderr, flush=True)


def cmd_train(args: Any) -> int:
    if args.steps is not None and args.steps < 1:
        raise CliError(f"--steps must be >= 1, got {args.steps}")
    if args.check and args.out is not None:
        raise CliError("give --check or --out, not both")
    need_extra("torch", "kv", "quality train")
    need_extra("transformers", "kv", "quality train")
    import dataclasses
    import tempfile

    from tools.quality import model as store
    from tools.quality.train import ModelSpec, TrainSpec, train

    spec = TrainSpec() if args.steps is None else dataclasses.replace(TrainSpec(), steps=args.steps)
    model, figures = train(ModelSpec(), spec, progress=lambda step, loss, s: print(
        f"step {step}/{spec.steps}: loss {loss:.4f}, {s:.0f} s", file=sys.stderr, flush=True), monitor=_monitor)
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            digest = store.save(model, ModelSpec(), spec, figures, Path(tmp))
        shipped = store.read_meta()["sha256"]
        print_json({"sha256": digest, "shipped": shipped, "equal": digest == shipped} | figures)
        return 0 if digest == shipped else 1
    digest = store.save(model, ModelSpec(), spec, figures, args.out or store.DATA_DIR)
    print_json({"sha256": digest} | figures)
    return 0


def cmd_probe(args: Any) -> int:
    from tools.cli.bench.quality import check_documents

    contexts = args.context or [2048]
    check_documents(contexts, args.examples, args.threads)
    torch = need_extra("torch", "kv", "quality probe")
    need_extra("transformers", "kv", "quality probe")
    from tools.bench.quality import EVAL_SEED
    from tools.quality import model as store
    from tools.quality.probe import FIGURES, probe

    torch.set_num_threads(args.threads)
    rows = probe(store.load(), contexts, args.examples, EVAL_SEED)  # the bench's held-out documents
    if args.json:
        print_json([r.to_dict() for r in rows])
        return 0
    print("| context | layer | head | " + " | ".join(f.replace("_", " ") for f in FIGURES) + " |")
    print("|" + "---|" * (3 + len(FIGURES)))
    for r in rows:
        print(f"| {r.context} | {r.layer} | {r.head} | " + " | ".join(f"{getattr(r, f):.3f}" for f in FIGURES) + " |")
    return 0
