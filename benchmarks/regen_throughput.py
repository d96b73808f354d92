"""Sustained regeneration speed: answer tokens per second at several batch sizes.

Each batch size runs the real continuously batched loop (greedy unless --temperature, the default
prompt mix, answers up to --max-new-tokens). The rate is measured over --window seconds that start once the batch has
turned over (as many samples finished as there are rows), so rows are at mixed stages and the first
fill does not distort it. Answer tokens are what regeneration produces; the prompt tokens
prefilled alongside are reported too (they cost about as much per token).

With --out DIR the answers are real training data, written (resumably) into DIR like
`blockdraft data regenerate --out DIR`; without it nothing is written.

    .venv/bin/python benchmarks/regen_throughput.py --batches 16 64 128 256 --window 90 \\
        --out data/regen/smollm2-135m-instruct --json bench-results/regen/throughput.json

`--server-compare N` answers the same N prompts in-process (one loop of --concurrency rows) and
through `blockdraft serve --method ar --max-batch C` on loopback (`data regenerate --server`,
C requests in flight), one after the other for --rounds rounds in alternating order, and prints
the rates, their ratio per round, and whether the answers agree.

`--dtype bfloat16` runs the target in bf16. `--compare-dtype N` answers the same N prompts with an fp32 and a bf16
target, twice each, interleaved, and prints the rates and how far the greedy answers agree:

    .venv/bin/python benchmarks/regen_throughput.py --compare-dtype 128 --batches 128 --mix sharegpt

`--compare-features N` answers the same N prompts with and without `--feature-cache` (the target's
features of every answer kept for training, each run into a fresh cache), twice each, interleaved:

    .venv/bin/python benchmarks/regen_throughput.py --compare-features 160 --batches 128 --dtype bfloat16
"""

import argparse
import json
import platform
import time

import torch

