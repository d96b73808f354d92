"""`blockdraft data regenerate` and `blockdraft data prompts`: training data."""

from __future__ import annotations

import os
import sys

from ..errors import BlockdraftError
from .common import interrupt_on_sigterm


def cmd_data_regenerate(args) -> int:
    from ..train.answers import AnswerSampling
    from ..train.regen import regenerate

    interrupt_on_sigterm()
    if args.server:
        from ..models import load_tokenizer, stop_token_ids
        from ..models.default import default_target_dir
        from ..train.remote import RemoteTarget

        if args.method != "ar" or args.draft or args.dtype or args.feature_cache:
            raise BlockdraftError(
                "--server: the server decodes; --method, --draft, --dtype and --feature-cache apply "
                "to in-process regeneration"
            )
        folder = args.target or default_target_dir()
        tokenizer = load_tokenizer(folder)
        source = RemoteTarget(
            args.server,
            tokenizer,
            stop_token_ids(folder, tokenizer),
            api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
            model=args.model,
            concurrency=args.concurrency,
            ask_token_ids=not args.text_only,
        )
    else:
        from ..engine import Engine

        import torch

        from .. import drafters, methods

        source = Engine.load(
            args.target,
            args.draft,
            use_draft=methods.parse(args.method)[0].drafter == drafters.PRIMARY,
            dtype=getattr(torch, args.dtype) if args.dtype else None,
        )
    cache = None
    if args.feature_cache:
        from ..train.features import FeatureCache

        cache = FeatureCache(
            args.feature_cache, source.target, feature_layers(args, source), writer="regen", dtype=args.feature_dtype
        )
    sampling = AnswerSampling(args.temperature, args.top_p, args.top_k)
    sources = None
    if args.prompts:
        from ..train.prompts import prompt_sources

        sources = prompt_sources(args.prompts)
    stats = regenerate(
        source,
        args.out,
        mix=args.mix,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        batch_size=args.batch_size,
        sampling=sampling,
        answers_per_prompt=args.answers_per_prompt,
        method=args.method,
        seconds=args.seconds,
        concurrency=args.concurrency,
        sources=sources,
        first_answer=args.first_answer,
        dedup_against=args.dedup_against.split(",") if args.dedup_against else (),
        feature_cache=cache,
    )
    print(
        f"regenerate: wrote {stats.written} samples to {args.out} ({stats.tokens} answer tokens in "
        f"{stats.seconds:.0f} s, {stats.tokens_per_second:.0f} tok/s)",
        file=sys.stderr,
    )
    if cache is not None:
        cache.close()
        print(
            f"regenerate: the target's features of {stats.features} of them went to {args.feature_cache} (layers "
            f"{', '.join(map(str, cache.layers))}; it holds {len(cache)} samples' features)",
            file=sys.stderr,
        )
    if stats.duplicates:
        print(
            f"regenerate: {stats.duplicates} sampled answers repeated one already kept for their prompt and were "
            "dropped (listed in dropped.txt)",
            file=sys.stderr,
        )
    if args.server:
        if stats.from_text:
            print(
                f"regenerate: {stats.from_text} answers came as text only and were tokenized here; "
                f"{stats.round_trip_mismatches} of them ({stats.round_trip_mismatches / stats.from_text:.1%}) do "
                "not decode back to the same text",
                file=sys.stderr,
            )
        if stats.prompt_mismatches:
            print(
                f"regenerate: for {stats.prompt_mismatches} samples the server's prompt tokens differed from "
                "ours (its chat template?); the server's were kept",
                file=sys.stderr,
            )
        if stats.rejected:
            print(
                f"regenerate: the server refused {stats.rejected} prompts (retried next run), e.g. "
                f"{stats.last_rejection}",
                file=sys.stderr,
            )
    return 0


def feature_layers(args, engine) -> list[int]:
    """The target layers `--feature-cache` records: `--feature-layers`, else the cache folder's
    own, else those of the drafter `--draft` names or the one shipped for the default target."""
    import json
    from pathlib import Path

    if args.feature_layers:
        try:
            return [int(i) for i in args.feature_layers.split(",")]
        except ValueError:
            raise BlockdraftError(f"--feature-layers: comma-separated layer ids, got {args.feature_layers!r}") from None
    meta = Path(args.feature_cache) / "meta.json"
    if meta.is_file():
        return json.loads(meta.read_text())["layers"]
    from ..draft_config import DraftConfig, read_draft_config
    from ..engine import shipped_drafter

    folder = args.draft or (shipped_drafter("dflash") if engine.default_target else None)
    if folder is None:
        raise BlockdraftError(
            "--feature-cache: say which target layers to record (--feature-layers 1,14,27) or "
            "name the drafter to be trained from (--draft DIR)"
        )
    return DraftConfig.from_dict(read_draft_config(folder)).target_layer_ids


def cmd_data_prompts(args) -> int:
    import torch

    from ..engine import Engine
    from ..train.answers import AnswerSampling
    from ..train.prompts import synthesize

    interrupt_on_sigterm()
    engine = Engine.load(args.target, use_draft=False, dtype=getattr(torch, args.dtype) if args.dtype else None)
    stats = synthesize(
        engine,
        args.out,
        args.synthesize,
        args.domain,
        max_prompt_tokens=args.max_prompt_tokens,
        batch_size=args.batch_size,
        sampling=AnswerSampling(args.temperature, args.top_p, args.top_k),
        seconds=args.seconds,
        similarity=args.similarity,
    )
    why = ", ".join(f"{n} {reason}" for reason, n in stats.rejected.most_common()) or "none"
    print(
        f"prompts: {args.out} holds {stats.kept} {args.domain} prompts (of {args.synthesize}); rejected so far: {why}",
        file=sys.stderr,
    )
    return 0


