#!/usr/bin/env bash
# The rest of the recirculation studies on Gemma 3 270M (issue 10; docs/gemma3.md), at the
# model-relative rule pair (s, d) = (12, 6) unless said: the paper's four alphas (convex and
# beta = 1) at the rule pair and as (s, d) heatmaps beside the looping baseline, the
# normalisation off (--norm none), a 10-token ramp, temperature against
# recirculation (recirculation paper Sec. 4.4.2), the lag curve and (t, k) map, part-of-
# speech attribution and the state-tracking probes. Sizes fit the 2-core CPU box (one
# thread); every run is resumable and goes to runs/gemma3-*. The perplexity runs use the
# same 12 x 128-token wiki windows as experiments/gemma3_studies.sh (windows 3-11 held out
# from its sweep). Writes figures/gemma3-more.json (every rule-pair perplexity result),
# the sweep and looping heatmaps (gemma3-sweep-alphas, gemma3-sweep-norm-none,
# gemma3-looping), the grid's best cell on held-out windows (gemma3-perplexity-grid-best)
# and the lag, PoS and state-tracking figures, all under figures/gemma3-*. About 45 min.
#
#   experiments/gemma3_more.sh        # from the repository root, after ./setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PROBEKIT=${PROBEKIT:-probekit}
PYTHON=${PYTHON:-python}
M=(--model gemma3-270m --threads 1 --no-progress)
W=(--corpus wiki --windows 12 --window-tokens 128)
RUNS=()

ppl() {  # name, then perplexity flags
    local name=$1; shift
    "$PROBEKIT" perplexity "${M[@]}" "${W[@]}" "$@" --run-dir "runs/gemma3-ppl-$name"
    RUNS+=("$name")
}
for a in 0.04 0.07 0.1 0.16; do
    ppl "alpha$a-convex" --alpha "$a"
    ppl "alpha$a-beta1" --alpha "$a" --beta 1
done
ppl norm-none --alpha 0.1 --norm none
ppl ramp10 --alpha 0.1 --ramp 10
for t in 0.9 1.1 1.2; do                    # both runs at temperature t
    ppl "temperature$t" --alpha 0.1 --beta 1 --temperature "$t"
done
"$PYTHON" - "${RUNS[@]}" <<'PY'
import json, sys
out = {name: json.load(open(f"runs/gemma3-ppl-{name}/summary.json")) for name in sys.argv[1:]}
json.dump(out, open("figures/gemma3-more.json", "w"), indent=1)
print("wrote figures/gemma3-more.json")
PY

# The (s, d) heatmap at the paper's other two alphas (0.04 and 0.1 are in
# experiments/gemma3_studies.sh) beside the looping baseline, and the no-norm scheme at all
# four, on the same tuning windows 0-2 and the same 26 pairs.
"$PROBEKIT" sweep "${M[@]}" --corpus wiki --windows 3 --window-tokens 128 --pairs max-gap \
    --alphas 0.07 0.16 --norms convex beta1 --looping --rows 48 --run-dir runs/gemma3-sweep-alphas
cp runs/gemma3-sweep-alphas/sweep.png figures/gemma3-sweep-alphas.png
cp runs/gemma3-sweep-alphas/looping.png figures/gemma3-looping.png
cp runs/gemma3-sweep-alphas/summary.json figures/gemma3-sweep-alphas.json
"$PROBEKIT" sweep "${M[@]}" --corpus wiki --windows 3 --window-tokens 128 --pairs max-gap \
    --alphas 0.04 0.07 0.1 0.16 --norms none --rows 48 --run-dir runs/gemma3-sweep-norm-none
cp runs/gemma3-sweep-norm-none/sweep.png figures/gemma3-sweep-norm-none.png
cp runs/gemma3-sweep-norm-none/summary.json figures/gemma3-sweep-norm-none.json
# the best cell of the whole tuning grid (26 pairs x 4 alphas x 3 schemes, with
# experiments/gemma3_studies.sh's figures/gemma3-sweep.json) on the held-out windows 3-11
read -r -a BEST < <("$PYTHON" experiments/sweep_best.py figures/gemma3-sweep.json \
    figures/gemma3-sweep-alphas.json figures/gemma3-sweep-norm-none.json)
"$PROBEKIT" perplexity "${M[@]}" "${W[@]}" "${BEST[@]}" --run-dir runs/gemma3-ppl-grid-best
"$PYTHON" experiments/gemma3_heldout.py runs/gemma3-ppl-grid-best 3 \
    figures/gemma3-perplexity-grid-best.json

"$PROBEKIT" lag-analysis "${M[@]}" --alpha 0.1 --corpus wiki --windows 32 --window-tokens 128 \
    --max-lag 32 --positions 0:20 20:95:5 --batch-size 4 --run-dir runs/gemma3-lag
cp runs/gemma3-lag/lag_analysis.png figures/gemma3-lag.png
cp runs/gemma3-lag/summary.json figures/gemma3-lag.json

"$PROBEKIT" setup
"$PROBEKIT" pos-attribution "${M[@]}" --alpha 0.1 --corpus wiki --window-tokens 128 \
    --windows 32 --batch-size 8 --selective none --run-dir runs/gemma3-pos
cp runs/gemma3-pos/pos_attribution.png figures/gemma3-pos.png
cp runs/gemma3-pos/summary.json figures/gemma3-pos.json

"$PROBEKIT" run state-tracking "${M[@]}" --mechanism recirculation --task completion memory \
    --recurrence full --examples 64 --run-dir runs/gemma3-state-tracking
for task in completion memory; do
    cp "runs/gemma3-state-tracking/state-tracking-$task.png" "figures/gemma3-state-tracking-$task.png"
done
cp runs/gemma3-state-tracking/summary.json figures/gemma3-state-tracking.json
