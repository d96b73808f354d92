#!/usr/bin/env bash
# The benchmark runs behind the README's tables (CPU, default target, shipped drafters).
set -euo pipefail
BIN=${BIN:-.venv/bin/blockdraft}
N=${N:-4}
R=${R:-2}  # repeats of every prompt (medians and min-max spread)
OUT=${OUT:-bench-results}
# greedy, 256 new tokens: every method side by side
"$BIN" bench --dataset humaneval,mtbench --first-turn-only --max-samples "$N" --max-new-tokens 256 --repeats "$R" \
    --methods ar,hf,hf-lookup@4,lookup,eagle3@4,eagle3,dflash@2,dflash@4,dflash@8,dflash --out "$OUT/cpu-greedy"
# temperature 1: speed, and the token distribution checked against ar on other seeds
"$BIN" bench --dataset mtbench --first-turn-only --max-samples 2 --max-new-tokens 128 --temperature 1 \
    --methods ar,lookup,eagle3@4,dflash@4 --check-distribution 200 --out "$OUT/cpu-t1"