def register(sub, methods) -> None:
    data = sub.add_parser("data", help="training data").add_subparsers(dest="data_command", required=True)
    r = data.add_parser("regenerate", help="answer training prompts with the target (resumable)")
    r.add_argument("--out", required=True, help="folder of gzip JSON-lines shards (resumes what is there)")
    r.add_argument(
        "--mix",
        help="prompt sources and weights, e.g. sharegpt=3,sharegpt-code=2 "
        "(default: the built-in mix; see blockdraft.datasets.PROMPT_SOURCES)",
    )
    r.add_argument("--limit", type=int, help="use the first N usable prompts of the mix (default: all)")
    r.add_argument("--seconds", type=float, help="stop after this long (rows still running are redone next time)")
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--max-prompt-tokens", type=int, default=256, help="skip longer prompts")
    r.add_argument("--batch-size", type=int, default=128, help="rows decoded together (continuous batching)")
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy answers (default)")
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    r.add_argument(
        "--answers-per-prompt",
        type=int,
        default=1,
        help="sampled answers per prompt, each seeded by (prompt, answer index): a rerun resumes and "
        "never duplicates; an answer identical to one kept for its prompt is dropped",
    )
    r.add_argument(
        "--first-answer",
        type=int,
        default=0,
        metavar="K",
        help="answer indices K .. K + N - 1 (1: more sampled answers of prompts whose answer 0, e.g. "
        "the greedy one, is in another folder; default 0)",
    )
    r.add_argument(
        "--dedup-against",
        metavar="FOLDER[,FOLDER]",
        help="answer folders whose answers count as kept: an id answered there is skipped, a new answer "
        "identical to one there for its prompt is dropped (e.g. the greedy answers, "
        "with --first-answer 1)",
    )
    r.add_argument(
        "--feature-cache",
        metavar="DIR",
        help="also store the target's features of every answer, and its 32 likeliest next tokens at "
        "every answer position (soft labels, `train --distill`), in this training feature cache "
        "(`train --feature-cache DIR`), so that training skips the target for these samples; "
        "~1 MiB a sample in float16 (half in int8), until the disk would keep under 2 GiB free",
    )
    r.add_argument(
        "--feature-dtype",
        choices=["float16", "int8"],
        help="--feature-cache: how the features are stored (int8: half the disk, a scale per position "
        "and layer; default: the cache folder's own, float16 for a new one)",
    )
    r.add_argument(
        "--feature-layers",
        metavar="IDS",
        help="--feature-cache: the target layers to record, e.g. 1,14,27 (default: the cache's own, "
        "else those of --draft or of the drafter shipped for the default target)",
    )
    r.add_argument("--method", choices=["ar", "dflash"], default="ar", help="dflash: speculative, needs a drafter")
    r.add_argument(
        "--target", help="target model folder (with --server: only its tokenizer and chat template are used)"
    )
    r.add_argument("--draft")
    r.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="the target's precision (default: bf16 on CUDA, fp32 on CPU; greedy answers in bf16 can "
        "differ from fp32's where two tokens nearly tie; samples record a precision other than fp32)",
    )
    r.add_argument(
        "--server",
        metavar="URL",
        help="answer through this OpenAI-compatible server (vLLM, SGLang, blockdraft serve) instead of "
        "in-process, e.g. http://127.0.0.1:8000",
    )
    r.add_argument("--api-key", help="--server: bearer token (default: $OPENAI_API_KEY)")
    r.add_argument("--model", help="--server: the model name to ask for (default: the server's first)")
    r.add_argument("--concurrency", type=int, default=64, help="--server: requests in flight")
    r.add_argument(
        "--text-only",
        action="store_true",
        help="--server: do not ask for token ids (servers that reject `return_token_ids`); the answers "
        "are tokenized here",
    )
    r.add_argument(
        "--prompts",
        metavar="DIR",
        help="answer self-written prompts (`data prompts`): DIR, or each of its subfolders, is a source "
        "named by its folder (e.g. --mix synth-code=1,synth-math=1; default: all equally)",
    )
    r.set_defaults(func=cmd_data_regenerate)

    q = data.add_parser("prompts", help="training prompts written by the target itself (Magpie-style, resumable)")
    q.add_argument("--synthesize", type=int, required=True, metavar="N", help="kept prompts the folder should hold")
    q.add_argument(
        "--domain",
        choices=["code", "math", "chat"],
        required=True,
        help="the system prompt the user turns are written under (math prompts are asked in the "
        "benchmark's math template)",
    )
    q.add_argument(
        "--out",
        required=True,
        help="folder of gzip JSON-lines shards (resumes what is there), e.g. "
        "data/prompts/smollm2-135m-instruct/synth-code",
    )
    q.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=256,
        help="token cap of a written prompt; one that reaches it is rejected as cut",
    )
    q.add_argument("--batch-size", type=int, default=128, help="rows decoded together (continuous batching)")
    q.add_argument("--temperature", type=float, default=1.0)
    q.add_argument("--top-p", type=float, default=0.95)
    q.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    q.add_argument(
        "--similarity",
        type=float,
        default=0.5,
        help="a prompt whose word 4-gram Jaccard similarity with a kept one reaches this is a "
        "near-duplicate and rejected",
    )
    q.add_argument("--seconds", type=float, help="stop after this long (a later run continues)")
    q.add_argument("--target", help="target model folder (default: the bundled SmolLM2-135M-Instruct)")
    q.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="the target's precision")
    q.set_defaults(func=cmd_data_prompts)
