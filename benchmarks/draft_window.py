"""The bounded draft context (`--draft-window W`): draft time per step against context length,
and τ with and without the window on long prompts (the README's figures).

    # draft time: one DFlash block (drafter forward + its LM head) at 512 / 2K / 8K tokens of context
    python benchmarks/draft_window.py cost [--contexts 512,2048,8000] [--windows none,256,512,1024,2048]
    # τ on long held-out ShareGPT conversations (the history as context, the last user turn answered)
    python benchmarks/draft_window.py tau [--min-tokens 1500] [--max-tokens 3500] [--prompts 4]
        [--windows none,512,1024]

`--doc FILE` also writes the table between FILE's `<!-- draft-window-cost -->` (or `-tau`) markers.

Draft time does not depend on what the context says, so `cost` fills the drafter's cache with
random features (one block anchored right after them) and reports the median of --repeats
timed drafts, windows interleaved. `tau` runs the target for real.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from blockdraft import Engine
from blockdraft.bench.runner import machine_info
from blockdraft.datasets import is_validation, sharegpt_later_turns
from blockdraft.proposers import DFlashProposer
from blockdraft.spec import SpecConfig


def _windows(text: str) -> list[int | None]:
    return [None if w == "none" else int(w) for w in text.split(",")]


def _label(window: int | None) -> str:
    return "none" if window is None else str(window)


@torch.inference_mode()
def cmd_cost(args, engine: Engine):
    drafter, target = engine.drafter_for("dflash"), engine.target
    block = drafter.config.block_size
    contexts, windows = [int(c) for c in args.contexts.split(",")], _windows(args.windows)
    width = len(drafter.config.target_layer_ids) * target.config.hidden_size
    times = {(c, w): [] for c in contexts for w in windows}
    proposers = {}
    for c in contexts:
        features = torch.randn(1, c, width, generator=torch.Generator().manual_seed(c))
        for w in windows:
            p = DFlashProposer(drafter, target, draft_window=w)
            p.reset(1, c + block)
            p.observe(None, features, torch.arange(c)[None], valid=torch.tensor([c]))
            p.propose(torch.tensor([1]), torch.tensor([c]), block - 1)  # writes the context, warms up
            proposers[c, w] = p
    for _ in range(args.repeats):  # interleaved, so machine noise hits every setting alike
        for (c, w), p in proposers.items():
            t0 = time.perf_counter()
            p.propose(torch.tensor([1]), torch.tensor([c]), block - 1)
            times[c, w].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [
        f"Draft time per step (ms, median of {args.repeats}, windows interleaved): one block of {block} "
        f"(the drafter's forward and its LM head), {_where(engine)}.",
        "",
        "| context tokens | " + " | ".join("whole context" if w is None else f"W = {w}" for w in windows) + " |",
        "|---|" + "---|" * len(windows),
    ]
    lines += [f"| {c} | " + " | ".join(f"{1e3 * med[c, w]:.2f}" for w in windows) + " |" for c in contexts]
    lines.append(
        f"| {contexts[-1]} vs {contexts[0]} | "
        + " | ".join(f"{med[contexts[-1], w] / med[contexts[0], w]:.2f}×" for w in windows)
        + " |"
    )
    _emit(args, "draft-window-cost", lines)


def _where(engine: Engine) -> str:
    folder = getattr(engine.drafter_for("dflash"), "folder", None)
    return (
        f"drafter {folder.name if folder else '(unsaved)'}, {machine_info(engine)['processor']}, "
        f"{torch.get_num_threads()} threads"
    )


def _emit(args, marker: str, lines: list[str]) -> None:
    text = "\n".join(lines)
    print(text)
    if args.doc:
        from doctable import write_between

        write_between(args.doc, marker, text)


def long_conversations(engine: Engine, count: int, lo: int, hi: int) -> list[list[int]]:
    """Held-out ShareGPT later turns whose chat-formatted history is lo..hi tokens."""
    found = []
    for rec in sharegpt_later_turns():
        if not is_validation(rec["group"]):
            continue
        ids = engine.encode_chat(rec["messages"])
        if lo <= len(ids) <= hi:
            found.append(ids)
            if len(found) == count:
                break
    return found


@torch.inference_mode()
def cmd_tau(args, engine: Engine):
    prompts = long_conversations(engine, args.prompts, args.min_tokens, args.max_tokens)
    windows = _windows(args.windows)
    print(f"{len(prompts)} held-out conversations of {', '.join(str(len(p)) for p in prompts)} tokens", flush=True)
    engine.generate(prompts[0][:64], method="ar", max_new_tokens=4)  # warm-up
    results = {}
    for ids in prompts:
        ar = engine.generate(ids, method="ar", max_new_tokens=args.max_new_tokens)
        for w in windows:
            out = engine.generate(ids, method=SpecConfig("dflash", window=w), max_new_tokens=args.max_new_tokens)
            assert out.token_ids == ar.token_ids, "the window changed the output (a bug)"
            r = results.setdefault(w, {"lengths": [], "draft": 0.0, "tokens": 0, "seconds": 0.0, "ar": 0.0})
            r["lengths"] += out.acceptance_lengths
            r["draft"] += out.draft_seconds
            r["seconds"] += out.decode_seconds
            r["tokens"] += out.num_output_tokens
            r["ar"] += ar.decode_seconds
    lines = [
        f"{len(prompts)} held-out ShareGPT conversations of {', '.join(str(len(p)) for p in prompts)} tokens, "
        f"{args.max_new_tokens} new tokens each, greedy (every window's output equal to `ar`'s), "
        f"{_where(engine)}.",
        "",
        "| draft window | τ | draft ms/step | dflash tok/s | speed vs ar |",
        "|---|---|---|---|---|",
    ]
    for w, r in results.items():
        steps = len(r["lengths"])
        lines.append(
            f"| {_label(w) if w is not None else 'whole context'} | {sum(r['lengths']) / steps:.3f} | "
            f"{1e3 * r['draft'] / steps:.2f} | {r['tokens'] / r['seconds']:.1f} | "
            f"{r['ar'] / r['seconds']:.2f}× |"
        )
    _emit(args, "draft-window-tau", lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cost")
    c.add_argument("--contexts", default="512,2048,8000")
    c.add_argument("--windows", default="none,256,512,1024,2048")
    c.add_argument("--repeats", type=int, default=30)
    t = sub.add_parser("tau")
    t.add_argument("--prompts", type=int, default=4)
    t.add_argument("--min-tokens", type=int, default=1500)
    t.add_argument("--max-tokens", type=int, default=3500)
    t.add_argument("--max-new-tokens", type=int, default=96)
    t.add_argument("--windows", default="none,512,1024")
    for sp in (c, t):
        sp.add_argument("--doc", type=Path, help="also write the table between this Markdown file's markers")
    args = ap.parse_args()
    engine = Engine.load()
    {"cost": cmd_cost, "tau": cmd_tau}[args.cmd](args, engine)


if __name__ == "__main__":
    main()