from blockdraft import Engine
from blockdraft.models.transformer import KVCache
from blockdraft.machine import cpu_name
from blockdraft.train.answers import AnswerSampling
from blockdraft.train.data import parse_mix, training_prompts
from blockdraft.train.regen import answer_prompts, regenerate


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64, 128, 256])
    ap.add_argument("--window", type=float, default=90, help="seconds measured after the first turnover")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--mix", help="prompt sources (default: the regenerate default)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampled answers (default: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--out", help="write the answers into this data folder (resumable, as `data regenerate`)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--profile",
        type=int,
        metavar="ROWS",
        help="instead: profile --window seconds of the loop at ROWS rows (after its first turnover) and "
        "print where the time goes, by operator",
    )
    ap.add_argument("--offset", type=int, default=0, help="--compare-sorting: skip this many prompts of the mix first")
    ap.add_argument(
        "--server-compare",
        type=int,
        metavar="PROMPTS",
        help="instead: in-process vs through a loopback `blockdraft serve` on the same PROMPTS prompts",
    )
    ap.add_argument("--rounds", type=int, default=2, help="--server-compare: rounds, in alternating order")
    ap.add_argument("--concurrency", type=int, default=64, help="--server-compare: rows / requests in flight")
    ap.add_argument(
        "--copying-permute",
        action="store_true",
        help="--compare-sorting: sorted rows with the cache reordered by a full copy vs in place",
    )
    ap.add_argument(
        "--compare-sorting",
        type=int,
        metavar="PROMPTS",
        help="instead: answer the same PROMPTS prompts at the largest --batches size with rows sorted by "
        "length + grouped attention and without, twice each, interleaved, and print the wall times",
    )
    ap.add_argument(
        "--compare-features",
        type=int,
        metavar="PROMPTS",
        help="the same prompts answered with and without keeping their features for training",
    )
    ap.add_argument(
        "--compare-prefix",
        type=int,
        metavar="PROMPTS",
        help="instead: answer the same PROMPTS prompts with the chat template's shared start prefilled "
        "once and without, twice each, interleaved, and print the wall times",
    )
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the target's precision")
    ap.add_argument(
        "--compare-dtype",
        type=int,
        metavar="PROMPTS",
        help="answer this many prompts with an fp32 and a bf16 target, twice each, interleaved; "
        "print the rates and how far the answers agree",
    )
    ap.add_argument(
        "--no-share-prefix",
        action="store_true",
        help="prefill every prompt whole (default: the chat template's shared start once)",
    )
    args = ap.parse_args()
    if args.profile:
        return profile(args)
    if args.compare_sorting or args.compare_prefix or args.compare_features:
        return compare_runs(args)
    if args.server_compare:
        return server_compare(args)
    if args.compare_dtype:
        return compare_dtypes(args)
    engine = Engine.load(use_draft=False, dtype=getattr(torch, args.dtype))
    rows = []
    for batch in args.batches:
        turned = []

        def until(stats, batch=batch, turned=turned):
            if not turned and stats.written >= batch:
                turned.append(stats.seconds)
            return bool(turned) and stats.seconds - turned[0] >= args.window

        common = dict(
            max_new_tokens=args.max_new_tokens,
            batch_size=batch,
            max_prompt_tokens=args.max_prompt_tokens,
            until=until,
            share_prefix=not args.no_share_prefix,
            sampling=AnswerSampling(args.temperature, args.top_p),
        )
        if args.out:
            stats = regenerate(engine, args.out, mix=args.mix, progress=False, **common)
        else:
            prompts = training_prompts(engine.tokenizer, args.mix, args.max_prompt_tokens)
            stats = answer_prompts(engine, prompts, **common)
        answer, prompt, span = stats.steady_rates(batch)
        row = {
            "batch": batch,
            "answer_tok_s": round(answer, 1),
            "prompt_tok_s": round(prompt, 1),
            "measured_seconds": round(span, 1),
            "warmup_seconds": round(turned[0], 1) if turned else None,
            "samples_finished": stats.written,
            "whole_run_answer_tok_s": round(stats.tokens_per_second, 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {
        "machine": {
            "cpu": cpu_name(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "date": time.strftime("%Y-%m-%d"),
        "mix": parse_mix(args.mix),
        "max_new_tokens": args.max_new_tokens,
        "max_prompt_tokens": args.max_prompt_tokens,
        "window_seconds": args.window,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "dtype": args.dtype,
        "shared_prefix": not args.no_share_prefix,
        "results": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print("| rows | answer tok/s (sustained) | prompt tok/s prefilled alongside | warm-up until first turnover (s) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['answer_tok_s']} | {r['prompt_tok_s']} | {r['warmup_seconds']} |")


def compare_runs(args):
    """--compare-sorting / --compare-prefix / --compare-features: the same prompts answered each way,
    twice, interleaved."""
    import itertools
    import shutil
    import tempfile

    engine = Engine.load(use_draft=False, dtype=getattr(torch, args.dtype))
    count = args.compare_sorting or args.compare_prefix or args.compare_features
    prompts = list(
        itertools.islice(
            training_prompts(engine.tokenizer, args.mix, args.max_prompt_tokens), args.offset, args.offset + count
        )
    )
    batch = max(args.batches)
    in_place = KVCache.permute

    def copying(cache, order):  # the reorder as it was: a fresh copy of the whole cache
        cache.k, cache.v = cache.k[:, order], cache.v[:, order]

    if args.compare_features:
        from blockdraft.cli.data import feature_layers
        from blockdraft.train.features import FeatureCache

        layers = feature_layers(argparse.Namespace(feature_layers=None, feature_cache="", draft=None), engine)
        runs = [(f"features of layers {layers} kept", "features", in_place), ("answers only", {}, in_place)]
    elif args.compare_prefix:
        runs = [
            ("chat template's shared start prefilled once", dict(share_prefix=True), in_place),
            ("every prompt prefilled whole", dict(share_prefix=False), in_place),
        ]
    elif args.copying_permute:
        runs = [
            ("rows sorted every 32 steps (cache copied)", dict(sort_every=32), copying),
            ("rows sorted every 32 steps (in place)", dict(sort_every=32), in_place),
        ]
    else:
        runs = [
            ("rows sorted every - steps", dict(sort_every=0), in_place),
            ("rows sorted every 32 steps", dict(sort_every=32), in_place),
        ]
    for label, options, permute in runs * 2:
        KVCache.permute = permute
        if options == "features":  # a fresh cache each time: every answer's features written
            options = dict(
                features=FeatureCache(
                    tempfile.mkdtemp(prefix="features-", dir="runs"), engine.target, layers, writer="regen"
                )
            )
        t0 = time.perf_counter()
        stats = answer_prompts(
            engine,
            iter(prompts),
            max_new_tokens=args.max_new_tokens,
            batch_size=batch,
            max_prompt_tokens=args.max_prompt_tokens,
            **options,
        )
        seconds = time.perf_counter() - t0
        if "features" in options:
            options["features"].close()
            shutil.rmtree(options["features"].folder)
        print(
            f"{label}: {stats.tokens} answer + {stats.prompt_tokens} prompt tokens in {seconds:.0f} s "
            f"({stats.tokens / seconds:.0f} answer tok/s)",
            flush=True,
        )
    KVCache.permute = in_place


def compare_dtypes(args):
    """--compare-dtype: the same prompts answered by an fp32 and a bf16 target, twice each, interleaved."""
    import itertools

    engines = {name: Engine.load(use_draft=False, dtype=getattr(torch, name)) for name in ("float32", "bfloat16")}
    prompts = list(
        itertools.islice(
            training_prompts(engines["float32"].tokenizer, args.mix, args.max_prompt_tokens),
            args.offset,
            args.offset + args.compare_dtype,
        )
    )
    answers, rates, batch = {}, {name: [] for name in engines}, max(args.batches)
    for name in list(engines) * 2:
        out = answers.setdefault(name, {})
        t0 = time.perf_counter()
        stats = answer_prompts(
            engines[name],
            iter(prompts),
            max_new_tokens=args.max_new_tokens,
            batch_size=batch,
            max_prompt_tokens=args.max_prompt_tokens,
            on_sample=lambda s, out=out: out.setdefault(s["id"], s["answer_ids"]),
        )
        rates[name].append(stats.tokens / (time.perf_counter() - t0))
        print(
            f"{name}, {batch} rows: {stats.tokens} answer + {stats.prompt_tokens} prompt tokens, "
            f"{rates[name][-1]:.0f} answer tok/s",
            flush=True,
        )
    a, b = answers["float32"], answers["bfloat16"]
    same = sum(a[k] == b[k] for k in a)
    agreed = total = 0
    for k in a:  # answer tokens before the first difference, over fp32's answer lengths
        n = next((i for i, (x, y) in enumerate(zip(a[k], b[k], strict=False)) if x != y), min(len(a[k]), len(b[k])))
        agreed, total = agreed + n, total + len(a[k])
    print(
        f"bf16 / fp32 rate: "
        f"{', '.join(f'{y / x:.2f}' for x, y in zip(rates['float32'], rates['bfloat16'], strict=False))}; "
        f"identical answers: {same} of {len(a)}; fp32 answer tokens before the first difference: "
        f"{agreed} of {total} ({agreed / max(total, 1):.1%}) ({torch.get_num_threads()} threads, {cpu_name()})"
    )


def server_compare(args):
    import itertools

    from blockdraft.serve.client import ServerProcess
    from blockdraft.train.regen import RegenStats
    from blockdraft.train.remote import RemoteTarget, answer_prompts_remote

    engine = Engine.load(use_draft=False)
    prompts = list(
        itertools.islice(
            training_prompts(engine.tokenizer, args.mix, args.max_prompt_tokens),
            args.offset,
            args.offset + args.server_compare,
        )
    )
    c, answers, rates = args.concurrency, {}, {"in-process": [], "server": []}
    common = dict(
        max_new_tokens=args.max_new_tokens, on_sample=lambda s: answers.setdefault(s["id"], []).append(s["answer_ids"])
    )

    def in_process():
        t0 = time.perf_counter()
        stats = answer_prompts(engine, iter(prompts), batch_size=c, max_prompt_tokens=args.max_prompt_tokens, **common)
        rates["in-process"].append(stats.tokens / (time.perf_counter() - t0))
        print(f"in-process, {c} rows: {stats.tokens} answer tokens, {rates['in-process'][-1]:.0f} tok/s", flush=True)

    def server():
        with ServerProcess(
            "--method",
            "ar",
            "--max-batch",
            str(c),
            "--max-queue",
            str(2 * c),
            "--max-tokens",
            str(args.max_new_tokens),
            "--max-model-len",
            str(args.max_prompt_tokens + args.max_new_tokens),
            "--log-level",
            "error",
        ) as proc:
            remote = RemoteTarget(proc.url, engine.tokenizer, engine.stop_token_ids, concurrency=c)
            t0 = time.perf_counter()
            stats = answer_prompts_remote(
                remote, iter(prompts), concurrency=c, sampling=AnswerSampling(), stats=RegenStats(), **common
            )
            rates["server"].append(stats.tokens / (time.perf_counter() - t0))
        print(
            f"blockdraft serve, {c} requests in flight: {stats.tokens} answer tokens, {rates['server'][-1]:.0f} tok/s",
            flush=True,
        )

    for r in range(args.rounds):  # the order alternates between rounds
        for fn in (server, in_process) if r % 2 else (in_process, server):
            fn()
    ratios = [s / i for s, i in zip(rates["server"], rates["in-process"], strict=False)]
    same = sum(len(a) == 2 * args.rounds and all(x == a[0] for x in a) for a in answers.values())
    print(
        f"server / in-process by round: {', '.join(f'{x:.2f}' for x in ratios)}; totals: "
        f"{sum(rates['server']) / sum(rates['in-process']):.2f}; identical answers: {same} of "
        f"{len(prompts)} ({torch.get_num_threads()} threads, {cpu_name()})"
    )


def profile(args):
    from torch.profiler import profile as torch_profile

    engine = Engine.load(use_draft=False)
    prof = torch_profile()
    state = {"on": False}

    def until(stats):
        if not state["on"] and stats.written >= args.profile:
            prof.__enter__()
            state["on"], state["t0"], state["wall0"] = True, stats.seconds, time.perf_counter()
        return state["on"] and stats.seconds - state["t0"] >= args.window

    prompts = training_prompts(engine.tokenizer, args.mix, args.max_prompt_tokens)
    answer_prompts(
        engine,
        prompts,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.profile,
        max_prompt_tokens=args.max_prompt_tokens,
        until=until,
    )
    wall = time.perf_counter()
    prof.__exit__(None, None, None)
    wall -= state["wall0"]
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    print(f"{args.profile} rows, {args.window:.0f} s after the first turnover: share of CPU time by operator")
    print(f"  (operators ran {total / 1e6:.1f} s of the {wall:.1f} s wall time: the rest is Python between them)")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]:
        print(f"  {e.key:55s} {100 * e.self_cpu_time_total / total:5.1f} %")


if __name__ == "__main__":
    main()
