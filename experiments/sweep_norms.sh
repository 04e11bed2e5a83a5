#!/usr/bin/env bash
# Layer sweep on the default model (paper Sec. 4.1/4.3, Fig. 5 and B.1): % perplexity change
# against the plain model over 29 (source, destination) pairs x three normalisation schemes
# (convex, beta1, none) at alpha = 0.1, every position recirculated token by token.
# Regenerates figures/sweep_norms.png and figures/sweep_norms.json.
#
# Sizes (measured on the shared 2-core CPU box, heavily loaded): 4 wiki windows x 128
# tokens, 87 cells packed 16 per engine run (64 rows) -> about 1 hour, plus ~10 min of
# looping (the same command, see looping_vs_recirculation.sh). Resumable: rerunning the
# script continues where it stopped.
#
#   experiments/sweep_norms.sh            # from the repository root
set -euo pipefail
cd "$(dirname "$0")/.."
PROBEKIT=${PROBEKIT:-probekit}  # run inside the venv (or set PROBEKIT)
RUN=runs/sweep-smollm2-norms

# destinations 1,4,...,22; sources 4,7,...,28; source - destination <= 12
"$PROBEKIT" sweep --pairs max-gap --max-gap 12 --step 3 --destinations 1:23:3 --sources 4:30:3 \
    --alphas 0.1 --norms convex beta1 none --looping \
    --corpus wiki --windows 4 --window-tokens 128 --rows 64 --threads 1 --run-dir "$RUN"
cp "$RUN/sweep.png" figures/sweep_norms.png
cp "$RUN/summary.json" figures/sweep_norms.json
