#!/usr/bin/env bash
# The next drafter for the default target (issue "Drafters that learn more per sample"): the shipped
# DSpark drafter (DFlash + a rank-256 Markov head, block 4) trained EPOCHS more epochs over every
# answer folder of data/regen (greedy, sampled and self-written prompts' answers), in the recipe of
# the shipped one (docs/training.md, "The DSpark run") with soft labels (--distill 1: the target's
# top-32 distribution at each position, which never lost to hard labels in the `labels` A/Bs). The
# samples and steps are fixed when the run starts (--epochs); the target's features and top tokens
# come from runs/feature-cache (what `data regenerate --feature-cache` stored while answering; the
# rest are computed and stored, as int8, on the first epoch).
# Resumable from any point: the first call starts the run, every later one continues it, on this
# machine from runs/NAME/checkpoint (with the optimizer state), on a fresh one from the committed
# position data/train-logs/positions/NAME (commit that folder, never runs/).
#
#   tools/train_all.sh [EPOCHS]        # default 3; NAME=dspark-e3 by default
#
# SINCE=POSITION leaves out every sample the run at that committed position trained on
# (--skip-trained-by): the shipped drafter goes on with only the answers added since it was made,
#   SINCE=data/train-logs/positions/dspark-all NAME=dspark-new tools/train_all.sh 1
# (a resumed run takes --skip-trained-by from its saved settings; SINCE then changes nothing)
#
# Ctrl-C (or SIGTERM) stops it at the end of a step with a checkpoint and the position written.
set -euo pipefail
cd "$(dirname "$0")/.."
epochs=${1:-3}
name=${NAME:-dspark-e$epochs}
bd=.venv/bin/blockdraft
pos=data/train-logs/positions/$name
common=(--out "runs/$name" --position-dir "$pos" --feature-cache runs/feature-cache --feature-dtype int8)
since=()
if [[ -n ${SINCE:-} ]]; then since=(--skip-trained-by "$SINCE"); fi
if [[ -f $pos/state.json ]]; then
    exec $bd train --resume-from "$pos" "${common[@]}"
fi
main=data/regen/smollm2-135m-instruct
data=$(ls -d $main $main-* | paste -sd, -)  # the greedy answers first, then the other folders by name
exec $bd train "${common[@]}" "${since[@]}" --data "$data" --epochs "$epochs" --markov-rank 256 --block-size 4 \
    --num-anchors 64 --batch-size 4 --draft-vocab 8192 --schedule wsd --warmup-steps 25 --lr 3e-4 \
    --dtype bfloat16 --distill 1 --init-from blockdraft/shipped/smollm2-135m-instruct-dflash \
    --eval-every 2500 --eval-prompts 32 --eval-max-new-tokens 96 --save-every 100
