#!/usr/bin/env bash
# Multi-register state under latent feedback (full-bandwidth paper Fig. 7b, App. F): the
# register-count sweep (m = 1, 2, 4, 8; 16 assignments, 8 null updates, padded to 180
# tokens; 128 schedules per m, 3,840 examples) and the overwrite sweep (m = 8 with 2 / 4 / 8
# writes per register, 180 / 276 / 468 tokens, 2,048 examples each) under standard, last-k
# (k = 1, 2, 4) and full recurrent prefill, probed at every depth, with App. F's matched
# pairs (same history, different queried register) for patching. The organisms are trained
# on TASKS (default `--tasks registers`; probekit's cache) for STEPS steps (default 4,000),
# at the organism shape SHAPE (default probekit's; e.g. SHAPE="--d-model 256 --n-heads 8",
# the width that learned two registers in experiments/register_plateau.py), with any other
# organism_checkpoint.py flags in RECIPE (e.g. the match hint: RECIPE="--init-std 0.06
# --match-hint 5 --match-hint-parts circuit"; docs/latent-feedback.md says what it does).
# In our runs no such organism learned the task (seed 0: 2,000 to 8,000 steps, four kinds
# of training rows; they learn the latest write but not which register was asked for:
# docs/latent-feedback.md, experiments/register_shapes.py), so check the printed task
# accuracy before reading the probes. Writes
#   figures/latent-feedback-fig7b.png    probe accuracy per condition, depth and regime
#   figures/latent-feedback-fig7b.json   every number per seed, patching statistics included
#
#   experiments/latent_feedback_registers.sh            # from the repository root
#   SEEDS="0" experiments/latent_feedback_registers.sh  # one organism
set -euo pipefail
cd "$(dirname "$0")/.."
PROBEKIT=${PROBEKIT:-probekit}
PYTHON=${PYTHON:-python}
RUN=${RUN:-runs/latent-feedback-fig7b}
SEEDS=${SEEDS:-0 1 2}
STEPS=${STEPS:-4000}
TASKS=${TASKS:-registers}   # the organism's training tasks, e.g. "completion memory registers"
SHAPE=${SHAPE:-}            # organism shape flags, e.g. "--d-model 256 --n-heads 8"
RECIPE=${RECIPE:-}          # other organism flags, e.g. "--match-hint 5"

for seed in $SEEDS; do
    # shellcheck disable=SC2086  # TASKS, SHAPE and RECIPE are lists of words
    ckpt=$("$PYTHON" experiments/organism_checkpoint.py --seed "$seed" --tasks $TASKS \
        --steps "$STEPS" $SHAPE $RECIPE)
    for sweep_examples in register-sweep:3840 overwrite-sweep:6144; do
        sweep=${sweep_examples%%:*}
        "$PROBEKIT" run state-tracking --mechanism latent-feedback --checkpoint "$ckpt" \
            --task "$sweep" --examples "${sweep_examples##*:}" \
            --recurrence none last-k full --k 1 2 4 --threads 1 --no-progress \
            --run-dir "$RUN/seed$seed/$sweep"
    done
done
mkdir -p figures
# shellcheck disable=SC2086
"$PYTHON" experiments/fig7b.py "$RUN" --seeds $SEEDS
