#!/usr/bin/env bash
# The benchmark runs behind the README's tables (CPU, default target, shipped drafters).
# Defaults are the drafter goals' setting: greedy, 256 new tokens, the first 8 prompts of each dataset,
# every method interleaved prompt by prompt in one process.
set -euo pipefail
BIN=${BIN:-.venv/bin/blockdraft}
PY=${PY:-.venv/bin/python}
N=${N:-8}
R=${R:-1}  # repeats of every prompt (R=2 gives min-max spreads, at twice the time)
OUT=${OUT:-bench-results}
METHODS=${METHODS:-ar,lookup,eagle3@4,dflash@3,dflash,dflash-cut}  # add hf,hf-lookup@4,eagle3,dflash@2 for the full table
# llama.cpp on the same weights when llama-cpp-python is installed (`make peers`)
if "$PY" -c "import llama_cpp" 2>/dev/null; then METHODS="$METHODS,llamacpp"; fi
"$BIN" bench --dataset humaneval,mtbench,gsm8k --first-turn-only --max-samples "$N" --max-new-tokens 256 \
    --repeats "$R" --methods "$METHODS" --out "$OUT/cpu-greedy"
# temperature 1: speed, and the token distribution checked against ar on other seeds
"$BIN" bench --dataset mtbench --first-turn-only --max-samples 2 --max-new-tokens 128 --temperature 1 \
    --methods ar,lookup,eagle3@4,dflash@4 --check-distribution 200 --out "$OUT/cpu-t1"
