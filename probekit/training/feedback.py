"""Training latent feedback: the multi-pass objective (full-bandwidth paper Sec. 3.3, App. C).

    probekit train-feedback --mode organism --threads 1          # the model organism, ~minutes
    probekit train-feedback --mode gate --steps 200               # a gate on frozen SmolLM2

One training step (App. C, Fig. 9) on a batch of token ids ``x`` ``[B, T]``::

    K ~ schedule                           # passes this batch, e.g. 75% 1, 22% 2, 3% 3
                                           # (K = 1 before --feedback-start)
    e = embed(x);  h(1) = model(e)         # pass 1: the plain model
    for k = 2 .. K:
        s = shift_right(h(k-1) + U[-sigma, sigma])      # jitter on the carried state
        u = gate(s, e)                                  # Eq. 4 (position 0 stays e_0)
        u[t <= p] = e[t <= p]                           # prefix mixin, random p per row
        h(k) = model(u)
    loss = NTP(h(1)) + lambda / (K-1) * sum_k NTP(h(k))  # Eq. 12

``h`` is the top state after the final norm (the choice of
:mod:`probekit.mechanisms.latent_feedback`); gradients are **not** detached between passes, so
later passes' losses reach earlier passes' states. Each pass is one parallel forward
of the Hugging Face model with ``inputs_embeds``: the differentiable twin of the
engine's ``passes=n`` regime (``tests/test_latent_feedback.py`` pins that both give
the same logits).

Modes:

- ``gate``: only the gate trains; the pretrained model (default SmolLM2-135M) is
  frozen. Pass 1 then does not depend on any trainable weight, so it runs without
  gradients, and a one-pass batch only records its loss (no optimizer step).
- ``organism``: a small Llama trained from scratch together with its gate on
  synthetic-task text (:mod:`probekit.training.organism`).

Choices where the paper is silent: prefix mixin applies to a row with probability
``mixin`` (default 0.5) with ``p`` uniform over the row's positions, drawn anew for
every pass; the jitter ``sigma`` is absolute, in units of the final-normed state;
AdamW with linear warm-up and cosine decay to 10%.

Checkpoints (``<run>/checkpoint/``): ``config.json`` (format, mode, model name, content
hash, ``d_model``, ``n_blocks``, hyperparameters, step), ``model.safetensors`` (the gate,
``gate.*``), ``optimizer.safetensors`` (AdamW moments), ``history.json`` (per-step
losses), and in organism mode ``organism/`` (a Hugging Face folder that
``probekit.load_model`` reads). A later run with the same configuration resumes from
it: same step count, optimizer state and data order (every step's batch and pass
count are drawn from a generator seeded by ``(seed, step)``). A checkpoint is only
accepted by a model with the same ``d_model`` and content hash (:func:`load_checkpoint`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from probekit.mechanisms.latent_feedback import FeedbackGate, check_gate

FORMAT = "probekit-feedback-checkpoint"
MODES = ("gate", "organism")


# ------------------------------------------------------------------------ config
@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of :func:`train` (validated at construction).

    Args:
        mode: ``"gate"`` (frozen pretrained model) or ``"organism"``.
        steps: optimizer steps in total (a resumed run continues up to this count).
        batch_size: sequences per step.
        seq_len: tokens per sequence (gate mode; organism sequences are whole examples).
        lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay (matrices only).
        warmup: linear warm-up steps.
        lam: ``lambda`` of Eq. 12 (paper: 1).
        schedule: probability of 1, 2, 3, ... passes per batch (paper: 0.75/0.22/0.03).
        feedback_start: steps before this one use a single pass (the plain objective);
            the paper introduces feedback passes mid-training (Sec. 3.3, "When to
            introduce feedback passes").
        mixin: probability that a row gets a random plain prefix in passes > 1.
        jitter: ``sigma`` of the uniform noise on the carried state (Eq. 13).
        grad_clip: gradient-norm clip (0: none).
        answer_weight: loss weight of each row's last target (organism mode: the label
            word; 1 = the paper's plain next-token loss). A task's label is one token in
            ~70, so a larger weight makes the organism learn its tasks within minutes.
        eval_every: steps between validation evaluations (0: only at the end).
        save_every: steps between checkpoints.
        seed: seeds initialisation, data order and pass counts.
    """

    mode: str = "organism"
    steps: int = 1500
    batch_size: int = 32
    seq_len: int = 128
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup: int = 100
    lam: float = 1.0
    schedule: tuple[float, ...] = (0.75, 0.22, 0.03)
    feedback_start: int = 0
    mixin: float = 0.5
    jitter: float = 0.02
    grad_clip: float = 1.0
    answer_weight: float = 1.0
    eval_every: int = 250
    save_every: int = 250
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}; got {self.mode!r}")
        for name in ("steps", "batch_size", "seq_len", "save_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer; got {v!r}")
        for name in ("warmup", "eval_every", "seed", "feedback_start"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0; got {v!r}")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (one next-token target); got {self.seq_len}")
        sched = tuple(float(p) for p in self.schedule)
        if not sched or any(p < 0 for p in sched) or abs(sum(sched) - 1) > 1e-6:
            raise ValueError(
                f"schedule must be probabilities of 1, 2, 3, ... passes summing to 1 "
                f"(e.g. 0.75,0.22,0.03); got {self.schedule}"
            )
        object.__setattr__(self, "schedule", sched)
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0; got {self.lr}")
        if self.lam < 0 or self.weight_decay < 0 or self.grad_clip < 0 or self.jitter < 0:
            raise ValueError("lam, weight_decay, grad_clip and jitter must be >= 0")
        if not self.answer_weight > 0:
            raise ValueError(f"answer_weight must be > 0; got {self.answer_weight}")
        if not 0 <= self.mixin <= 1:
            raise ValueError(f"mixin must lie in [0, 1]; got {self.mixin}")

    @property
    def max_passes(self) -> int:
        return len(self.schedule)


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator of one step's data, pass count, mixin and jitter (resume-exact)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def draw_passes(schedule: tuple[float, ...], generator: torch.Generator) -> int:
    """A pass count ``K >= 1`` with ``P(K = k) = schedule[k-1]``."""
    return int(torch.multinomial(torch.tensor(schedule), 1, generator=generator)) + 1


