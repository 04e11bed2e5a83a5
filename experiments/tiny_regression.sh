#!/usr/bin/env bash
# Every figure's command, shrunk to a random tiny model (seconds, not hours), its summary
# JSON copied to $OUT/<figure>.json. Run it before and after a change to the code and
# compare the two folders with experiments/compare_summaries.py: a refactor must leave
# every number identical (timings, paths and versions aside).
#
#   OUT=/tmp/before experiments/tiny_regression.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PROBEKIT=${PROBEKIT:-probekit}
OUT=${OUT:-runs/tiny-regression}
RUNS=${RUNS:-runs/tiny-regression-runs}
rm -rf "$RUNS"; mkdir -p "$OUT"
M=(--model tiny --threads 1 --no-progress)
REC=(--source 3 --destination 1 --alpha 0.1)

"$PROBEKIT" perplexity "${M[@]}" "${REC[@]}" --windows 3 --window-tokens 32 --run-dir "$RUNS/ppl"
cp "$RUNS/ppl/summary.json" "$OUT/perplexity.json"

"$PROBEKIT" lag-analysis "${M[@]}" "${REC[@]}" --window-tokens 40 --max-lag 8 \
    --positions 0:10 10:31:4 --windows 2 --batch-size 2 --run-dir "$RUNS/lag"
cp "$RUNS/lag/summary.json" "$OUT/lag_benefit.json"
"$PROBEKIT" lag-analysis "${M[@]}" "${REC[@]}" --window-tokens 24 --max-lag 4 \
    --positions 0:19:6 --complement --windows 2 --batch-size 2 --run-dir "$RUNS/lagc"
cp "$RUNS/lagc/summary.json" "$OUT/lag_complement.json"

"$PROBEKIT" sweep "${M[@]}" --pairs max-gap --max-gap 2 --step 1 --destinations 0:3:1 \
    --sources 1:4:1 --alphas 0.1 --norms convex beta1 none --looping --windows 2 \
    --window-tokens 24 --rows 8 --run-dir "$RUNS/sweep"
cp "$RUNS/sweep/summary.json" "$OUT/sweep_norms.json"
"$PROBEKIT" sweep "${M[@]}" --pairs max-gap --max-gap 2 --step 1 --destinations 0:3:1 \
    --sources 1:4:1 --alphas 0.04 0.1 0.2 --norms convex --windows 2 --window-tokens 24 --rows 8 \
    --run-dir "$RUNS/sweep-a"
cp "$RUNS/sweep-a/summary.json" "$OUT/sweep_alphas.json"

POS=(--window-tokens 32 --batch-size 2 --noun-number --seed 0 --run-dir "$RUNS/pos")
"$PROBEKIT" pos-attribution "${M[@]}" "${REC[@]}" "${POS[@]}" --windows 3 --selective none
cp "$RUNS/pos/summary.json" "$OUT/pos_attribution.json"
"$PROBEKIT" pos-attribution "${M[@]}" "${REC[@]}" "${POS[@]}" --windows 2 --selective NOUN VERB
cp "$RUNS/pos/summary.json" "$OUT/pos_selective.json"

"$PROBEKIT" train-feedback "${M[@]}" --mode organism --steps 12 --feedback-start 6 \
    --schedule 0.5 0.35 0.15 --n-blocks 2 --d-model 32 --n-heads 2 --d-mlp 64 \
    --n-examples 64 --batch-size 8 --eval-every 6 --save-every 6 --run-dir "$RUNS/train"
"$PROBEKIT" run state-tracking --threads 1 --no-progress --mechanism latent-feedback \
    --checkpoint "$RUNS/train/checkpoint" --recurrence none last-k full --k 1 \
    --task completion memory --examples 32 --distractors 0 --run-dir "$RUNS/st"
cp "$RUNS/st/summary.json" "$OUT/latent-feedback-organism-state-tracking.json"
"$PROBEKIT" feedback-stability --threads 1 --no-progress --checkpoint "$RUNS/train/checkpoint" \
    --passes 6 --run-dir "$RUNS/stab"
cp "$RUNS/stab/summary.json" "$OUT/latent-feedback-organism-stability.json"
cp "$RUNS/train/summary.json" "$OUT/latent-feedback-organism-training.json"
echo "wrote $OUT"
