"""Split a perplexity run's windows into the tuning split and the held-out rest.

    python experiments/gemma3_heldout.py RUN_DIR TUNING_WINDOWS OUT.json

Reads RUN_DIR/token_log_probs.npz (written by ``probekit perplexity``) and writes, for
windows ``< TUNING_WINDOWS`` and for the others, the pooled % perplexity change with its
window bootstrap interval (probekit.analysis.perplexity.PerplexitySummary).
"""

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from probekit.analysis.perplexity import PerplexitySummary


def main() -> None:
    run_dir, tuning, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    data = np.load(run_dir / "token_log_probs.npz")
    identity = json.loads((run_dir / "config.json").read_text())
    result = {"run_dir": str(run_dir), **identity}
    for name, rows in (("tuning", slice(0, tuning)), ("held_out", slice(tuning, None))):
        s = PerplexitySummary.from_log_probs(data["base"][rows], data["rec"][rows])
        d = dataclasses.asdict(s)
        offset = rows.start
        for w in d["per_window"]:
            w["window"] += offset
        result[name] = d
    out.write_text(json.dumps(result, indent=1))
    for name in ("tuning", "held_out"):
        r = result[name]
        print(f"{name}: {r['n_windows']} windows, ppl {r['ppl_base']:.3f} -> {r['ppl_rec']:.3f}, "
              f"{r['pct_change']:+.2f}% [{r['ci_low']:+.2f}, {r['ci_high']:+.2f}]")


if __name__ == "__main__":
    main()
