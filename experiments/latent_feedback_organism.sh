#!/usr/bin/env bash
# Latent feedback on probekit's model organism across lengths (full-bandwidth paper Sec. 4.4,
# Fig. 7a, App. F): probe the final colon's residual at every depth under standard (none),
# one-step (last-1) and full recurrent prefill, for completion tracking and delayed memory
# with 0, 8, 32, 128 and 256 null updates (the paper's counts and per-count sizes: 80
# completion pairs, 128 memory contexts), on the long-range recipe's organisms of five
# training seeds (probekit.training.organism_cache.LONG_RANGE: the headline recipe made to
# hold its state over the longest rows). They come from probekit's cache, trained there
# on first use (56-69 min each at one thread, two or three at a time on 2 cores). Writes
#   figures/latent-feedback-fig7a.png    depth-0 probe vs length; every depth at 256
#   figures/latent-feedback-fig7a.json   every number, per seed, with the patching statistics
# See docs/latent-feedback.md for what was measured.
#
#   experiments/latent_feedback_organism.sh                 # from the repository root
#   SEEDS="0" COUNTS="0 8" experiments/latent_feedback_organism.sh   # a quick look
#
# RECIPE takes experiments/organism_checkpoint.py's flags: the same figure on the
# organisms of another recipe, trained into the cache first if need be (RECIPE="" is the
# default recipe; the HEADLINE flags below, the organisms `probekit run state-tracking`
# trains, make latent-feedback-fig7a-headline-recipe). Its runs and figure get names of
# their own (RUN, and FIGURE for the file stem, say otherwise; OUT is the figure's
# folder), so Fig. 7a's figure is never overwritten:
#   RECIPE="" SEEDS="0 1 3" experiments/latent_feedback_organism.sh
#   RECIPE="--copy-rows 0.25 --fixed-point 0.1 --steps 3000" SEEDS="0 1 3 4" \
#       experiments/latent_feedback_organism.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PROBEKIT=${PROBEKIT:-probekit}  # run inside the venv (or set PROBEKIT)
PYTHON=${PYTHON:-python}
# tests/test_fig7a.py checks that these flags make Recipe.long_range and Recipe.headline
LONG_RANGE="--copy-rows 0.25 --fixed-point 0.25 --steps 4500 --lr-floor 0 --ahead-loss 4 --long-rows 4 --lam 2"
HEADLINE="--copy-rows 0.25 --fixed-point 0.1 --steps 3000 --lr-floor 0 --ahead-loss 4"
RECIPE=${RECIPE-$LONG_RANGE}  # unset: Fig. 7a's; empty: the default recipe
# the recipe's flags as a name: "--copy-rows 0.25 --steps 3000" -> "copy-rows-0.25-steps-3000"
if [ "$RECIPE" = "$LONG_RANGE" ]; then
    SLUG=""
elif [ "$RECIPE" = "$HEADLINE" ]; then
    SLUG="headline-recipe"
elif [ -z "$RECIPE" ]; then
    SLUG="default-recipe"
else
    SLUG=$(echo "$RECIPE" | sed -E 's/(^| )--/ /g; s/^ +//; s/ +/-/g')
fi
RUN=${RUN:-runs/latent-feedback-fig7a${SLUG:+-$SLUG}}
FIGURE=${FIGURE:-latent-feedback-fig7a${SLUG:+-$SLUG}}
OUT=${OUT:-figures}
SEEDS=${SEEDS:-0 1 2 3 4}
COUNTS=${COUNTS:-0 8 32 128 256}

for seed in $SEEDS; do   # one run per seed: a seed added later reuses the others
    # word splitting of RECIPE is meant: it holds flags
    # shellcheck disable=SC2086
    ckpt=$("$PYTHON" experiments/organism_checkpoint.py --seed "$seed" $RECIPE)
    for d in $COUNTS; do
        # examples per length: completion 80 pairs x 4 assignments, memory 128 contexts x 2
        for task_examples in completion:320 memory:256; do
            task=${task_examples%%:*}
            "$PROBEKIT" run state-tracking --mechanism latent-feedback --checkpoint "$ckpt" \
                --task "$task" --examples "${task_examples##*:}" --distractors "$d" \
                --recurrence none last-k full --k 1 --threads 1 --no-progress \
                --run-dir "$RUN/seed$seed/$task-d$d"
        done
    done
done
"$PYTHON" experiments/fig7a.py "$RUN" --counts $COUNTS --seeds $SEEDS --out "$OUT" --name "$FIGURE"
