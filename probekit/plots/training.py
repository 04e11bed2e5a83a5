"""Loss curves of latent-feedback training (``probekit train-feedback``'s loss_curves.png)."""

from __future__ import annotations


def plot_history(history: list[dict], title: str = ""):
    """Training loss per pass (EMA over the batches that ran that pass) and validation
    loss per Jacobi pass, against the step; ``history`` as :func:`probekit.training.train.
    train` returns it."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    train_steps = [h for h in history if "pass_losses" in h]
    n = max((len(h["pass_losses"]) for h in train_steps), default=1)
    for k in range(n):
        xs, ys, ema = [], [], None
        for h in train_steps:
            if len(h["pass_losses"]) > k:
                v = h["pass_losses"][k]
                ema = v if ema is None else 0.95 * ema + 0.05 * v
                xs.append(h["step"])
                ys.append(ema)
        axes[0].plot(xs, ys, label=f"pass {k + 1}")
    axes[0].set(xlabel="step", ylabel="train loss (EMA)", yscale="log",
                title="training loss by pass (answer-weighted)")
    axes[0].legend()
    val = [h for h in history if "val_pass_losses" in h]
    if val:
        m = len(val[0]["val_pass_losses"])
        for k in range(m):
            axes[1].plot([h["step"] for h in val], [h["val_pass_losses"][k] for h in val],
                         marker="o", label=f"pass {k + 1}")
        axes[1].legend()
    axes[1].set(xlabel="step", ylabel="validation loss", yscale="log",
                title="validation loss by Jacobi pass")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
