"""Where a register organism stands: its accuracy per register count and writes per
register (plain pass, no null updates, no reads; fresh training-style rows), beside the
accuracy of the shortcut "answer the latest write, whatever the register".

The shortcut is right when the last assignment wrote the queried register (1/m) and by
luck otherwise: 1/m + (1 - 1/m)/2. An organism at that line has learned recency, not
which register was asked for (docs/latent-feedback.md, Fig. 7b).

    python experiments/register_shapes.py --seed 0 --steps 4000
    python experiments/register_shapes.py --checkpoint path/to/checkpoint
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import tyro

from probekit.training.organism_cache import Recipe, organism_folder

SHAPES = ((1, 1), (1, 2), (1, 4), (1, 16), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (4, 4),
          (8, 1), (8, 2), (8, 4))


@dataclasses.dataclass(frozen=True)
class Args:
    seed: int = 0
    """the register organism's training seed (cache recipe: --tasks registers)"""
    steps: int = 4000
    """its training steps"""
    checkpoint: Path | None = None
    """a checkpoint folder instead of the cached organism"""
    rows: int = 128
    """rows per shape"""


def main() -> int:
    args = tyro.cli(Args)
    from probekit.core.engine import StepEngine
    from probekit.training.checkpoint import load_checkpoint
    from probekit.training.organism import label_accuracy
    from synthetic.dataset import label_token_ids
    from synthetic.registers import LABEL_WORDS, training_examples

    if args.rows < 1:
        print(f"register_shapes: error: --rows must be >= 1; got {args.rows}", file=sys.stderr)
        return 2
    ckpt = args.checkpoint or organism_folder(
        Recipe.default(args.seed, tasks=("registers",), steps=args.steps)) / "checkpoint"
    if not (ckpt / "config.json").is_file():
        print(f"register_shapes: error: no checkpoint at {ckpt}; train it first "
              f"(experiments/organism_checkpoint.py --tasks registers) or pass --checkpoint",
              file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    loaded = load_checkpoint(ckpt)
    tok = loaded.model.tokenizer
    engine = StepEngine(loaded.model)
    label_ids = label_token_ids(tok, LABEL_WORDS)
    print(f"{ckpt}\n  m  writes  accuracy  shortcut")
    for m, w in SHAPES:
        rows = training_examples(args.rows, seed=10_000 + m * 100 + w, register_counts=(m,),
                                 writes=(w,), distractors=(0,), read_rows=0.0)
        ids = tok([e.text for e in rows], add_special_tokens=False)["input_ids"]
        acc = label_accuracy(engine, loaded.gate, ids, [e.label_id for e in rows], label_ids)
        print(f"{m:3d} {w:6d} {acc:9.2f} {1 / m + (1 - 1 / m) / 2:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
