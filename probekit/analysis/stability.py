"""Stability of the learned feedback map under many fused passes (full-bandwidth paper Fig. 3).

    probekit feedback-stability --checkpoint runs/train-feedback-<hash>/checkpoint --passes 32

The paper checks whether latent feedback stays well behaved far beyond the 2-3 passes
seen in training by iterating fused prefill passes (Eqs. 9-11) and plotting, against
the pass number ``k``, (left) the validation loss of pass ``k`` and (right) the size of
the update ``||h(k) - h(k-1)||`` of the top-layer states. A stable map keeps the loss
flat and the update decaying to a small plateau (a contraction toward a fixed point);
an unstable one shows rising loss and oscillating updates.

Measured here with the engine's own ``passes=n`` regime (one run with ``n`` passes;
:class:`probekit.mechanisms.latent_feedback.LatentFeedback`'s ``on_pass`` callback sees every pass),
on sequences of ``T`` tokens:

- ``loss[k]``: mean next-token loss of pass ``k`` (``k = 1`` is the plain model);
- ``update[k]`` (``k >= 2``): mean over positions of ``||h_t(k) - h_t(k-1)||_2`` and the
  same divided by the mean ``||h_t(k)||`` (``relative_update``). Pass ``k`` makes
  positions ``< k`` exact, so their update is exactly 0 from then on; to keep that
  trivial convergence out of the curve the mean is taken over positions
  ``t >= n`` only (never exact within the run), which needs ``T > n``.

Data: for an organism checkpoint, the longest rows of its probe sets (completion,
memory with 0 or 8 null updates, label words appended: the 67-token delayed-memory
rows), also reporting the label accuracy of every pass; for a gate checkpoint,
Wikipedia windows of the model's tokens.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch
from torch import Tensor

from probekit.core.engine import Step, StepEngine
from probekit.mechanisms.latent_feedback import FeedbackGate, LatentFeedback


@torch.no_grad()
def stability_curves(
    engine: StepEngine,
    gate: FeedbackGate,
    input_ids: Tensor,
    n_passes: int,
    *,
    answer_positions: Tensor | None = None,
) -> dict[str, Any]:
    """Per-pass loss and state update of ``n_passes`` Jacobi passes over ``input_ids``.

    Args:
        input_ids: ``[batch, T]`` equal-length rows with ``T > n_passes``.
        answer_positions: ``[batch]`` optional position whose next token is the answer
            (a task's label); adds ``answer_accuracy[k]``.

    Returns:
        dict with lists indexed by pass ``k - 1``: ``loss``, ``update``,
        ``relative_update`` (NaN at ``k = 1``), and ``answer_accuracy`` if asked.
    """
    ids = torch.as_tensor(input_ids)
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, T]; got shape {tuple(ids.shape)}")
    T = ids.shape[1]
    if not isinstance(n_passes, int) or n_passes < 1:
        raise ValueError(f"n_passes must be an integer >= 1; got {n_passes!r}")
    if T <= n_passes:
        raise ValueError(
            f"sequences of {T} tokens are exact after {T} passes; use sequences longer than "
            f"--passes {n_passes} (or fewer passes)"
        )
    lm_head = engine.model.hf_model.lm_head
    targets = ids[:, 1:]
    loss, update, relative, accuracy = [], [], [], []
    previous: list[Tensor] = []

    def on_pass(j: int, step: Step, h: Tensor) -> None:
        logits = lm_head(h).float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, targets[..., None])[..., 0]
        loss.append(float(-lp.mean()))
        if answer_positions is not None:
            b = torch.arange(len(ids))
            pred = logits[b, answer_positions].argmax(-1)
            accuracy.append(float((pred == ids[b, answer_positions + 1]).float().mean()))
        tail = h[:, n_passes:]
        if previous:
            diff = (tail - previous[0]).norm(dim=-1).mean()
            update.append(float(diff))
            relative.append(float(diff / tail.norm(dim=-1).mean()))
        else:
            update.append(float("nan"))
            relative.append(float("nan"))
        previous[:] = [tail]

    rec = LatentFeedback(gate, engine.model, passes=n_passes, on_pass=on_pass)
    engine.run(ids, rec, block_size=T)
    out = {"passes": list(range(1, n_passes + 1)), "loss": loss, "update": update,
           "relative_update": relative, "seq_len": T, "n_sequences": len(ids)}
    if answer_positions is not None:
        out["answer_accuracy"] = accuracy
    return out


def plot_stability(curves: dict[str, Any], title: str = ""):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = np.array(curves["passes"])
    ncols = 3 if "answer_accuracy" in curves else 2
    fig, axes = plt.subplots(1, ncols, figsize=(4.2 * ncols, 3.4))
    axes[0].plot(k, curves["loss"], marker=".")
    axes[0].set(xlabel="fused passes k", ylabel="loss of pass k", title="validation loss")
    axes[1].plot(k[1:], curves["relative_update"][1:], marker=".")
    axes[1].set(xlabel="fused passes k", ylabel="||h(k) - h(k-1)|| / ||h(k)||", yscale="log",
                title="state update (positions >= n)")
    if ncols == 3:
        axes[2].plot(k, curves["answer_accuracy"], marker=".")
        axes[2].set(xlabel="fused passes k", ylabel="accuracy", ylim=(0, 1.02),
                    title="label accuracy at the colon")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def organism_sequences(tokenizer, n_min: int) -> tuple[Tensor, Tensor]:
    """Equal-length probe-set rows (input + label) of the longest length that at least 16
    rows of the completion/memory probe sets share, and the position predicting each label
    (the measured positions ``t >= n`` should be most of the sequence)."""
    from probekit.training.organism import probe_sets

    rows: list[list[int]] = []
    for data in probe_sets(tokenizer).values():
        texts = [ex.text + " " + ex.label for ex in data.examples]
        rows += tokenizer(texts, add_special_tokens=False)["input_ids"]
    lengths = np.array([len(r) for r in rows])
    values, counts = np.unique(lengths, return_counts=True)
    values = values[counts >= 16]
    if not values.size or values.max() <= n_min:
        raise ValueError(f"no 16 probe sequences are longer than {n_min} tokens; use fewer "
                         f"--passes")
    T = int(values.max())
    keep = [r for r in rows if len(r) == T]
    return torch.tensor(keep), torch.full((len(keep),), T - 2)


# --------------------------------------------------------------------------- CLI
def add_cli(sub) -> None:
    from probekit.commands.main import add_model_args, add_run_args

    p = sub.add_parser("feedback-stability",
                       help="loss and state update over many fused passes (Fig. 3)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="folder from `probekit train-feedback`")
    p.add_argument("--passes", type=int, default=32, help="fused passes (default 32)")
    p.add_argument("--windows", type=int, default=4, help="text windows (gate checkpoints)")
    p.add_argument("--window-tokens", type=int, default=96,
                   help="tokens per window (gate checkpoints; must exceed --passes)")
    add_model_args(p)
    add_run_args(p)
    p.set_defaults(func=run_cli)


def run_cli(args) -> int:
    from probekit.mechanisms.latent_feedback import LatentFeedbackMechanism
    from probekit.runs import RunDir
    from probekit.training.feedback import read_checkpoint_config

    if args.passes < 1:
        raise ValueError(f"--passes must be >= 1; got {args.passes}")
    cfg = read_checkpoint_config(args.checkpoint)
    model = LatentFeedbackMechanism.load_model(args)
    mech = LatentFeedbackMechanism.from_args(args, model)
    engine = StepEngine(model, args.backend)
    answers = None
    if cfg["mode"] == "organism":
        ids, answers = organism_sequences(model.tokenizer, args.passes)
    else:
        from probekit.data.corpora import load_corpus, make_windows

        if args.window_tokens <= args.passes:
            raise ValueError(f"--window-tokens must exceed --passes ({args.passes})")
        windows = make_windows(load_corpus("wiki"), model.tokenizer, args.window_tokens,
                               args.windows, bos=False, max_tokens=model.n_ctx)
        ids = torch.tensor([w.input_ids for w in windows])
    config = {"checkpoint": str(args.checkpoint), "step": mech.step, "passes": args.passes,
              "model_hash": model.content_hash, "seq_len": int(ids.shape[1]),
              "n_sequences": int(ids.shape[0])}
    run = RunDir.open("feedback-stability", config, model=model, path=args.run_dir,
                      fresh=args.fresh)
    print(f"{len(ids)} sequences x {ids.shape[1]} tokens, {args.passes} passes; run dir {run.path}")
    curves = stability_curves(engine, mech.gate, ids, args.passes, answer_positions=answers)
    curves["checkpoint"] = config
    run.write_json("summary.json", curves)
    fig = plot_stability(curves, f"{model.name}, checkpoint step {mech.step}")
    path = run.save_figure(fig, "stability.png")
    for k in (1, 2, 3, 5, 10, 20, args.passes):
        if k <= args.passes:
            i = k - 1
            extra = (f", label accuracy {curves['answer_accuracy'][i]:.3f}"
                     if "answer_accuracy" in curves else "")
            print(f"pass {k:>3}: loss {curves['loss'][i]:.4f}, relative update "
                  f"{curves['relative_update'][i]:.2e}{extra}")
    print(f"wrote {path}")
    return 0
