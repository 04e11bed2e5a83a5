"""Loss curves of latent-feedback training (``probekit train-feedback``'s loss_curves.png)."""

from __future__ import annotations


def plot_history(history: list[dict], title: str = ""):
    """Training loss per pass (EMA over the batches that ran that pass; fixed-point
    batches' fed pass is its own curve) and validation loss per Jacobi pass, against the
    step; ``history`` as :func:`probekit.training.train.train` returns it."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    curves: dict[str, tuple[list[int], list[float]]] = {}
    for h in (h for h in history if "pass_losses" in h):
        # a fixed-point batch (--fixed-point) has the plain pass and the fed one
        labels = (["pass 1", "fixed point"] if h.get("passes") == "full" else
                  [f"pass {k + 1}" for k in range(len(h["pass_losses"]))])
        for label, v in zip(labels, h["pass_losses"], strict=True):
            xs, ys = curves.setdefault(label, ([], []))
            xs.append(h["step"])
            ys.append(v if not ys else 0.95 * ys[-1] + 0.05 * v)  # EMA
    for label in sorted(curves, key=lambda k: (k == "fixed point", k)):
        axes[0].plot(*curves[label], label=label)
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
