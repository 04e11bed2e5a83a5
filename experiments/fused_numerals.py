"""How close the gate brings the completion task's numerals, and whether that closeness
is where the organism misses (docs/latent-feedback.md, "What the gate does to the
numerals").

    python experiments/fused_numerals.py CKPT [CKPT ...] [--null-updates 0]

Each argument is an organism checkpoint folder (what ``organism_checkpoint.py`` prints).
Under ``full`` prefill a numeral's input is not its embedding but Eq. 4's fusion of the
state before it with the embedding (``probekit.training.numerals.fused_numerals``). The
first table compares the numerals 10..99 as embeddings and as fused inputs (cosines over
the 4,005 pairs), and says whether a numeral's input after ``completed =`` is still
nearest to its own input after ``required =`` (of 90 x 90 = 8,100 inputs).

The second table answers every completion row of the 90 numerals (the 90 equal rows
``a/a`` and the 8,010 unequal rows ``a/b``, held-out and trained pairs alike) under each
regime. An equal row is one numeral's, so its misses are named by numeral; a pair's
unequal rows are its own. The AUC says how well each closeness ranks the missed unequal
rows above the answered ones (0.5: not at all): the embeddings' cosine of ``a`` and
``b``, and the fused cosine, that of ``b``'s input after ``required = a`` and
``completed =`` with the input ``a`` would get there (the row that would be equal).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import numpy as np
import tyro

from probekit.commands.common import organisms_problem, regimes_problem, script_error

usage_error = functools.partial(script_error, "fused_numerals")


@dataclasses.dataclass(frozen=True)
class Args:
    checkpoints: tyro.conf.Positional[tuple[Path, ...]] = ()
    """organism checkpoint folders"""
    null_updates: int = 0
    """null updates (distractors) in every row"""
    regimes: tuple[str, ...] = ("none", "full")
    """prefill regimes: none, last-<k>, full or passes=<n>"""


def _problem(args: Args) -> str | None:
    if args.null_updates < 0:
        return f"--null-updates must be >= 0; got {args.null_updates}"
    return regimes_problem(args.regimes) or organisms_problem(args.checkpoints)


def geometry(required, completed, embedding_cos: np.ndarray) -> dict[str, float]:
    """The first table's numbers: pairwise cosines of the numerals as embeddings, as fused
    inputs after ``required =`` and after ``completed =`` (given each required numeral),
    the smallest cosine of a numeral's two inputs, and how many of the 8,100 inputs after
    ``completed =`` are nearest (among the 90 after ``required =``) to their own numeral."""
    import torch

    from probekit.training.numerals import cosines

    n = len(required)
    upper = np.triu_indices(n, 1)
    after_required = cosines(required)[upper]
    after_completed = np.concatenate([c[upper] for c in cosines(completed)])
    unit_r = torch.nn.functional.normalize(required, dim=-1)
    across = (torch.nn.functional.normalize(completed, dim=-1) @ unit_r.T).numpy()  # [a, n, m]
    own = across[:, np.arange(n), np.arange(n)]  # [a, n]
    return {"embedding mean": embedding_cos[upper].mean(),
            "embedding max": embedding_cos[upper].max(),
            "required mean": after_required.mean(), "required max": after_required.max(),
            "completed mean": after_completed.mean(), "completed max": after_completed.max(),
            "own min": own.min(), "nearest own": int((across.argmax(-1) == np.arange(n)).sum())}


def answers(checkpoint: Path, args: Args):
    """Per regime: the numerals whose equal row is missed, the unequal rows missed of all,
    and the AUC of the embedding and the fused cosine for the missed unequal rows."""
    from sklearn.metrics import roc_auc_score

    from probekit.core.engine import StepEngine
    from probekit.training.checkpoint import load_checkpoint
    from probekit.training.numerals import cosines, fused_numerals, numeral_cosines
    from probekit.training.organism import label_predictions
    from synthetic.completion import LABEL_WORDS, NUMERALS, completion_text
    from synthetic.dataset import label_token_ids

    ck = load_checkpoint(checkpoint)
    tok, engine = ck.model.tokenizer, StepEngine(ck.model)
    required, completed = fused_numerals(ck.model, ck.gate)
    emb = numeral_cosines(ck.model)
    fused = cosines(completed)  # fused[a, b, a]: b's input after required = a, against a's
    n = len(NUMERALS)
    pairs = [(a, b) for a in range(n) for b in range(n)]  # indices; equal rows where a == b
    rows = tok([completion_text(NUMERALS[a], NUMERALS[b], scratch=4,
                                distractors=args.null_updates) for a, b in pairs],
               add_special_tokens=False)["input_ids"]
    labels = np.array([LABEL_WORDS.index("done" if a == b else "more") for a, b in pairs])
    equal = np.array([a == b for a, b in pairs])
    a_idx, b_idx = np.array(pairs)[~equal].T
    closeness = {"embedding": emb[a_idx, b_idx], "fused": fused[a_idx, b_idx, a_idx]}
    ids = label_token_ids(tok, LABEL_WORDS)
    out = []
    for regime in args.regimes:
        try:
            wrong = label_predictions(engine, ck.gate, rows, ids, regime) != labels
        except ValueError as e:  # last-k on rows of k tokens or fewer
            raise ValueError(f"--regimes {regime}: {e}") from None
        missed = wrong[~equal]
        auc = {k: (f"{roc_auc_score(missed, v):.2f}" if 0 < missed.sum() < len(missed)
                   else "-") for k, v in closeness.items()}
        equal_missed = [str(NUMERALS[a]) for (a, b), w in zip(pairs, wrong, strict=True)
                        if a == b and w]
        out.append((regime, equal_missed, int(missed.sum()), len(missed), auc))
    return geometry(required, completed, emb), out


def main() -> int:
    args = tyro.cli(Args)
    problem = _problem(args)
    if problem:
        return usage_error(problem)
    results = []
    for ck in args.checkpoints:
        try:
            results.append((ck, *answers(ck, args)))
        except ValueError as e:  # last-k on short rows
            return usage_error(str(e))
    print("| organism | numeral cosine, embeddings: mean / max | fused after `required =` | "
          "fused after `completed =` | one numeral's two inputs: min | nearest its own "
          "(of 8,100) |\n|---|---|---|---|---|---|")
    for ck, g, _ in results:
        print(f"| {ck} | {g['embedding mean']:.2f} / {g['embedding max']:.2f} | "
              f"{g['required mean']:.2f} / {g['required max']:.2f} | "
              f"{g['completed mean']:.2f} / {g['completed max']:.2f} | {g['own min']:.3f} | "
              f"{g['nearest own']:,} |")
    print("\n| organism | regime | equal rows missed (of 90) | unequal rows missed | AUC of "
          "the missed unequal rows: embedding cosine | fused cosine |\n|---|---|---|---|---|---|")
    for ck, _, rows in results:
        for regime, equal_missed, missed, of, auc in rows:
            print(f"| {ck} | {regime} | {len(equal_missed)}"
                  f"{' (' + ', '.join(equal_missed) + ')' if equal_missed else ''} | "
                  f"{missed} of {of:,} | {auc['embedding']} | {auc['fused']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