# ----------------------------------------------------------------- the objective
def token_loss(logits: Tensor, ids: Tensor, valid: Tensor) -> Tensor:
    """Weighted mean next-token cross-entropy; ``valid`` ``[B, T-1]`` is a bool mask or
    float weights of the targets."""
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(),
                         reduction="none").view_as(valid)
    w = valid.float()
    return (ce * w).sum() / w.sum().clamp_min(1e-12)


def answer_weights(valid: Tensor, weight: float) -> Tensor:
    """``valid`` as float weights with each row's last target weighted ``weight``."""
    w = valid.float()
    if weight != 1.0:
        last = valid.sum(1) - 1
        w[torch.arange(len(w)), last] = weight
    return w


def multipass_loss(
    hf_model,
    gate: FeedbackGate,
    ids: Tensor,
    valid: Tensor,
    n_passes: int,
    *,
    lam: float = 1.0,
    mixin: float = 0.0,
    jitter: float = 0.0,
    generator: torch.Generator | None = None,
    first_pass_grad: bool = True,
    return_logits: bool = False,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """Eq. 12 on one batch (module docstring).

    Args:
        ids: ``[B, T]`` token ids (right-padded; causal attention keeps padding out).
        valid: ``[B, T-1]`` bool (which next-token targets count) or float weights.
        n_passes: ``K``.
        first_pass_grad: False when nothing trainable feeds pass 1 (gate mode).

    Returns:
        ``(total, per-pass losses, per-pass logits if return_logits else [])``.
    """
    inner = hf_model.model
    e = inner.embed_tokens(ids)
    B, T, _ = e.shape
    positions = torch.arange(T)
    x = e
    losses: list[Tensor] = []
    all_logits: list[Tensor] = []
    for k in range(n_passes):
        grad = first_pass_grad or k > 0
        with contextlib.nullcontext() if grad else torch.no_grad():
            h = inner(inputs_embeds=x, use_cache=False).last_hidden_state  # after final norm
            logits = hf_model.lm_head(h)
            losses.append(token_loss(logits, ids, valid))
        if return_logits:
            all_logits.append(logits)
        if k == n_passes - 1:
            break
        if jitter > 0:
            noise = torch.rand(h.shape, generator=generator, dtype=h.dtype) * 2 - 1
            h = h + jitter * noise
        prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)  # shift right
        fused = gate(prev, e)
        prefix = torch.zeros(B, dtype=torch.long)  # positions t <= prefix stay plain
        if mixin > 0:
            use = torch.rand(B, generator=generator) < mixin
            p = torch.randint(0, T, (B,), generator=generator)
            prefix = torch.where(use, p, prefix)
        on = positions[None, :] > prefix[:, None]
        x = torch.where(on[..., None], fused, e)
    total = losses[0]
    if n_passes > 1:
        total = total + lam / (n_passes - 1) * sum(losses[1:])
    return total, losses, all_logits


