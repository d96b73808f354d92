"""`blockdraft generate` and `blockdraft demo`."""

from __future__ import annotations

import json
import sys

from .common import (
    add_dtype_arg,
    add_model_args,
    add_sampling_args,
    dtype_of,
    load_engine,
    sampling_kwargs,
    spec_from,
    tree_budget,
)


def grammar_from(args):
    """The `GrammarSpec` the structured-output flags ask for (at most one of them), or None."""
    from pathlib import Path

    from ..errors import BlockdraftError
    from ..grammar import GrammarSpec

    given = [
        (k, v)
        for k, v in (
            ("json_schema", args.json_schema),
            ("regex", args.regex),
            ("choice", args.choice),
            ("lark", args.grammar),
        )
        if v is not None
    ]
    if getattr(args, "json_object", False):
        given.append(("json_object", None))
    if len(given) > 1:
        raise BlockdraftError("give at most one of --json-schema, --json-object, --regex, --choice and --grammar")
    if not given:
        return None
    kind, value = given[0]
    if kind in ("json_schema", "lark"):
        path = Path(value)
        if not path.is_file():
            raise BlockdraftError(f"--{kind.replace('_', '-') if kind != 'lark' else 'grammar'}: no file {value}")
        value = path.read_text()
    if kind == "choice":
        value = [c for c in value.split(",")]
    return GrammarSpec(kind, value)


def add_grammar_args(p) -> None:
    g = p.add_argument_group("structured output (lossless with every method; see docs/structured.md)")
    g.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid under this JSON schema file")
    g.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    g.add_argument("--regex", metavar="R", help="the output matches this regular expression")
    g.add_argument("--choice", metavar="A,B,...", help="the output is one of these comma-separated strings")
    g.add_argument("--grammar", metavar="FILE", help="the output follows this Lark (EBNF-style) grammar file")


def cmd_generate(args) -> int:
    tree_budget(args)
    grammar = grammar_from(args)
    engine = load_engine(args, [args.method])
    kwargs = sampling_kwargs(args)
    if grammar is not None:
        kwargs["grammar"] = engine.grammar(grammar)
    spec = spec_from(args)
    if args.json:
        out = engine.generate(args.prompt, method=spec, **kwargs)
        print(json.dumps({**out.to_dict(), **engine.precision()}))
        return 0
    out = engine.generate(
        args.prompt, method=spec, on_text=lambda _i, piece: print(piece, end="", flush=True), **kwargs
    )
    print()
    print(
        f"[{out.method}, {engine.weights}] {out.num_output_tokens} tokens in {out.decode_seconds:.2f} s "
        f"({out.tokens_per_second:.1f} tok/s), tau {out.tau:.2f}, finish: {out.finish_reason}",
        file=sys.stderr,
    )
    return 0


def cmd_demo(args) -> int:
    from ..draft import DFlashDrafter, DraftConfig
    from ..engine import Engine
    from ..models.default import DEFAULT_MASK_TOKEN_ID

    engine = Engine.load(args.target, args.draft, dtype=dtype_of(args.dtype))
    if engine.drafter is None:
        import torch

        print(
            f"note: {engine.draft_note}.\n      The demo uses an UNTRAINED (random) drafter: the output is "
            "still exactly the target's, but tau is ~1 and there is no speedup.\n",
            file=sys.stderr,
        )
        torch.manual_seed(0)
        cfg = DraftConfig.for_target(engine.target.config, mask_token_id=DEFAULT_MASK_TOKEN_ID)
        engine.drafter = DFlashDrafter(cfg).to(engine.target.device, engine.target.dtype).eval()
    kwargs = dict(chat=True, max_new_tokens=args.max_new_tokens)
    for method in ("ar", "dflash", "dflash-cut"):  # warm-up: the verify step's weights are packed, and
        engine.generate(args.prompt, method=method, max_new_tokens=32)  # each width's kernel timed, on first use
    ar = engine.generate(args.prompt, method="ar", **kwargs)
    runs = [engine.generate(args.prompt, method=m, **kwargs) for m in ("dflash", "dflash-cut")]
    for out in (ar, *runs):
        print(
            f"=== {out.method}: {out.num_output_tokens} tokens, {out.tokens_per_second:.1f} tok/s, "
            f"tau {out.tau:.2f} ==="
        )
        print(out.text.strip() + "\n")
    same = all(out.token_ids == ar.token_ids for out in runs)
    print(
        "outputs: "
        + ("identical" if same else "DIFFERENT (a bug: please report it)")
        + "; speedup over ar: "
        + ", ".join(f"{out.method} {out.tokens_per_second / ar.tokens_per_second:.2f}x" for out in runs)
    )
    p = engine.precision()
    print(f"target: {p['dtype']} ({p['dtype_reason']}), exact: {p['exact']}, step: {p['step']}, draft: {p['draft']}")
    return 0


def register(sub, methods) -> None:
    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("--prompt", required=True)
    g.add_argument("--method", choices=methods.names(), default="dflash", help=methods.help_text())
    g.add_argument("--json", action="store_true", help="print one JSON object (the stable contract)")
    add_grammar_args(g)
    add_model_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="generate with and without the drafter, compare text and speed")
    d.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.")
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--target")
    d.add_argument("--draft")
    add_dtype_arg(d)
    d.set_defaults(func=cmd_demo)
