#!/usr/bin/env bash
# The ablation runs of the README's table: the shipped recipe and one switch flipped per run,
# equal compute (same steps, batch, data order and seed). Resumable: rerun to continue.
set -euo pipefail
STEPS=${STEPS:-150}
DATA=${DATA:-data/regen/smollm2-135m-instruct}
BIN=${BIN:-.venv/bin/blockdraft}
common=(--data "$DATA" --block-size 8 --num-layers 3 --num-anchors 64 --batch-size 4 --lr 1e-3
        --draft-vocab 8192 --init target-last --max-steps "$STEPS" --eval-every "$STEPS" --eval-prompts 16
        --eval-max-new-tokens 64 --save-every 25 --log-every 5)
declare -A variants=(
  [recipe]=""
  [context-input]="--context-mode input"
  [anchors-fixed]="--anchor-mode fixed"
  [no-decay]="--gamma 0"
)
for name in recipe context-input anchors-fixed no-decay; do
  out=runs/ablation-$name
  [ -f "$out/drafter/config.json" ] && continue
  # shellcheck disable=SC2086
  "$BIN" train "${common[@]}" --out "$out" --resume ${variants[$name]}
done
