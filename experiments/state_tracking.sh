#!/usr/bin/env bash
# State tracking with recirculation on the default model (latent-feedback paper Sec. 4.4,
# Fig. 7, App. F): the headline command. Regenerates figures/state-tracking-completion.png
# and figures/state-tracking-completion.json. Measured on the shared 2-core CPU box with
# --threads 1 under load ~5-6: ~8 min wall (~4 min of CPU); see docs/state-tracking.md.
#
#   experiments/state_tracking.sh            # from the repository root
#   SIZE=small experiments/state_tracking.sh # 32 short examples, a couple of minutes
set -euo pipefail
cd "$(dirname "$0")/.."
PROBEKIT=${PROBEKIT:-probekit}  # run inside the venv (or set PROBEKIT)
if [[ "${SIZE:-full}" == small ]]; then
    SIZE_ARGS=(--examples 32 --distractors 0); RUN=runs/state-tracking-headline-small
else
    SIZE_ARGS=(); RUN=runs/state-tracking-headline
fi
# Defaults: completion task (128 examples: 16 numeral-pair groups x 4 x distractors 0 8),
# regimes none (always added) and full, recirculation s=20 d=10 (the model-relative
# default for 30 blocks) alpha=0.1. Flags: docs/commands/state-tracking.md.
"$PROBEKIT" run state-tracking --recurrence full "${SIZE_ARGS[@]}" --threads 1 --run-dir "$RUN"
cp "$RUN/state-tracking-completion.png" figures/state-tracking-completion.png
cp "$RUN/summary.json" figures/state-tracking-completion.json
