#!/usr/bin/env bash
# Lag benefit of recirculating one token (paper Sec. 4.4.4, Fig. 9a,b) on the default model:
# the mean change in log-likelihood at lag k (log axes) with its power-law fit, the (t, k)
# map, and the early-position effect (t < 10). Exact fast path (probekit/analysis/lag.py).
# Regenerates figures/lag_benefit.png and figures/lag_benefit.json.
#
# s=16, d=10, alpha=0.1: the setting of experiments/pos_attribution.sh (Fig. 9c), so that
# Fig. 9a,b,c share one setting as in the paper; in experiments/sweep_norms.sh it gives
# -0.20% perplexity, within that small sweep's noise of its best cell (22, 10), -0.40%.
# Sizes: 8 wiki windows x 256 tokens, lags 1..64, every t < 20 and every 6th t up to 188
# (49 positions; the mean over t weights each sampled t by the positions it stands for).
#
#   experiments/lag_benefit.sh   # from the repository root
set -euo pipefail
cd "$(dirname "$0")/.."
PROBEKIT=${PROBEKIT:-probekit}
RUN=runs/lag-smollm2-s16-d10

"$PROBEKIT" lag-analysis --source 16 --destination 10 --alpha 0.1 \
    --window-tokens 256 --max-lag 64 --positions 0:20 20:191:6 \
    --corpus wiki --windows 8 --batch-size 8 --threads 1 --run-dir "$RUN"
cp "$RUN/lag_analysis.png" figures/lag_benefit.png
cp "$RUN/summary.json" figures/lag_benefit.json