@torch.no_grad()
def evaluate(hf_model, gate: FeedbackGate, batches: list[tuple[Tensor, Tensor]],
             n_passes: int) -> dict[str, list[float]]:
    """Validation metrics of each Jacobi pass 1..n (no mixin, no jitter): ``loss`` (mean
    next-token loss) and ``last_token_accuracy`` (argmax at each row's last target, which
    for task rows is the label word)."""
    sums, hits = np.zeros(n_passes), np.zeros(n_passes)
    count = rows = 0
    for ids, valid in batches:
        _, losses, logits = multipass_loss(hf_model, gate, ids, valid, n_passes,
                                           return_logits=True)
        n = float(valid.sum())
        sums += np.array([v.item() for v in losses]) * n
        count += n
        last = valid.sum(1)  # each row's last target is ids[last]
        b = torch.arange(len(ids))
        for k, lg in enumerate(logits):
            hits[k] += int((lg[b, last - 1].argmax(-1) == ids[b, last]).sum())
        rows += len(ids)
    return {"loss": (sums / max(count, 1)).tolist(),
            "last_token_accuracy": (hits / max(rows, 1)).tolist()}


# ------------------------------------------------------------------ checkpoints
@dataclass
class FeedbackCheckpoint:
    """A loaded checkpoint: the gate, the model it belongs to, and its config."""

    gate: FeedbackGate
    model: Any
    config: dict
    path: Path
    history: list = field(default_factory=list)

    @property
    def step(self) -> int:
        return int(self.config["step"])


def model_identity(model) -> dict:
    return {"name": model.name, "content_hash": model.content_hash, "d_model": model.d_model,
            "n_blocks": model.n_blocks, "source": model.source}


def _write_safetensors(path: Path, tensors: dict[str, Tensor]) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, Tensor], list]:
    sd = opt.state_dict()
    tensors = {f"state.{i}.{k}": v if isinstance(v, Tensor) else torch.tensor(v)
               for i, st in sd["state"].items() for k, v in st.items()}
    return tensors, sd["param_groups"]


def _load_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, Tensor], groups: list) -> None:
    state: dict[int, dict[str, Tensor]] = {}
    for key, v in tensors.items():
        _, i, k = key.split(".", 2)
        state.setdefault(int(i), {})[k] = v
    opt.load_state_dict({"state": state, "param_groups": groups})


