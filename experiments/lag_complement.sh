#!/usr/bin/env bash
# The complementary experiment of paper Sec. 4.4.4 (last paragraph): recirculate every
# position but t, next to recirculating only t, on the same windows and positions. If the
# per-token benefits add up in log-likelihood, the two curves agree.
# Regenerates figures/lag_complement.png and figures/lag_complement.json.
#
# The complement needs ~K+1 token-by-token steps per t, so it runs smaller than
# lag_benefit.sh: 4 wiki windows x 96 tokens, lags 1..16, every 6th t.
#
#   experiments/lag_complement.sh   # from the repository root
set -euo pipefail
cd "$(dirname "$0")/.."
PROBEKIT=${PROBEKIT:-probekit}
RUN=runs/lag-complement-smollm2-s16-d10

"$PROBEKIT" lag-analysis --source 16 --destination 10 --alpha 0.1 \
    --window-tokens 96 --max-lag 16 --positions 0:78:6 --complement \
    --corpus wiki --windows 4 --batch-size 4 --threads 1 --run-dir "$RUN"
cp "$RUN/lag_analysis.png" figures/lag_complement.png
cp "$RUN/summary.json" figures/lag_complement.json
