"""Print the `probekit perplexity` flags of the best cell over one or more sweep summaries
(the lowest `best.percent_change`), so a script can rerun it on other windows.

    read -r -a BEST < <(python experiments/sweep_best.py figures/gemma3-sweep.json ...)
    probekit perplexity "${BEST[@]}" ...
"""

import json
import sys

#: The perplexity flags of each sweep scheme (docs/definitions.md "Sweep cell").
SCHEME_FLAGS = {"convex": [], "beta1": ["--beta", "1"], "none": ["--norm", "none"]}


def main() -> None:
    cells = [json.load(open(path))["best"] for path in sys.argv[1:]]
    b = min(cells, key=lambda c: c["percent_change"])
    print(" ".join(["--source", str(b["source"]), "--destination", str(b["destination"]),
                    "--alpha", str(b["alpha"]), *SCHEME_FLAGS[b["scheme"]]]))


if __name__ == "__main__":
    main()
