#!/usr/bin/env bash
# The shipped drafters for the default target: DFlash (the default; block 16, so it runs at
# blocks 2-16) and the EAGLE-3-style baseline (chains of 7), same data, same steps, batch,
# anchors and schedule (equal training budget).
# On the 2-core CPU both run side by side with one thread each. Resumable: rerun to continue.
set -euo pipefail
STEPS=${STEPS:-400}
DATA=${DATA:-data/regen/smollm2-135m-instruct}
BIN=${BIN:-.venv/bin/blockdraft}
THREADS=${THREADS:-1}
common=(--data "$DATA" --num-anchors 64 --batch-size 4 --lr 1e-3 --draft-vocab 8192
        --max-steps "$STEPS" --eval-every 100 --eval-prompts 8 --eval-max-new-tokens 64
        --save-every 25 --log-every 5 --resume)
OMP_NUM_THREADS=$THREADS "$BIN" train "${common[@]}" --arch dflash --block-size 16 --num-layers 3 --init target-last-fc --out runs/ship-dflash-b16 &
OMP_NUM_THREADS=$THREADS "$BIN" train "${common[@]}" --arch eagle3 --block-size 8 --init target-last --out runs/ship-eagle3 &
wait
