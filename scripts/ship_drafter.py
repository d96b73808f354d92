"""Ship a trained drafter for the default target: fp16 weights + a model card.

    python scripts/ship_drafter.py RUN_DIR [--samples 20] [--max-new-tokens 256] [--bench DIR]

Copies RUN_DIR/drafter into blockdraft/shipped/smollm2-135m-instruct-dflash/ (fp16), measures τ with
`blockdraft bench` on HumanEval and MT-Bench first turns (greedy, the drafter's block size),
and writes the model card README.md from the run's own records. With --bench DIR, τ is read
from an existing bench run (DIR/humaneval/results.json and DIR/mtbench/results.json, method
`dflash`) instead of being measured again.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from blockdraft.bench.runner import cpu_name
from blockdraft.draft import DFlashDrafter

DEST = Path(__file__).resolve().parent.parent / "blockdraft" / "shipped" / "smollm2-135m-instruct-dflash"
EAGLE_DEST = DEST.parent / "smollm2-135m-instruct-eagle3"


def ship_eagle(run: Path):
    """The EAGLE-3-style baseline (bench method eagle3), with a short card from its run."""
    from blockdraft.eagle import EagleDrafter

    state = json.loads((run / "checkpoint" / "state.json").read_text())
    cfg = state["config"]
    metrics = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l]
    drafter = EagleDrafter.load(run / "drafter")
    drafter.save(EAGLE_DEST, dtype=torch.float16)
    n_params = sum(p.numel() for p in drafter.parameters())
    curve = "".join(f"| {m['step']} | {m.get('tokens_seen', 0) / 1e3:.0f}K | {m['tau']:.3f} |\n"
                    for m in metrics if "tau" in m)
    (EAGLE_DEST / "README.md").write_text(f"""# EAGLE-3-style baseline drafter for SmolLM2-135M-Instruct

The baseline `blockdraft bench --methods eagle3` compares
DFlash with. One decoder layer, {n_params / 1e6:.1f}M parameters, fed the target's layers
{drafter.config.target_layer_ids} fused by `fc`; drafts chains of up to {cfg['block_size'] - 1} tokens.
Trained by `blockdraft train --arch eagle3` with the same data, steps ({state['step']} x
{cfg['batch_size']} sequences, {state.get('tokens_seen', 0) / 1e3:.0f}K tokens), anchors, schedule and draft
vocabulary as the shipped DFlash drafter (`scripts/train_shipped.sh`). Loaded when method eagle3 is asked for.

## τ on held-out ShareGPT prompts during training (real decode loop, 64 new tokens)

| step | tokens seen | τ |
|---|---|---|
""" + curve)


def block_of(method: str, cfg: dict) -> int:
    """The block size a bench method name ran at (`dflash@4` -> 4, `dflash` -> the trained one)."""
    return int(method.split("@")[1]) if "@" in method else cfg["block_size"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--bench", help="read tau from this bench output folder instead of measuring")
    ap.add_argument("--eagle", help="also ship the EAGLE-3-style baseline trained in this run folder")
    args = ap.parse_args()
    if args.eagle:
        ship_eagle(Path(args.eagle))
    run = Path(args.run)
    state = json.loads((run / "checkpoint" / "state.json").read_text())
    cfg = state["config"]
    metrics = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l]
    drafter = DFlashDrafter.load(run / "drafter")
    drafter.save(DEST, dtype=torch.float16)

    taus, samples = {}, {}
    for dataset in ("humaneval", "mtbench"):
        if args.bench:
            report = json.loads((Path(args.bench) / dataset / "results.json").read_text())
        else:
            out = run / f"bench-{dataset}"
            subprocess.run([sys.executable, "-m", "blockdraft", "bench", "--dataset", dataset, "--first-turn-only",
                            "--methods", "dflash", "--max-samples", str(args.samples), "--max-new-tokens",
                            str(args.max_new_tokens), "--draft", str(DEST), "--out", str(out)], check=True)
            report = json.loads((out / "results.json").read_text())
        taus[dataset] = {name: m["tau"] for name, m in report["methods"].items() if name.split("@")[0] == "dflash"}
        samples[dataset] = report["num_prompts"]
        args.max_new_tokens = report["max_new_tokens"]

    curve = [(m["step"], m.get("tokens_seen"), m["tau"]) for m in metrics if "tau" in m]
    wall = max(m["elapsed"] for m in metrics)
    n_params = sum(p.numel() for p in drafter.parameters())
    names = list(taus["humaneval"])
    tau_table = "\n".join([
        "| dataset | prompts | " + " | ".join(f"τ at block {block_of(n, cfg)}" for n in names) + " |",
        "|---|---|" + "---|" * len(names),
        f"| HumanEval | first {samples['humaneval']} | " + " | ".join(f"{taus['humaneval'][n]:.2f}" for n in names) + " |",
        f"| MT-Bench (first turns) | first {samples['mtbench']} | "
        + " | ".join(f"{taus['mtbench'][n]:.2f}" for n in names) + " |",
    ])
    card = f"""# DFlash drafter for SmolLM2-135M-Instruct

Trained by `blockdraft train` (the open recipe in this repository) on this project's CPU
machine; loaded by default by `blockdraft generate`, `bench` and `serve` for the default target.
Published z-lab format (`config.json` + `model.safetensors`, fp16, no embedding / LM head).

| | |
|---|---|
| drafter | {cfg['num_layers']} Qwen3-style layers, {n_params / 1e6:.1f}M parameters, block size {cfg['block_size']}, target layers {drafter.config.target_layer_ids}, mask token {cfg['mask_token_id']}, draft vocabulary {cfg.get('draft_vocab') or 'full'} (most frequent answer tokens), initialised from {cfg.get('init', 'random')} |
| data | answers regenerated greedily by SmolLM2-135M-Instruct to ShareGPT first turns (`data/regen/smollm2-135m-instruct`, HumanEval / MT-Bench prompts excluded) |
| training | {state['step']} steps x {cfg['batch_size']} sequences (max {cfg['max_seq_len']} tokens; {state.get('tokens_seen', 0) / 1e3:.0f}K tokens seen), {cfg['num_anchors']} random anchors per sequence, loss decay gamma {cfg['gamma'] or 'default'}, AdamW lr {cfg['lr']}, warmup {cfg['warmup_frac']:.0%}, cosine |
| wall time | {wall / 60:.0f} min on {cpu_name()} (fp32, torch {torch.__version__}; `scripts/train_shipped.sh`) |

## Measured acceptance length τ (greedy, up to {args.max_new_tokens} new tokens)

{tau_table}

Reproduce: `blockdraft bench --dataset humaneval --first-turn-only --methods {",".join(names)} --max-samples {samples['humaneval']} --max-new-tokens {args.max_new_tokens}` (and `--dataset mtbench`).

## τ on held-out ShareGPT prompts during training (real decode loop, 64 new tokens)

| step | tokens seen | τ |
|---|---|---|
""" + "".join(f"| {s} | {(n or 0) / 1e3:.0f}K | {t:.3f} |\n" for s, n, t in curve)
    (DEST / "README.md").write_text(card)
    print(card)


if __name__ == "__main__":
    main()
