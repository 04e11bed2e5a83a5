"""``probekit feedback-stability``: many fused passes of a trained gate (Fig. 3;
docs/commands/feedback-stability.md)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

from probekit.commands.common import FLAT, ModelFlags, RunFlags, UsageError, say, set_threads
from probekit.validation import check_fields


@dataclasses.dataclass(frozen=True)
class Config:
    """Loss, state update and label accuracy of a trained gate over many fused Jacobi passes
    (full-bandwidth paper Fig. 3). Guide: docs/commands/feedback-stability.md."""

    checkpoint: Path
    """checkpoint folder written by `probekit train-feedback` (<run dir>/checkpoint)"""
    passes: int = 32
    """fused passes n"""
    windows: int = 4
    """Wikipedia windows (gate checkpoints)"""
    window_tokens: int = 96
    """tokens per window (gate checkpoints; must exceed --passes)"""
    model: Annotated[ModelFlags, FLAT] = ModelFlags()
    run: Annotated[RunFlags, FLAT] = RunFlags()

    def __post_init__(self) -> None:
        check_fields(self)
        if not (self.checkpoint / "config.json").is_file():
            raise UsageError(f"--checkpoint {self.checkpoint} is not a checkpoint folder (no "
                             f"config.json); give <run dir>/checkpoint of `probekit "
                             f"train-feedback`")
        from probekit.training.checkpoint import check_checkpoint

        check_checkpoint(self.checkpoint)  # a damaged file: one line, before any loading
        if self.passes < 1:
            raise UsageError(f"--passes must be >= 1; got {self.passes}")
        if self.windows < 1:
            raise UsageError(f"--windows must be >= 1; got {self.windows}")


def run(config: Config) -> int:
    import torch

    from probekit.analysis.stability import equal_length_rows, stability_curves
    from probekit.core.engine import StepEngine
    from probekit.core.models import DEFAULT_MODEL, load_model
    from probekit.data.corpora import load_corpus, make_windows
    from probekit.plots.stability import plot_stability
    from probekit.runs import RunDir
    from probekit.training.checkpoint import load_checkpoint, read_checkpoint_config
    from probekit.training.organism import probe_rows

    set_threads(config.model)
    mode = read_checkpoint_config(config.checkpoint)["mode"]
    if mode == "gate" and config.window_tokens <= config.passes:
        raise UsageError(f"--window-tokens ({config.window_tokens}) must exceed --passes "
                         f"({config.passes})")
    # --model left at its default: the checkpoint's own model (an organism's, or the one
    # a gate was trained for); any other --model must be the checkpoint's (checked)
    given = config.model.model not in (DEFAULT_MODEL, "default")
    ckpt = load_checkpoint(config.checkpoint, load_model(config.model.model) if given else None)
    model = ckpt.model
    answers = None
    if mode == "organism":  # the probe sets' rows, label included: accuracy per pass too
        ids, answers = equal_length_rows(probe_rows(model.tokenizer), config.passes)
    else:
        windows = make_windows(load_corpus("wiki"), model.tokenizer, config.window_tokens,
                               config.windows, bos=False, max_tokens=model.n_ctx)
        ids = torch.tensor([w.input_ids for w in windows])
    engine = StepEngine(model, config.model.backend)
    run_dir = RunDir.open("feedback-stability", config, model=model,
                          inputs={"checkpoint": config.checkpoint}, path=config.run.run_dir,
                          fresh=config.run.fresh)
    say(f"{len(ids)} sequences x {ids.shape[1]} tokens, {config.passes} passes; "
        f"run dir {run_dir.path}")
    curves = stability_curves(engine, ckpt.gate, ids, config.passes, answer_positions=answers)
    curves["checkpoint"] = {"checkpoint": str(config.checkpoint), "step": ckpt.step,
                            "passes": config.passes, "model_hash": model.content_hash,
                            "seq_len": int(ids.shape[1]), "n_sequences": int(ids.shape[0])}
    run_dir.write_json("summary.json", curves)
    fig = plot_stability(curves, f"{model.name}, checkpoint step {ckpt.step}")
    path = run_dir.save_figure(fig, "stability.png")
    for k in (1, 2, 3, 5, 10, 20, config.passes):
        if k <= config.passes:
            i = k - 1
            extra = (f", label accuracy {curves['answer_accuracy'][i]:.3f}"
                     if "answer_accuracy" in curves else "")
            say(f"pass {k:>3}: loss {curves['loss'][i]:.4f}, relative update "
                f"{curves['relative_update'][i]:.2e}{extra}")
    say(f"wrote {path}")
    return 0
