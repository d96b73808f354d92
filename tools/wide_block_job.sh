#!/usr/bin/env bash
# The background job of the issue "Drafters for wide blocks": the A/B runs that choose the wide-block
# recipe, then the block-16 DSpark drafter itself. Every stage is resumable: a stage whose metrics log
# (data/train-logs/NAME.metrics.jsonl) shows its last step is skipped, a stage with a run folder
# (runs/NAME/checkpoint) continues from it, on a new machine from its committed position
# (data/train-logs/positions/NAME: `tools/wide_block_job.sh keep NAME` copies the live arm's there with
# its log at the end of a session, to commit once; delete finished arms'); call the script again after a stop
# or on a new session.
#
#   tools/wide_block_job.sh            # run every stage not yet done, in order
#   STAGES="dpace" tools/wide_block_job.sh
#
# Stage dpace: D-PACE against the fixed decay (exp(-(k-1)/7) at block 16), equal steps, the same
# samples, anchors and seed; both warm-started from the shipped DSpark drafter (block 4) and trained at
# block 16, held-out decode tau at block 16 at steps 200 and 400 (32 prompts, 96 new tokens). The first
# arm fills the feature cache (int8, rounded as stored for both arms), the second reads it.
# Stage layers: 5 decoder layers against 3 at equal training CPU (see the stage), the A/B's winning
# position weights; judged in tokens/s by `blockdraft bench` (docs/training.md has the commands).
# Stage main: the block-16 drafter itself in DSpark's block layout (--draft-layout anchor: every slot
# drafts the token after it, what DeepSpec, vLLM and SGLang run), the A/Bs' winners (D-PACE, 3 layers),
# warm-started from the shipped drafter, every committed sample, 3 epochs; run `wide16`.
# The target runs in float32 for training on a CPU without native bf16 products (bf16 costs ~45 s a
# step there against ~4 s), in bfloat16 where `blockdraft.precision` says bf16 is fast (DTYPE= to choose).
set -euo pipefail
cd "$(dirname "$0")/.."
# glibc (Linux): a step's freed tensors stay in the heap for the next step instead of going back to the
# kernel, whose fresh pages cost more to fault in than the arithmetic on them (~10 % of a CPU step here)
export GLIBC_TUNABLES=${GLIBC_TUNABLES:-glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647}
bd=.venv/bin/blockdraft
stages=${STAGES:-dpace layers main}
main=data/regen/smollm2-135m-instruct
data=$(ls -d $main $main-* | paste -sd, -)
dtype=${DTYPE:-$(.venv/bin/python -c "import torch; from blockdraft.precision import auto_dtype as a
print(str(a(torch.device('cpu')).dtype).removeprefix('torch.'))")}
# The feature cache (int8): the main run's samples take ~52 GiB; it keeps CACHE_RESERVE_GIB free on its
# disk (10 by default: a clean clone's test run needs ~4 GB), the samples beyond run the target every epoch.
cache=(--feature-cache runs/feature-cache --feature-dtype int8 --feature-cache-reserve "${CACHE_RESERVE_GIB:-10}")
ab=(--data "$data" --limit-samples 1600 --max-steps 400 --markov-rank 256 --block-size 16 --num-anchors 32
    --batch-size 4 --draft-vocab 8192 --schedule wsd --warmup-steps 25 --lr 3e-4 --dtype "$dtype" --distill 1
    --init-from blockdraft/shipped/smollm2-135m-instruct-dflash --eval-every 200 --eval-prompts 32
    --eval-max-new-tokens 96 --save-every 50 "${cache[@]}")

done_at() {  # the last step a run's committed metrics log records (0: none)
    local log=data/train-logs/$1.metrics.jsonl
    [[ -f $log ]] && grep -o '"step": [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo 0
}

run_arm() {  # NAME STEPS ARGS...: train (or resume) one arm, then keep its metrics log
    # The run writes its positions under runs/NAME/position (ignored by git); `keep NAME` copies the
    # last one into data/train-logs/positions/NAME once, at the end of a session (one position per
    # live run in a submission: a position committed at every save would multiply 50 MB by the saves).
    local name=$1 steps=$2; shift 2
    local pos=runs/$name/position committed=data/train-logs/positions/$name
    if [[ $(done_at "$name") -ge $steps ]]; then echo "wide-block job: $name done"; return; fi
    if [[ -f runs/$name/checkpoint/state.json ]]; then  # this machine's checkpoint, optimizer included
        $bd train --out "runs/$name" --resume --position-dir "$pos" "$@"
    elif [[ -f $committed/state.json ]]; then  # a committed position, from another machine
        $bd train --resume-from "$committed" --out "runs/$name" --position-dir "$pos" \
            "${cache[@]}"
    else
        $bd train --out "runs/$name" --position-dir "$pos" "$@"
    fi
    keep_log "$name"
}

keep_position() {  # NAME: the run's last position into the tree (weights + schedule), replacing the old one
    local src=runs/$1/position dst=data/train-logs/positions/$1
    [[ -f $src/state.json ]] || { echo "wide-block job: no position in $src" >&2; exit 2; }
    rm -rf "$dst.tmp" && cp -r "$src" "$dst.tmp" && rm -rf "$dst" && mv "$dst.tmp" "$dst"
}

keep_log() {  # NAME: the run's metrics into data/train-logs, after the committed records of earlier steps
    .venv/bin/python - "$1" <<'PY'
import json, pathlib, sys
new = pathlib.Path(f"runs/{sys.argv[1]}/metrics.jsonl").read_text().splitlines()
kept = pathlib.Path(f"data/train-logs/{sys.argv[1]}.metrics.jsonl")
first = json.loads(new[0])["step"] if new else float("inf")
old = [line for line in (kept.read_text().splitlines() if kept.is_file() else []) if json.loads(line)["step"] < first]
kept.write_text("".join(line + "\n" for line in old + new))
PY
}

planned_steps() {  # NAME: the steps a run by epochs fixed when it started (none yet: more than any run)
    .venv/bin/python - "$1" <<'PY'
import json, pathlib, sys
for state in (f"runs/{sys.argv[1]}/checkpoint/state.json", f"data/train-logs/positions/{sys.argv[1]}/state.json"):
    if pathlib.Path(state).is_file():
        print(json.loads(pathlib.Path(state).read_text())["config"]["max_steps"]); break
else:
    print(10**9)
PY
}

winner() {  # the A/B's position weights: the higher decode tau at the last step (decay on a tie)
    .venv/bin/python - <<'PY'
import json
def tau(name):
    return [r["tau"] for r in map(json.loads, open(f"data/train-logs/ab16-{name}.metrics.jsonl")) if "tau" in r][-1]
print("dpace" if tau("dpace") > tau("decay") else "decay")
PY
}

if [[ ${1:-} == keep ]]; then keep_log "$2"; keep_position "$2"; exit; fi

for stage in $stages; do
    case $stage in
        dpace)
            run_arm ab16-decay 400 "${ab[@]}" --position-weights decay
            run_arm ab16-dpace 400 "${ab[@]}" --position-weights dpace
            ;;
        layers)
            # 5 layers against 3 at equal training CPU: the 5-layer arm (the shipped drafter's 3 layers and 2
            # fresh ones, the same 3 target layers) is timed on a 20-step probe, then runs the steps that cost what the
            # 3-layer arm's 400 did (both reading the feature cache: seconds of steps 10-20 compared)
            if [[ $(done_at ab16-l5) -gt 0 && ! -d runs/ab16-l5 ]]; then  # ended on another machine
                echo "wide-block job: ab16-l5 done"; continue
            fi
            weights=$(winner)
            if [[ ! -f runs/ab16-l5-probe/metrics.jsonl ]]; then  # a throwaway run, to time the steps
                $bd train --out runs/ab16-l5-probe "${ab[@]}" --num-layers 5 --target-layer-ids 1 14 27 \
                    --position-weights "$weights" --max-steps 20 --eval-prompts 1 --eval-max-new-tokens 4
            fi
            steps=$(.venv/bin/python - <<'PY'
import json, sys
def seconds(name):  # seconds of steps 10..20
    recs = {r["step"]: r["elapsed"] for r in map(json.loads, open(name)) if "elapsed" in r}
    return recs[20] - recs[10]
three = seconds("data/train-logs/ab16-dpace.metrics.jsonl")  # 3 layers, reading the cache as the probe does
print(max(20, round(400 * three / seconds("runs/ab16-l5-probe/metrics.jsonl"))))
PY
)
            echo "wide-block job: the 5-layer arm gets $steps steps"
            run_arm ab16-l5 "$steps" "${ab[@]}" --num-layers 5 --target-layer-ids 1 14 27 \
                --position-weights "$weights" --max-steps "$steps"
            ;;
        main)
            # the A/B's settings over every sample for 3 epochs; held-out tau every 2,500 steps
            run_arm wide16 "$(planned_steps wide16)" --data "$data" --epochs 3 --markov-rank 256 \
                --block-size 16 --num-anchors 32 --batch-size 4 --draft-vocab 8192 --schedule wsd \
                --warmup-steps 25 --lr 3e-4 --dtype "$dtype" --distill 1 \
                --init-from blockdraft/shipped/smollm2-135m-instruct-dflash --eval-every 2500 --eval-prompts 32 \
                --eval-max-new-tokens 96 --save-every 100 "${cache[@]}" \
                --position-weights dpace --draft-layout anchor
            ;;
        *) echo "wide-block job: unknown stage $stage" >&2; exit 2 ;;
    esac
done
