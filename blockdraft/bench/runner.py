"""`blockdraft bench`: methods interleaved prompt by prompt, same process, same prompts.

Methods come from the registry (`blockdraft.methods`), peers included:
  ar            our plain autoregressive decoding (the reference for speedup_vs_ar)
  hf, hf-lookup[@B], llamacpp, llamacpp-q4_1, llamacpp-lookup[@B]
                the peers (`bench/peers.py`): HF transformers and llama.cpp on the same weights
  lookup[@B]    our prompt-lookup (n-gram) drafter, verified by our loop (default B = 4)
  eagle3[@B]    the EAGLE-3-style baseline drafter (shipped, or --eagle DIR), a chain of B-1 drafts
  dflash[@B]    the DFlash drafter at its trained block size, or at block size B

Each prompt's turns run as a conversation: a later turn follows the method's own
earlier answer. With --repeats R every prompt runs R times per method, still
interleaved; a warm-up generation per method runs first and is not counted.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .. import methods as registry
from ..costs import PositionAcceptance
from ..datasets import gsm8k, humaneval, is_validation, iter_sharegpt, load_prompt_file, mtbench
from ..engine import Generation
from ..errors import BlockdraftError
from ..machine import cpu_name
from ..spec import SpecConfig
from .peers import SERVER_PEERS, Peers
from .repetition import repetition_stats
from .stats import chi2_homogeneity

DATASETS = {
    "humaneval": humaneval,
    "mtbench": mtbench,
    "gsm8k": gsm8k,  # math word problems (GSM8K test items)
    "sharegpt-valid": lambda: [r for r in iter_sharegpt() if is_validation(r["id"])],
}


def load_prompts(
    dataset: str | None, prompts_file: str | None, max_samples: int | None, first_turn_only: bool = False
) -> list[dict]:
    if prompts_file:
        records = load_prompt_file(prompts_file)
    elif dataset in DATASETS:
        records = DATASETS[dataset]()
    else:
        raise BlockdraftError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)} or --prompts FILE")
    records = [{"id": r["id"], "turns": r["turns"][:1] if first_turn_only else r["turns"]} for r in records]
    return records[:max_samples] if max_samples else records


@dataclass
class Method:
    name: str
    kind: str  # a registered method's name: ar | lookup | eagle3 | dflash | hf | hf-lookup ...
    block: int | None
    speculative: bool = False
    peer: bool = False
    spec: SpecConfig | None = None  # ours: how it speculates (None for peers)


def parse_method(name: str, engine, window: int | str | None = "auto") -> Method:
    """'ar' | 'hf' | 'hf-lookup[@B]' | 'lookup[@B]' | 'eagle3[@B]' | 'dflash[@B]' | ... -> Method;
    `window`: the DFlash methods' draft window (`SpecConfig.window`)."""
    spec, block = registry.parse(name, include_peers=True)
    config = None
    if spec.peer:  # (a peer's drafter, if it has one, is ours: its trained block is the default)
        trained = engine.drafter_for(spec.drafter).config.block_size if spec.drafter is not None else 1
        size = block or spec.default_block or trained
    else:
        size = SpecConfig(spec.name, block, window=window).build(engine).block
        config = SpecConfig(spec.name, size if spec.speculative else None, window=window)
    return Method(name, spec.name, size, speculative=spec.speculative and not spec.peer, peer=spec.peer, spec=config)


