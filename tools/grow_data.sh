#!/usr/bin/env bash
# One session's data job for the default target (issue "Drafters that learn more per sample"):
# the target writes PER_DOMAIN more user turns of each domain (code, chat, math; each for at most
# a third of PROMPT_MINUTES), then, for ANSWER_MINUTES in all, answers every self-written prompt not
# yet answered, greedily, and with the time left adds sampled answers (T 0.7, top-p 0.8, top-k 20)
# to the built-in prompt mix: answer index 1 (beside the greedy answer 0; an answer equal to one kept
# for its prompt dropped; ids answered in the earlier sampled folders skipped) into
# data/regen/smollm2-135m-instruct-a1 (a folder of its own, so that the fixed --limit-samples sets of
# earlier runs stay what they were), and once every prompt has its answer 1, answer 2 into -a2, and so
# on up to MAX_ANSWER (default 4).
# Every answer's target features (int8, with the soft labels' top tokens) go to the training feature
# cache runs/feature-cache (the shipped drafter's layers), so that training later skips the target
# for these samples; set FEATURES= to skip.
# Every step resumes where a stopped run left off and never answers a prompt twice, so the job can be
# stopped at any time (Ctrl-C) and started again.
#
#   tools/grow_data.sh [PER_DOMAIN [PROMPT_MINUTES [ANSWER_MINUTES]]]   # defaults: 1500 30 110
#
# Afterwards commit the new shards by their paths (data/prompts/smollm2-135m-instruct/synth-*,
# data/regen/smollm2-135m-instruct-synth, data/regen/smollm2-135m-instruct-a*) and rewrite the
# data table of docs/training.md:
#   .venv/bin/python benchmarks/data_table.py data/regen/* --doc docs/training.md
set -euo pipefail
cd "$(dirname "$0")/.."
per_domain=${1:-1500}
prompt_minutes=${2:-30}
answer_minutes=${3:-110}
bd=.venv/bin/blockdraft
prompts=data/prompts/smollm2-135m-instruct
regen=data/regen/smollm2-135m-instruct
cache=${FEATURES-runs/feature-cache}
features=()
if [[ -n $cache ]]; then features=(--feature-cache "$cache" --feature-dtype int8); fi

kept() {  # prompts already kept in a domain's folder
    local dir=$prompts/synth-$1
    if compgen -G "$dir/shard-*.jsonl.gz" > /dev/null; then zcat "$dir"/shard-*.jsonl.gz | wc -l; else echo 0; fi
}

for domain in code chat math; do
    want=$(( $(kept "$domain") + per_domain ))
    echo "grow_data: $domain prompts up to $want ($(date -u +%H:%M))" >&2
    $bd data prompts --synthesize "$want" --domain "$domain" --out "$prompts/synth-$domain" \
        --dtype bfloat16 --seconds $(( prompt_minutes * 60 / 3 ))
done
deadline=$(( $(date +%s) + answer_minutes * 60 ))
echo "grow_data: answering ($(date -u +%H:%M))" >&2
$bd data regenerate --prompts "$prompts" --mix synth-code=1,synth-math=1,synth-chat=1 \
    --out $regen-synth --dtype bfloat16 --seconds $(( deadline - $(date +%s) )) "${features[@]}"
# Answer K of every built-in prompt goes to $regen-aK; once a folder holds every prompt's answer K
# (regenerate returns before its time is up), the time left goes on to answer K + 1.
dedup=$regen,$regen-sampled,$regen-t07
for k in $(seq 1 "${MAX_ANSWER:-4}"); do
    left=$(( deadline - $(date +%s) ))
    (( left > 120 )) || break
    echo "grow_data: sampled answer $k to the built-in prompt mix, at most $(( left / 60 )) minutes ($(date -u +%H:%M))" >&2
    $bd data regenerate --out "$regen-a$k" --dtype bfloat16 --temperature 0.7 --top-p 0.8 --top-k 20 \
        --first-answer "$k" --dedup-against "$dedup" --seconds "$left" "${features[@]}"
    dedup+=",$regen-a$k"
done
echo "grow_data: done ($(date -u +%H:%M))" >&2
