#!/usr/bin/env bash
# Part-of-speech attribution on the default model (paper Sec. 4.4.4, Fig. 9c and C.3).
# Regenerates figures/pos_attribution.png, figures/pos_selective.png and
# figures/pos_{attribution,selective}.json. Measured on the shared 2-core CPU box (heavily
# loaded, ~1.7 s per token step of a batch of 16): Part 1 8 min, Part 2 23 min. Resumable:
# an interrupted run picks up where it stopped.
#
#   experiments/pos_attribution.sh            # from the repository root, venv active
set -euo pipefail
cd "$(dirname "$0")/.."
PROBEKIT=${PROBEKIT:-probekit}  # run inside the venv (or set PROBEKIT / PYTHON)
RUN=runs/pos-attribution-smollm2-s16-d10
# s=16, d=10, alpha=0.1: the best of 13 (s, d, alpha) screened on 8 wiki windows of
# 64 tokens (-0.70% perplexity; see docs/pos-attribution.md).
REC=(--source 16 --destination 10 --alpha 0.1)
COMMON=(--corpus wiki --window-tokens 128 --batch-size 16 --noun-number --seed 0
        --threads 1 --run-dir "$RUN")
PART1=32      # windows for Part 1
SELECTIVE=16  # the first 16 of them for Part 2 (each selective tag costs two runs)

"$PROBEKIT" setup   # offline tagger set-up (idempotent)

# Part 1: net change in perplexity per tag of the predicted token, every position recirculated.
"$PROBEKIT" pos-attribution "${REC[@]}" "${COMMON[@]}" --windows "$PART1" --selective none
cp "$RUN/pos_attribution.png" figures/pos_attribution.png
cp "$RUN/summary.json" figures/pos_attribution.json

# Part 2: recirculate all and only the tokens of one tag vs a count-matched random set,
# on the first windows of the same run (their Part 1 parts are reused).
"$PROBEKIT" pos-attribution "${REC[@]}" "${COMMON[@]}" --windows "$SELECTIVE" \
    --selective ADV DET PRON NOUN.sg NOUN.pl
cp "$RUN/pos_selective.png" figures/pos_selective.png
cp "$RUN/summary.json" figures/pos_selective.json
