"""`blockdraft bench`: methods interleaved prompt by prompt, same process, same prompts.

Methods: `ar` (the reference for speedup_vs_ar), `dflash` (the drafter's trained
block size) and `dflash@B` (block size B). Each prompt's turns run as a
conversation: a later turn follows the method's own earlier answer.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..datasets import humaneval, is_validation, iter_sharegpt, load_prompt_file, mtbench
from ..errors import BlockdraftError

DATASETS = {
    "humaneval": humaneval,
    "mtbench": mtbench,
    "sharegpt-valid": lambda: [r for r in iter_sharegpt() if is_validation(r["id"])],
}


def load_prompts(dataset: str | None, prompts_file: str | None, max_samples: int | None,
                 first_turn_only: bool = False) -> list[dict]:
    if prompts_file:
        records = load_prompt_file(prompts_file)
    elif dataset in DATASETS:
        records = DATASETS[dataset]()
    else:
        raise BlockdraftError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)} or --prompts FILE")
    records = [{"id": r["id"], "turns": r["turns"][:1] if first_turn_only else r["turns"]} for r in records]
    return records[:max_samples] if max_samples else records


def parse_method(name: str, engine) -> tuple[str, int | None]:
    """'ar' | 'dflash' | 'dflash@B' -> (method, block size)."""
    base, _, block = name.partition("@")
    if base not in ("ar", "dflash"):
        raise BlockdraftError(f"unknown method {name!r}; use ar, dflash or dflash@B")
    if base == "dflash" and engine.drafter is None:
        raise BlockdraftError(engine.draft_note or "dflash needs a drafter (--draft DIR)")
    return base, int(block) if block else None


def run_bench(engine, records: list[dict], methods: list[str], *, max_new_tokens: int = 256,
              temperature: float = 0.0, seed: int = 0, warmup: bool = True) -> dict:
    parsed = {m: parse_method(m, engine) for m in methods}
    if warmup:
        for m, (method, block) in parsed.items():
            engine.generate("Hello", chat=True, method=method, block_size=block, max_new_tokens=4)
    per = {m: {"prompts": [], "acceptance_lengths": [], "tokens": 0, "seconds": 0.0, "draft_seconds": 0.0,
               "verify_seconds": 0.0} for m in methods}
    for rec in tqdm(records, desc="bench", unit="prompt", dynamic_ncols=True):
        for m, (method, block) in parsed.items():  # interleaved: drift hits every method alike
            messages, outs = [], []
            for turn in rec["turns"]:
                messages.append({"role": "user", "content": turn})
                text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                ids = engine.tokenizer(text, add_special_tokens=False).input_ids
                out = engine.generate(ids, method=method, block_size=block, max_new_tokens=max_new_tokens,
                                      temperature=temperature, seed=seed)
                messages.append({"role": "assistant", "content": out.text})
                outs.append(out)
                p = per[m]
                p["acceptance_lengths"] += out.acceptance_lengths
                p["tokens"] += out.num_output_tokens
                p["seconds"] += out.decode_seconds
                p["draft_seconds"] += out.draft_seconds
                p["verify_seconds"] += out.verify_seconds
            per[m]["prompts"].append({"id": rec["id"], "token_ids": [o.token_ids for o in outs],
                                      "tokens_per_second": [o.tokens_per_second for o in outs],
                                      "tau": [o.tau for o in outs]})
    results = {}
    for m, p in per.items():
        lengths = p["acceptance_lengths"]
        block = parsed[m][1] or (engine.drafter.config.block_size if parsed[m][0] == "dflash" else 1)
        hist = [0] * (block + 1)
        for a in lengths:
            hist[min(a, block)] += 1
        tps = [x for q in p["prompts"] for x in q["tokens_per_second"]]
        results[m] = {
            "tau": sum(lengths) / len(lengths) if lengths else 0.0,
            "acceptance_histogram": [h / max(1, len(lengths)) for h in hist],
            "tokens_per_second": p["tokens"] / p["seconds"] if p["seconds"] else 0.0,
            "tokens_per_second_median": statistics.median(tps) if tps else 0.0,
            "block_size": block,
            "num_output_tokens": p["tokens"],
            "draft_seconds": p["draft_seconds"],
            "verify_seconds": p["verify_seconds"],
            "decode_seconds": p["seconds"],
            "prompts": p["prompts"],
        }
    if "ar" in results:
        base = results["ar"]["tokens_per_second"]
        for r in results.values():
            r["speedup_vs_ar"] = r["tokens_per_second"] / base if base else None
    return results


def bench_command(engine, *, dataset, prompts_file, methods, max_samples, max_new_tokens, temperature, out,
                  first_turn_only=False) -> dict:
    records = load_prompts(dataset, prompts_file, max_samples, first_turn_only)
    t0 = time.time()
    results = run_bench(engine, records, methods, max_new_tokens=max_new_tokens, temperature=temperature)
    report = {
        "dataset": prompts_file or dataset, "num_prompts": len(records), "max_new_tokens": max_new_tokens,
        "temperature": temperature, "first_turn_only": first_turn_only, "methods": results,
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "threads": torch.get_num_threads(), "device": str(engine.target.device),
                    "dtype": str(engine.target.dtype), "torch": torch.__version__},
        "wall_seconds": time.time() - t0,
    }
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "results.json").write_text(json.dumps(report, indent=1))
    return report
