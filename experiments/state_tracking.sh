#!/usr/bin/env bash
# The headline command (latent-feedback paper Sec. 4.4, Fig. 7, App. F): latent feedback
# on probekit's headline organism (seed 0, trained into the cache on first use) beside
# recirculation on the default model, completion tracking and delayed memory, standard vs
# full recurrent prefill. Regenerates figures/headline-{completion,memory}.png and
# figures/headline.json (every number, the patching statistics included) and the
# recirculation run's own figure figures/state-tracking-completion.{png,json}. The timing of
# each part is in docs/state-tracking.md.
#
#   experiments/state_tracking.sh            # from the repository root
#   SIZE=small experiments/state_tracking.sh # 32 short examples per task
set -euo pipefail
cd "$(dirname "$0")/.."
PROBEKIT=${PROBEKIT:-probekit}  # run inside the venv (or set PROBEKIT)
if [[ "${SIZE:-full}" == small ]]; then
    SIZE_ARGS=(--examples 32 --distractors 0); RUN=runs/state-tracking-headline-small
else
    SIZE_ARGS=(); RUN=runs/state-tracking-headline
fi
"$PROBEKIT" run state-tracking --recurrence full "${SIZE_ARGS[@]}" --threads 1 --run-dir "$RUN"
for task in completion memory; do
    cp "$RUN/state-tracking-$task.png" "figures/headline-$task.png"
done
cp "$RUN/summary.json" figures/headline.json
# the recirculation run's own figure (probe, flip rate and logit shift per depth)
cp "$RUN"/recirculation-*/state-tracking-completion.png figures/state-tracking-completion.png
cp "$RUN"/recirculation-*/summary.json figures/state-tracking-completion.json
