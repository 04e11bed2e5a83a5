#!/usr/bin/env bash
# Recirculation on Gemma 3 270M (issue 10; docs/gemma3.md): the model-relative rule pair,
# a small sweep on a tuning split, and the sweep's best cell on held-out windows.
#
# Sizes for the shared 2-core CPU box (heavily loaded; a 262k-row unembedding per step):
# wiki windows, BOS first, every position recirculated token by token. Windows come in a
# fixed round-robin order over documents (probekit.data.corpora.make_windows): window i is
# the start of document i, so --windows 3 is exactly the first 3 of --windows 12. The
# sweep tunes on windows 0-2 (documents 0-2); windows 3-11 of the 12 x 128-token
# perplexity runs (documents 3-11) are held out. Every step is resumable (rerun the
# script to continue); runs go to runs/gemma3-*. Wall times on the 2-core box when
# quiet: ~1 min per 12 x 128 perplexity run, ~15 min for the sweep. One torch thread: two
# threads on a busy 2-core machine spin in OpenMP barriers and run many times slower.
#
#   experiments/gemma3_studies.sh         # from the repository root, after ./setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PROBEKIT=${PROBEKIT:-probekit}   # run inside the venv (or set PROBEKIT)
PYTHON=${PYTHON:-python}
M=(--model gemma3-270m --threads 1 --no-progress)
C=(--corpus wiki)

# 1. The rule pair (s, d) = (12, 6) at alpha = 0.1: convex (beta = 1 - alpha) and beta = 1.
"$PROBEKIT" perplexity "${M[@]}" "${C[@]}" --windows 12 --window-tokens 128 --alpha 0.1 \
    --run-dir runs/gemma3-ppl-rule-convex
"$PYTHON" experiments/gemma3_heldout.py runs/gemma3-ppl-rule-convex 3 \
    figures/gemma3-perplexity-rule-convex.json
"$PROBEKIT" perplexity "${M[@]}" "${C[@]}" --windows 12 --window-tokens 128 --alpha 0.1 \
    --beta 1 --run-dir runs/gemma3-ppl-rule-beta1
"$PYTHON" experiments/gemma3_heldout.py runs/gemma3-ppl-rule-beta1 3 \
    figures/gemma3-perplexity-rule-beta1.json
# 2. Sweep on the tuning split (3 windows x 128 tokens, documents 0-2): the default grid
#    for 18 blocks (d = 1, 3, ..., s - d = 2, 4, 6, 8: 26 pairs) x alpha {0.04, 0.1} x
#    {convex, beta1}.
"$PROBEKIT" sweep "${M[@]}" "${C[@]}" --windows 3 --window-tokens 128 --pairs max-gap \
    --alphas 0.04 0.1 --norms convex beta1 --rows 48 --run-dir runs/gemma3-sweep-grid
cp runs/gemma3-sweep-grid/sweep.png figures/gemma3-sweep.png
cp runs/gemma3-sweep-grid/summary.json figures/gemma3-sweep.json

# 3. The sweep's best cell on the 12 x 128 windows; the held-out split is windows 3-11.
read -r -a BEST < <("$PYTHON" experiments/sweep_best.py figures/gemma3-sweep.json)
"$PROBEKIT" perplexity "${M[@]}" "${C[@]}" --windows 12 --window-tokens 128 "${BEST[@]}" \
    --run-dir runs/gemma3-ppl-best
"$PYTHON" experiments/gemma3_heldout.py runs/gemma3-ppl-best 3 figures/gemma3-perplexity-best.json