def save_checkpoint(folder: str | Path, *, gate: FeedbackGate, model, config: TrainConfig,
                    step: int, optimizer: torch.optim.Optimizer | None = None,
                    history: list | None = None, organism_config: dict | None = None) -> Path:
    """Write a checkpoint folder (module docstring). Files are replaced one by one
    atomically, ``config.json`` last, so a reader never sees a newer config than weights."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    from probekit.runs import write_json

    if config.mode == "organism":
        from probekit.core.models import _content_hash
        from probekit.training.organism import save_organism

        tmp = folder / ".organism.tmp"
        save_organism(tmp, model.hf_model, model.tokenizer)
        if (folder / "organism").exists():
            os.replace(folder / "organism", folder / ".organism.old")
        os.replace(tmp, folder / "organism")
        import shutil

        shutil.rmtree(folder / ".organism.old", ignore_errors=True)
        model.content_hash = _content_hash(model.hf_model)
    _write_safetensors(folder / "model.safetensors",
                       {f"gate.{k}": v for k, v in gate.state_dict().items()})
    groups: list = []
    if optimizer is not None:
        tensors, groups = _optimizer_tensors(optimizer)
        _write_safetensors(folder / "optimizer.safetensors", tensors)
    if history is not None:
        write_json(folder / "history.json", history)
    identity = model_identity(model)
    if config.mode == "organism":  # the model to name in messages: the saved organism
        identity["name"] = str(folder / "organism")
    write_json(folder / "config.json", {
        "format": FORMAT, "version": 1, "mode": config.mode, "step": step,
        "model": identity, "gate": {"d_model": gate.d_model}, "train": asdict(config),
        "organism": organism_config, "optimizer_param_groups": groups,
    })
    return folder


def read_checkpoint_config(path: str | Path) -> dict:
    """The ``config.json`` of a checkpoint folder, checked to be one."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(
            f"no feedback checkpoint at {path}: expected a folder with config.json and "
            f"model.safetensors written by `probekit train-feedback`"
        )
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("format") != FORMAT:
        raise ValueError(f"{cfg_file} is not a probekit feedback checkpoint (format {FORMAT!r})")
    return cfg


def check_model_matches(cfg: dict, model, path: Path) -> None:
    """Reject a checkpoint trained for another model (d_model first, then weights)."""
    want = cfg["model"]
    if want["d_model"] != model.d_model:
        raise ValueError(
            f"checkpoint {path} holds a gate for d_model {want['d_model']} (model "
            f"{want['name']!r}); the model in use, {model.name!r}, has d_model {model.d_model}. "
            f"Use --model {want['name']} or a checkpoint trained for this model"
        )
    if want["content_hash"] != model.content_hash:
        raise ValueError(
            f"checkpoint {path} was trained for model {want['name']!r} with content hash "
            f"{want['content_hash']}; the model in use, {model.name!r}, has content hash "
            f"{model.content_hash}. A gate only fits the weights it was trained with: use "
            f"--model {want['name']} or a checkpoint trained for this model"
        )


def load_checkpoint(path: str | Path, model=None) -> FeedbackCheckpoint:
    """Load a checkpoint folder.

    Organism checkpoints bring their own model (``<path>/organism``); a ``model`` given
    must then be that organism. Gate checkpoints need the model they were trained for:
    ``model`` (checked) or, when None, loaded by the recorded name.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        ValueError: the checkpoint belongs to a model of another ``d_model`` or weights.
    """
    from safetensors.torch import load_file

    from probekit.core.models import load_model

    path = Path(path)
    cfg = read_checkpoint_config(path)
    if cfg["mode"] == "organism":
        own = load_model(str(path / "organism"))
        own.name = str(path / "organism")
        if model is not None:
            check_model_matches(cfg, model, path)
            own = model
        else:
            check_model_matches(cfg, own, path)
        model = own
    else:
        if model is None:
            model = load_model(cfg["model"]["name"])
        check_model_matches(cfg, model, path)
    gate = FeedbackGate(cfg["gate"]["d_model"])
    weights = load_file(str(path / "model.safetensors"))
    gate.load_state_dict({k[len("gate."):]: v for k, v in weights.items() if k.startswith("gate.")})
    gate.eval()
    check_gate(gate, model)
    history = []
    if (path / "history.json").is_file():
        history = json.loads((path / "history.json").read_text())
    return FeedbackCheckpoint(gate, model, cfg, path, history)


# ---------------------------------------------------------------------- training
def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr / 10`` at ``steps``."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    frac = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def make_optimizer(params: list[tuple[str, torch.nn.Parameter]],
                   config: TrainConfig) -> torch.optim.AdamW:
    decay = [p for n, p in params if p.ndim >= 2]
    rest = [p for n, p in params if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay},
         {"params": rest, "weight_decay": 0.0}],
        lr=config.lr, betas=(0.9, 0.95),
    )


