#!/usr/bin/env bash
# Recirculation vs the looping baseline over the same (source, destination) = (l2, l1) pairs
# (paper Sec. 4.4.3, Fig. 8). The sweep of sweep_norms.sh computes both; this script runs the
# identical command (every finished part is reused, so after sweep_norms.sh it only redraws)
# and regenerates figures/looping_vs_recirculation.png.
#
#   experiments/looping_vs_recirculation.sh   # from the repository root
set -euo pipefail
cd "$(dirname "$0")/.."
PROBEKIT=${PROBEKIT:-probekit}
RUN=runs/sweep-smollm2-norms

"$PROBEKIT" sweep --pairs max-gap --max-gap 12 --step 3 --destinations 1:23:3 --sources 4:30:3 \
    --alphas 0.1 --norms convex beta1 none --looping \
    --corpus wiki --windows 4 --window-tokens 128 --rows 64 --threads 1 --run-dir "$RUN"
cp "$RUN/looping.png" figures/looping_vs_recirculation.png