def _generate(engine, peers: Peers, m: Method, ids, max_new_tokens, temperature, seed, grammar=None) -> Generation:
    if m.peer:
        return peers.generate(m.kind, m.block, ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    return engine.generate(
        ids, method=m.spec, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, grammar=grammar
    )


def acceptance_stats(lengths: list[int], block: int) -> tuple[list[float], list[float]]:
    """Histogram of committed tokens per step (index = length, 1..block) as fractions, and
    the per-position acceptance rate: P(draft k accepted | drafts 1..k-1 accepted). Both are
    empty when the method reports no acceptance lengths (HF's generate)."""
    if not lengths:
        return [], []
    hist = [0] * (block + 1)
    positions = PositionAcceptance(block - 1)
    for a in lengths:
        hist[min(a, block)] += 1
        positions.record(a - 1, block - 1)
    total = max(1, len(lengths))
    return [h / total for h in hist], positions.rates()


def run_bench(
    engine,
    records: list[dict],
    methods: list[str],
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    seed: int = 0,
    warmup: bool = True,
    repeats: int = 1,
    gguf: str | None = None,
    llamacpp_draft: tuple[str, bool] = ("F16", False),
    window: int | str | None = "auto",
    grammar=None,
) -> dict:
    """`grammar`: a `GrammarSpec` every answer follows (structured output; our methods only)."""
    parsed = [parse_method(m, engine, window) for m in methods]
    if grammar is not None and any(m.peer for m in parsed):
        raise BlockdraftError("the bench runs a grammar with blockdraft's methods only, not with peers")
    grammar = engine.grammar(grammar)
    peers = Peers(engine, gguf, llamacpp_draft)
    peers.check([m.kind for m in parsed])
    try:
        if warmup:
            ids = engine.encode("Hello", chat=True)
            for m in parsed:
                _generate(engine, peers, m, ids, 4, temperature, seed, grammar)
        keys = ("tokens", "seconds", "prefill_seconds", "draft_seconds", "verify_seconds", "grammar_seconds", "steps")
        per = {
            m.name: {"prompts": {}, "acceptance_lengths": [], "repeat_tps": [], **{k: 0 for k in keys}} for m in parsed
        }
        bar = tqdm(total=len(records) * repeats, desc="bench", unit="prompt", dynamic_ncols=True)
        for rep in range(repeats):
            rep_tokens = {m.name: [0, 0.0] for m in parsed}
            for rec in records:
                for m in parsed:  # interleaved: drift hits every method alike
                    messages, outs = [], []
                    for turn in rec["turns"]:
                        messages.append({"role": "user", "content": turn})
                        out = _generate(
                            engine, peers, m, engine.encode_chat(messages), max_new_tokens, temperature, seed, grammar
                        )
                        messages.append({"role": "assistant", "content": out.text})
                        outs.append(out)
                        p = per[m.name]
                        if rep == 0:
                            p["acceptance_lengths"] += out.acceptance_lengths
                        p["tokens"] += out.num_output_tokens
                        p["seconds"] += out.decode_seconds
                        p["prefill_seconds"] += out.prefill_seconds
                        p["draft_seconds"] += out.draft_seconds
                        p["grammar_seconds"] += out.grammar_seconds
                        p["verify_seconds"] += out.verify_seconds
                        p["steps"] += out.steps
                        rep_tokens[m.name][0] += out.num_output_tokens
                        rep_tokens[m.name][1] += out.decode_seconds
                    entry = per[m.name]["prompts"].setdefault(
                        rec["id"],
                        {
                            "id": rec["id"],
                            "token_ids": [o.token_ids for o in outs],
                            "tokens_per_second": [],
                            "tau": [o.tau for o in outs],
                            "acceptance_lengths": [o.acceptance_lengths for o in outs],
                        },
                    )
                    entry["tokens_per_second"].append([o.tokens_per_second for o in outs])
                bar.update(1)
            for name, (tokens, seconds) in rep_tokens.items():
                per[name]["repeat_tps"].append(tokens / seconds if seconds else 0.0)
        bar.close()
    finally:
        peers.close()

    results = {}
    for m in parsed:
        p = per[m.name]
        lengths = p["acceptance_lengths"]
        hist, rates = acceptance_stats(lengths, m.block)
        tps = [statistics.median(x) for q in p["prompts"].values() for x in zip(*q["tokens_per_second"], strict=False)]
        steps = max(1, p["steps"])
        results[m.name] = {
            "tau": (
                sum(lengths) / len(lengths) if lengths else (1.0 if not registry.METHODS[m.kind].speculative else None)
            ),
            "acceptance_histogram": hist,
            "per_position_acceptance": rates,
            "tokens_per_second": p["tokens"] / p["seconds"] if p["seconds"] else 0.0,
            "tokens_per_second_median": statistics.median(tps) if tps else 0.0,
            "tokens_per_second_repeats": p["repeat_tps"],
            "block_size": m.block,
            "num_output_tokens": p["tokens"],
            "decode_seconds": p["seconds"],
            "prefill_seconds": p["prefill_seconds"],
            "draft_seconds": p["draft_seconds"],
            "verify_seconds": p["verify_seconds"],
            "grammar_seconds": p["grammar_seconds"],  # within draft + verify: structured output's share
            "other_seconds": max(0.0, p["seconds"] - p["prefill_seconds"] - p["draft_seconds"] - p["verify_seconds"])
            if p["steps"]
            else None,
            "seconds_per_step": {"draft": p["draft_seconds"] / steps, "verify": p["verify_seconds"] / steps}
            if p["steps"] and not m.peer
            else None,
            # peers: decode time after the prefill, per verify step (speculative) or per token (plain)
            "decode_seconds_per_step": (p["seconds"] - p["prefill_seconds"]) / (p["steps"] or max(1, p["tokens"]))
            if m.peer
            else None,
            "repetition": repetition_stats(
                [
                    pair
                    for q in p["prompts"].values()
                    for pair in zip(q["token_ids"], q["acceptance_lengths"], strict=False)
                ]
            ),
            "prompts": list(p["prompts"].values()),
        }
    if "ar" in results:
        ar = results["ar"]
        base = ar["tokens_per_second"]
        t_step = ar["seconds_per_step"]["verify"] + ar["seconds_per_step"]["draft"]
        ar_runs = ar["tokens_per_second_repeats"]
        for r in results.values():
            r["speedup_vs_ar"] = r["tokens_per_second"] / base if base else None
            r["speedup_vs_ar_repeats"] = [
                a / b for a, b in zip(r["tokens_per_second_repeats"], ar_runs, strict=False) if b
            ]
            sps = r["seconds_per_step"]
            if sps and r["tau"]:  # the loop's own limit: tau * t_step / (t_draft + t_verify)
                r["speedup_bound"] = r["tau"] * t_step / (sps["draft"] + sps["verify"])
    plain = results.get("llamacpp-server")
    if plain and plain["tokens_per_second"]:  # llama-server's DFlash against its own plain decoding
        for name, r in results.items():
            if registry.parse(name, include_peers=True)[0].name in SERVER_PEERS:
                r["speedup_vs_llamacpp_server"] = r["tokens_per_second"] / plain["tokens_per_second"]
                if r is not plain and r["tau"]:  # tau at which a step pays for itself
                    r["break_even_tau"] = r["decode_seconds_per_step"] / plain["decode_seconds_per_step"]
    return results


def distribution_check(
    engine,
    methods: list[str],
    records: list[dict],
    *,
    samples: int = 400,
    positions: int = 3,
    temperature: float = 1.0,
    window: int | str | None = "auto",
) -> dict:
    """At temperature > 0 the output distribution must stay the target's: the tokens at the
    first `positions` positions of `samples` seeded runs of each method are compared with
    `ar` run on other seeds (two-sample chi-square, 0.1% level). The prompt is the shortest
    first turn of `records` (prefilled once, its keys and values copied into every sample's row)."""
    shortest = min((r["turns"][0] for r in records), key=len)
    ids = engine.encode_chat([{"role": "user", "content": shortest}])

    def counts(method: Method, seed0: int):
        outs = _generate_many(engine, method, ids, samples, positions, temperature, seed0)
        return [
            {t: sum(1 for o in outs if len(o) > k and o[k] == t) for t in {o[k] for o in outs if len(o) > k}}
            for k in range(positions)
        ]

    base = counts(parse_method("ar", engine, window), 0)
    report = {}
    for name in methods:
        m = parse_method(name, engine, window)
        if not m.speculative:
            continue
        other = counts(m, 10**6)
        checks = []
        for k in range(positions):
            stat, critical, df = chi2_homogeneity(base[k], other[k])
            checks.append(
                {
                    "position": k + 1,
                    "chi2": stat,
                    "critical_0.001": critical,
                    "df": df,
                    "same_distribution": stat < critical,
                }
            )
        report[name] = checks
    return report


def _generate_many(engine, m: Method, ids, n, max_new_tokens, temperature, seed0):
    outs = []
    for start in range(0, n, 100):
        rows = min(100, n - start)
        gens = engine.generate(
            [list(ids)] * rows,
            method=m.spec,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed0 + start,
            shared_prefix=list(ids[:-1]),
        )
        outs += [g.token_ids for g in gens]
    return outs


def machine_info(engine) -> dict:
    return {
        "platform": platform.platform(),
        "processor": cpu_name(),
        "threads": torch.get_num_threads(),
        "device": str(engine.target.device),
        "dtype": str(engine.target.dtype),
        "weights": engine.weights,
        **{k: v for k, v in engine.precision().items() if k != "dtype"},
        "draft_weights": engine.draft_weights,
        "torch": torch.__version__,
    }


def bench_command(
    engine,
    *,
    dataset,
    prompts_file,
    methods,
    max_samples,
    max_new_tokens,
    temperature,
    out,
    first_turn_only=False,
    repeats=1,
    check_distribution=0,
    gguf=None,
    llamacpp_draft: tuple[str, bool] = ("F16", False),
    window: int | str | None = "auto",
    grammar=None,
) -> dict:
    """Run every dataset (comma-separated names) and write results.json (one dataset) or
    DATASET/results.json (several), plus report.md and plots, into `out`. `window`: the DFlash
    methods' draft window (`SpecConfig.window`)."""
    names = [prompts_file] if prompts_file else [d for d in dataset.split(",") if d]
    reports = {}
    for name in names:
        records = load_prompts(None if prompts_file else name, prompts_file, max_samples, first_turn_only)
        t0 = time.time()
        results = run_bench(
            engine,
            records,
            methods,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            repeats=repeats,
            gguf=gguf,
            llamacpp_draft=llamacpp_draft,
            window=window,
            grammar=grammar,
        )
        report = {
            "dataset": name,
            "num_prompts": len(records),
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "first_turn_only": first_turn_only,
            "repeats": repeats,
            "draft_window": window,
            "methods": results,
            "machine": machine_info(engine),
        }
        if grammar is not None:
            report["grammar"] = {"kind": grammar.kind, "source": grammar.source}
        if any(registry.parse(m, include_peers=True)[0].name.startswith("llamacpp") for m in methods):
            from .peers import LlamaCppRunner, llamacpp_build, q4_1_gguf

            kinds = [registry.parse(m, include_peers=True)[0].name for m in methods]
            report["gguf"] = LlamaCppRunner.describe(engine, gguf)
            if {"llamacpp-q4_1", "llamacpp-server-q4_1"} & set(kinds):
                report["gguf_q4_1"] = LlamaCppRunner.describe(engine, q4_1_gguf(engine))
            if any(k.startswith("llamacpp") and k not in SERVER_PEERS for k in kinds):
                report["llamacpp_build"] = llamacpp_build()
        if any(registry.parse(m, include_peers=True)[0].name in SERVER_PEERS for m in methods):
            from .llama_server import describe, find_llama_server

            report["llama_server"] = {
                **describe(find_llama_server()),
                "draft_type": llamacpp_draft[0],
                "draft_vocab": "full" if llamacpp_draft[1] else "drafter's",
            }
        if check_distribution:
            report["distribution_check"] = distribution_check(
                engine, methods, records, samples=check_distribution, temperature=temperature or 1.0, window=window
            )
        report["wall_seconds"] = time.time() - t0
        reports[Path(name).stem if prompts_file else name] = report
        if out:
            folder = Path(out) if len(names) == 1 else Path(out) / (Path(name).stem if prompts_file else name)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "results.json").write_text(json.dumps(report, indent=1))
    if out:
        from .report import write_report

        write_report(reports, Path(out))
    return reports
