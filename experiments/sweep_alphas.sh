#!/usr/bin/env bash
# Layer sweep over alpha on the default model (paper Sec. 4.1, Fig. 5): % perplexity change
# over 12 (source, destination) pairs around the region where alpha = 0.1 helped in
# sweep_norms.sh, for alpha = 0.04, 0.1, 0.2, convex mix with norm-ratio scaling.
# Regenerates figures/sweep_alphas.png and figures/sweep_alphas.json.
#
# Sizes: the same 4 wiki windows x 128 tokens as sweep_norms.sh; 36 cells packed 18 per
# engine run (72 rows). Resumable.
#
#   experiments/sweep_alphas.sh   # from the repository root
set -euo pipefail
cd "$(dirname "$0")/.."
PROBEKIT=${PROBEKIT:-probekit}
RUN=runs/sweep-smollm2-alphas

# destinations 7,10,13,16; sources 10,13,...,28; source - destination <= 9
"$PROBEKIT" sweep --pairs max-gap --max-gap 9 --step 3 --destinations 7:17:3 --sources 10:29:3 \
    --alphas 0.04 0.1 0.2 --norms convex \
    --corpus wiki --windows 4 --window-tokens 128 --rows 72 --threads 1 --run-dir "$RUN"
cp "$RUN/sweep.png" figures/sweep_alphas.png
cp "$RUN/summary.json" figures/sweep_alphas.json