def pad_batch(rows: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad ``rows`` -> (``[B, T]`` ids, ``[B, T-1]`` valid next-token targets)."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) for r in rows])
    valid = torch.arange(1, T)[None, :] < lengths[:, None]
    return ids, valid


@dataclass
class TrainData:
    """Where batches come from: ``train`` rows sampled per step, fixed ``val`` batches."""

    train: list[list[int]]
    val: list[tuple[Tensor, Tensor]]
    pad_id: int
    description: dict = field(default_factory=dict)
    #: draw each batch from rows of similar length (variable-length rows: less padding)
    bucket: bool = False

    def __post_init__(self) -> None:
        self._by_length = sorted(range(len(self.train)), key=lambda i: len(self.train[i]))

    def batch(self, size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        if self.bucket:  # `size` neighbours in length order, from a random start
            start = int(torch.randint(0, max(1, len(self.train) - size + 1), (1,),
                                      generator=generator))
            idx = self._by_length[start: start + size]
        else:
            idx = torch.randint(0, len(self.train), (size,), generator=generator).tolist()
        return pad_batch([self.train[i] for i in idx], self.pad_id)


def train(
    model,
    gate: FeedbackGate,
    data: TrainData,
    config: TrainConfig,
    checkpoint_dir: str | Path,
    *,
    organism_config: dict | None = None,
    progress: bool = True,
    log=print,
) -> list[dict]:
    """Train (or resume training) and checkpoint into ``checkpoint_dir``; returns history.

    In organism mode every model parameter trains; in gate mode only the gate's."""
    from tqdm.auto import tqdm

    ckpt = Path(checkpoint_dir)
    hf = model.hf_model
    trainable = [(f"gate.{n}", p) for n, p in gate.named_parameters()]
    if config.mode == "organism":
        hf.requires_grad_(True)
        trainable += [(f"model.{n}", p) for n, p in hf.named_parameters()]
    else:
        hf.requires_grad_(False)
    opt = make_optimizer(trainable, config)
    start, history = 0, []
    if (ckpt / "config.json").is_file():  # resume
        from safetensors.torch import load_file

        cfg = read_checkpoint_config(ckpt)
        if cfg["mode"] != config.mode:
            raise ValueError(f"{ckpt} holds a {cfg['mode']}-mode checkpoint, not {config.mode}")
        weights = load_file(str(ckpt / "model.safetensors"))
        gate.load_state_dict({k[5:]: v for k, v in weights.items() if k.startswith("gate.")})
        if config.mode == "organism":
            own = load_file(str(ckpt / "organism" / "model.safetensors"))
            missing, unexpected = hf.load_state_dict(own, strict=False)
            if unexpected or set(missing) - {"lm_head.weight"}:  # lm_head is tied
                raise ValueError(f"{ckpt}/organism does not fit this organism shape "
                                 f"(missing {missing}, unexpected {unexpected})")
        else:
            check_model_matches(cfg, model, ckpt)
        if (ckpt / "optimizer.safetensors").is_file():
            _load_optimizer(opt, load_file(str(ckpt / "optimizer.safetensors")),
                            cfg["optimizer_param_groups"])
        start = int(cfg["step"])
        history = json.loads((ckpt / "history.json").read_text())
        log(f"resuming from {ckpt} at step {start}")

    def save(step: int) -> None:
        save_checkpoint(ckpt, gate=gate, model=model, config=config, step=step, optimizer=opt,
                        history=history, organism_config=organism_config)

    if start == 0 and config.eval_every:  # where training starts from, for the curves
        val = evaluate(hf, gate, data.val, max(3, config.max_passes))
        history.append({"step": 0, "val_pass_losses": val["loss"],
                        "val_last_token_accuracy": val["last_token_accuracy"], "time": 0.0})
    hf.train(config.mode == "organism")
    gate.train()
    bar = tqdm(range(start, config.steps), desc=f"train-feedback ({config.mode})", unit="step",
               initial=start, total=config.steps, disable=not progress)
    t0, t_done = time.time(), (history[-1]["time"] if history else 0.0)
    for step in bar:
        g = step_generator(config.seed, step)
        ids, valid = data.batch(config.batch_size, g)
        K = draw_passes(config.schedule, g) if step >= config.feedback_start else 1
        lr = lr_at(step, config)
        for group in opt.param_groups:
            group["lr"] = lr
        weights = answer_weights(valid, config.answer_weight)
        total, losses, _ = multipass_loss(
            hf, gate, ids, weights, K, lam=config.lam, mixin=config.mixin,
            jitter=config.jitter, generator=g, first_pass_grad=config.mode == "organism",
        )
        if total.requires_grad:  # gate mode, K = 1: nothing trainable in the loss
            opt.zero_grad(set_to_none=True)
            total.backward()
            if config.grad_clip:
                torch.nn.utils.clip_grad_norm_([p for _, p in trainable], config.grad_clip)
            opt.step()
        entry = {"step": step + 1, "passes": K, "lr": lr, "loss": total.item(),
                 "pass_losses": [v.item() for v in losses], "time": t_done + time.time() - t0}
        done = step + 1 == config.steps
        if (config.eval_every and (step + 1) % config.eval_every == 0) or done:
            hf.eval()
            gate.eval()
            val = evaluate(hf, gate, data.val, max(3, config.max_passes))
            entry["val_pass_losses"] = val["loss"]
            entry["val_last_token_accuracy"] = val["last_token_accuracy"]
            hf.train(config.mode == "organism")
            gate.train()
            bar.write(f"step {step + 1}: val loss by pass " + " ".join(
                f"{v:.4f}" for v in val["loss"]) + "; last-token accuracy by pass " + " ".join(
                f"{v:.3f}" for v in val["last_token_accuracy"]))
        history.append(entry)
        bar.set_postfix(loss=f"{total.item():.3f}", K=K)
        if (step + 1) % config.save_every == 0 or done:
            save(step + 1)
    bar.close()
    hf.eval()
    gate.eval()
    hf.requires_grad_(False)
    return history


def plot_history(history: list[dict], title: str = ""):
    """Loss curves per pass (EMA over the batches that ran that pass) and validation."""
    import matplotlib

    matplotlib.use("Agg")
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


# -------------------------------------------------------------------------- data
def gate_data(model, config: TrainConfig, *, n_windows: int = 2048,
              val_windows: int = 16) -> TrainData:
    """Wikipedia windows of ``seq_len`` tokens; the last ``val_windows`` are held out."""
    from probekit.data.corpora import load_corpus, make_windows

    docs, chars = [], 0
    need = 8 * (n_windows + val_windows) * config.seq_len  # chars; ~4 per token, 2x spare
    for doc in load_corpus("wiki"):  # tokenize only as much text as the windows need
        docs.append(doc)
        chars += len(doc.text)
        if chars >= need:
            break
    windows = make_windows(docs, model.tokenizer, config.seq_len, None, bos=False,
                           max_tokens=model.n_ctx)
    if len(windows) < val_windows + 1:
        raise ValueError(f"the corpus has only {len(windows)} windows of {config.seq_len} tokens")
    rows = [w.input_ids for w in windows]
    train_rows, val_rows = rows[: -val_windows][:n_windows], rows[-val_windows:]
    val = [pad_batch(val_rows[i: i + 8], 0) for i in range(0, len(val_rows), 8)]
    return TrainData(train_rows, val, pad_id=0,
                     description={"corpus": "wiki", "train_windows": len(train_rows),
                                  "val_windows": len(val_rows), "seq_len": config.seq_len})


def organism_data(tokenizer, *, tasks, n_examples: int, seed: int,
                  distractors=None) -> TrainData:
    """Task inputs + label words (:func:`probekit.training.organism.training_examples`); the
    validation batches are the default probe sets with their labels."""
    from probekit.training.organism import probe_sets, training_examples

    kw = {} if distractors is None else {"distractors": tuple(distractors)}
    rows = training_examples(tokenizer, tasks, n_examples=n_examples, seed=seed + 1, **kw)
    pad = tokenizer.pad_token_id
    val_rows: list[list[int]] = []
    for name, data in probe_sets(tokenizer).items():
        if name in tasks:
            texts = [ex.text + " " + ex.label for ex in data.examples]
            val_rows += tokenizer(texts, add_special_tokens=False)["input_ids"]
    val_rows.sort(key=len)  # similar lengths per batch: less padding
    val = [pad_batch(val_rows[i: i + 32], pad) for i in range(0, len(val_rows), 32)]
    return TrainData(rows, val, pad_id=pad, bucket=True,
                     description={"tasks": list(tasks), "train_examples": len(rows),
                                  "val_examples": len(val_rows)})


def new_organism(organism_config, seed: int):
    """A fresh organism as a :class:`probekit.LoadedModel` (tokenizer fitted to the tasks)."""
    from probekit.core.models import LoadedModel, _content_hash
    from probekit.training.organism import build_organism, fit_tokenizer

    tok = fit_tokenizer()
    hf = build_organism(tok, organism_config, seed=seed)
    return LoadedModel(hf, tok, "organism", organism_config.n_blocks, organism_config.d_model,
                       organism_config.n_ctx, _content_hash(hf), f"organism:random:{seed}")


# --------------------------------------------------------------------------- CLI
MODE_DEFAULTS = {
    "gate": dict(steps=200, batch_size=4, lr=1e-3, warmup=20, eval_every=50, save_every=25,
                 answer_weight=1.0, feedback_start=0),
    "organism": dict(steps=1600, batch_size=32, lr=3e-3, warmup=100, eval_every=200,
                     save_every=100, answer_weight=20.0, feedback_start=600),
}


def add_cli(sub) -> None:
    import argparse

    from probekit.commands.main import add_model_args, add_run_args

    p = sub.add_parser("train-feedback", help="train a latent-feedback gate (or organism)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=MODES, default="gate",
                   help="gate: the gate alone on a frozen pretrained --model (default); "
                        "organism: a small Llama trained from scratch on synthetic tasks")
    add_model_args(p)
    g = p.add_argument_group("objective (paper Sec. 3.3, App. C)")
    g.add_argument("--lam", type=float, default=1.0, help="lambda of Eq. 12 (default 1)")
    g.add_argument("--schedule", default="0.75,0.22,0.03",
                   help="probabilities of 1,2,3,... passes per batch (default 0.75,0.22,0.03)")
    g.add_argument("--feedback-start", type=int,
                   help="train with one pass only before this step (gate 0, organism 600)")
    g.add_argument("--mixin", type=float, default=0.5,
                   help="probability of a random plain prefix per row in passes > 1")
    g.add_argument("--jitter", type=float, default=0.02, help="sigma of the state jitter")
    o = p.add_argument_group("optimisation (defaults depend on --mode)")
    o.add_argument("--steps", type=int, help="total optimizer steps (gate 200, organism 1600)")
    o.add_argument("--batch-size", type=int, help="sequences per step (gate 4, organism 32)")
    o.add_argument("--seq-len", type=int, default=128, help="tokens per window (gate mode)")
    o.add_argument("--lr", type=float, help="peak learning rate (gate 1e-3, organism 3e-3)")
    o.add_argument("--weight-decay", type=float, default=0.01)
    o.add_argument("--warmup", type=int, help="warm-up steps (gate 20, organism 100)")
    o.add_argument("--grad-clip", type=float, default=1.0)
    o.add_argument("--answer-weight", type=float,
                   help="loss weight of each sequence's last token: the label word in organism "
                        "mode (gate 1 = the paper's plain loss, organism 20)")
    o.add_argument("--eval-every", type=int, help="steps between validations")
    o.add_argument("--save-every", type=int, help="steps between checkpoints")
    o.add_argument("--seed", type=int, default=0)
    d = p.add_argument_group("data")
    d.add_argument("--n-windows", type=int, default=2048, help="training windows (gate mode)")
    d.add_argument("--tasks", default="completion,memory", help="organism training tasks")
    d.add_argument("--n-examples", type=int, default=12000, help="organism training examples")
    m = p.add_argument_group("organism shape")
    m.add_argument("--n-blocks", type=int, default=4)
    m.add_argument("--d-model", type=int, default=128)
    m.add_argument("--n-heads", type=int, default=4)
    m.add_argument("--d-mlp", type=int, default=512)
    add_run_args(p)
    p.set_defaults(func=run_cli)


def config_from_args(args) -> TrainConfig:
    defaults = MODE_DEFAULTS[args.mode]

    def pick(name):
        v = getattr(args, name)
        return defaults[name] if v is None else v

    try:
        schedule = tuple(float(x) for x in str(args.schedule).split(","))
    except ValueError:
        raise ValueError(
            f"--schedule must be comma-separated probabilities; got {args.schedule!r}"
        ) from None
    return TrainConfig(
        mode=args.mode, steps=pick("steps"), batch_size=pick("batch_size"), seq_len=args.seq_len,
        lr=pick("lr"), weight_decay=args.weight_decay, warmup=pick("warmup"), lam=args.lam,
        schedule=schedule, mixin=args.mixin, jitter=args.jitter, grad_clip=args.grad_clip,
        answer_weight=pick("answer_weight"), feedback_start=pick("feedback_start"),
        eval_every=pick("eval_every"), save_every=pick("save_every"), seed=args.seed,
    )


def run_cli(args) -> int:
    import shutil

    from probekit.core.models import load_model
    from probekit.runs import RunDir
    from probekit.training.organism import OrganismConfig

    config = config_from_args(args)  # validates before anything is loaded
    organism_config = None
    tasks = tuple(t for t in args.tasks.split(",") if t)
    if config.mode == "organism":
        organism_config = OrganismConfig(args.n_blocks, args.d_model, args.n_heads, args.d_mlp)
        if args.n_examples < config.batch_size:
            raise ValueError(f"--n-examples must be >= --batch-size; got {args.n_examples}")
    # steps / eval / save cadence do not change what a step computes: a run with more
    # --steps resumes the same folder and continues.
    hashed = {k: v for k, v in asdict(config).items()
              if k not in ("steps", "eval_every", "save_every")}
    run_config = {"train": hashed}
    if config.mode == "organism":
        run_config.update(organism=asdict(organism_config), tasks=list(tasks),
                          n_examples=args.n_examples)
        model = new_organism(organism_config, config.seed)
    else:
        model = load_model(args.model)
        run_config.update(model=args.model, model_hash=model.content_hash,
                          n_windows=args.n_windows)
    run = RunDir.open("train-feedback", run_config, model=model if config.mode == "gate" else None,
                      path=args.run_dir, fresh=args.fresh)
    ckpt = run.path / "checkpoint"
    if args.fresh and ckpt.exists():
        shutil.rmtree(ckpt)
    if config.mode == "organism":
        data = organism_data(model.tokenizer, tasks=tasks, n_examples=args.n_examples,
                             seed=config.seed)
    else:
        data = gate_data(model, config, n_windows=args.n_windows)
    gate = FeedbackGate.for_model(model)
    print(f"train-feedback ({config.mode}): model {model.name} ({model.n_blocks} blocks, "
          f"d_model {model.d_model}); data {data.description}; run dir {run.path}")
    t0 = time.time()
    history = train(model, gate, data, config, ckpt, organism_config=(
        asdict(organism_config) if organism_config else None), progress=not args.no_progress,
        log=print)
    elapsed = time.time() - t0
    fig = plot_history(history, f"train-feedback ({config.mode}, {model.name})")
    run.save_figure(fig, "loss_curves.png")
    summary = {"steps": config.steps, "seconds_this_run": elapsed,
               "train_seconds_total": history[-1]["time"] if history else 0.0,
               "final_val_pass_losses": next((h["val_pass_losses"] for h in reversed(history)
                                              if "val_pass_losses" in h), None),
               "checkpoint": str(ckpt), "data": data.description}
    if config.mode == "organism":
        from probekit.training.organism import task_accuracy

        loaded = load_checkpoint(ckpt)
        summary["task_accuracy"] = task_accuracy(loaded.model, loaded.gate, tasks)
        print("task accuracy (label at the final colon):", json.dumps(summary["task_accuracy"]))
    run.write_json("summary.json", summary)
    print(f"final validation loss by pass: {summary['final_val_pass_losses']}")
    print(f"checkpoint: {ckpt}  (use --checkpoint {ckpt})")
    return 0
