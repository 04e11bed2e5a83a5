#!/usr/bin/env bash
# Stability of the learned recurrence (full-bandwidth paper Fig. 3) and which state is fed
# back (Sec. 3.3): organisms trained with the pass schedules the paper contrasts, 75% one
# pass / 22% two / 3% three (the paper's final choice, probekit's default) against 75% one
# / 25% two, both for 2,000 steps, beside 50/35/15 for 4,000 steps (a recipe tried on the
# way) and the default with the un-normed top residual fed back. Each is run
# for 30 fused Jacobi passes (loss, ||h(k) - h(k-1)||, label accuracy per pass) and probed
# at every depth under none / full prefill (0 and 8 distractors). Writes
#   figures/latent-feedback-fig3.png    the variants' curves against k
#   figures/latent-feedback-fig3.json   every curve, the probes, each organism's training record
# Organisms come from probekit's cache (trained there on first use, 11-22 min each).
#
#   experiments/latent_feedback_stability.sh      # from the repository root
#   VARIANTS="default-75-22-3 paper-75-25" experiments/latent_feedback_stability.sh  # some
set -euo pipefail
cd "$(dirname "$0")/.."
PROBEKIT=${PROBEKIT:-probekit}
PYTHON=${PYTHON:-python}
RUN=${RUN:-runs/latent-feedback-fig3}
SEED=${SEED:-0}
PASSES=${PASSES:-30}

declare -A VARIANT=(
    [default-75-22-3]=""
    [paper-75-25]="--schedule 0.75 0.25"
    [schedule-50-35-15]="--schedule 0.5 0.35 0.15 --steps 4000"
    [feed-residual]="--feed residual"
)
ALL="default-75-22-3 paper-75-25 schedule-50-35-15 feed-residual"  # VARIANT's keys, in order
NAMES=${VARIANTS:-$ALL}
for name in $NAMES; do  # before any training: an unknown name would train the default
    if [ -z "${VARIANT[$name]+known}" ]; then
        echo "latent_feedback_stability: error: VARIANTS names no variant '$name'; choose" \
             "from: $ALL" >&2
        exit 2
    fi
done
for name in $NAMES; do
    # shellcheck disable=SC2086  # the variant's flags are words
    ckpt=$("$PYTHON" experiments/organism_checkpoint.py --seed "$SEED" ${VARIANT[$name]})
    "$PROBEKIT" feedback-stability --checkpoint "$ckpt" --passes "$PASSES" --threads 1 \
        --no-progress --run-dir "$RUN/$name/stability"
    "$PROBEKIT" run state-tracking --mechanism latent-feedback --checkpoint "$ckpt" \
        --task completion memory --recurrence none full --threads 1 --no-progress \
        --run-dir "$RUN/$name/state-tracking"
done
mkdir -p figures
# shellcheck disable=SC2086
"$PYTHON" experiments/fig3.py "$RUN" --seed "$SEED" --variants $NAMES
