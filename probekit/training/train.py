"""The latent-feedback training loop: optimizer, schedule, resume (paper Sec. 3.3, App. C).

:func:`train` minimises the multi-pass objective (:mod:`probekit.training.objective`)
with AdamW, linear warm-up and cosine decay to ``--lr-floor`` (default 10%) of the peak
rate; ``--short-first`` steps at the start train on short rows only (a length curriculum),
``--fixed-point-rows long`` draws the fixed-point batches from the long rows only, and
``--close-pairs`` batches of the pairs the organism holds closest replace a step's batch
or, with ``--close-pairs-batch added``, train beside it; ``--ema`` saves and validates an
exponential moving average of the weights (:func:`update_average`) instead of the last
ones, a variance reduction that leaves the training itself as it was (Polyak and Juditsky
1992; the averaged weights of Izmailov et al. 2018, "Averaging Weights Leads to Wider Optima");
``--match-hint`` adds, for the first ``--match-hint-steps`` steps, a decaying loss on where
attention heads look at register lookups (:mod:`probekit.training.match_hint`).
Modes:

- ``gate``: only the gate trains; the pretrained model is frozen. Pass 1 then does not
  depend on any trainable weight, so it runs without gradients, and a one-pass batch
  only records its loss (no optimizer step).
- ``organism``: a small Llama trained from scratch together with its gate on
  synthetic-task text (:mod:`probekit.training.organism`).

Resuming is exact: every step's batch, pass count, mixin and jitter come from a
generator seeded by ``(seed, step)`` (:func:`step_generator`), and the checkpoint
(:mod:`probekit.training.checkpoint`) holds the weights, AdamW's moments and the step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from probekit.mechanisms.latent_feedback import FeedbackGate
from probekit.training.checkpoint import restore_average, restore_training, save_checkpoint
from probekit.training.config import TrainConfig
from probekit.training.data import TrainData
from probekit.training.match_hint import RegisterTokens, hint_weight, match_hint_loss, match_targets
from probekit.training.objective import answer_weights, evaluate, fixed_point_loss, multipass_loss


def final_validation(history: list[dict]) -> list[float] | None:
    """The last validation losses by pass in a training ``history`` (None if none ran)."""
    return next((h["val_pass_losses"] for h in reversed(history) if "val_pass_losses" in h),
                None)


def training_seconds(history: list[dict], default: float = 0.0) -> float:
    """Training time recorded in ``history`` (all runs of a resumed training together)."""
    return history[-1]["time"] if history else default


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator of one step's data, pass count, mixin and jitter (resume-exact)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def draw_passes(schedule: tuple[float, ...], generator: torch.Generator) -> int:
    """A pass count ``K >= 1`` with ``P(K = k) = schedule[k-1]``."""
    return int(torch.multinomial(torch.tensor(schedule), 1, generator=generator)) + 1


def warmup_cosine(step: int, peak: float, warmup: int, steps: int, floor: float = 0.1) -> float:
    """Linear warm-up to ``peak``, then cosine decay to ``floor * peak`` at ``steps``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def lr_at(step: int, config: TrainConfig) -> float:
    """The learning rate of ``step``: ``warmup_cosine`` with the config's rate, steps and
    floor."""
    return warmup_cosine(step, config.lr, config.warmup, config.steps, config.lr_floor)


def ahead_head(hf_model, seed: int) -> torch.nn.Linear:
    """The head of ``--ahead-loss`` (:func:`probekit.training.objective.ahead_loss`): a
    linear map from the top state to the vocabulary, initialised like the organism's
    weights (normal, std 0.02) from its own generator, so that it leaves every other
    random stream of the training alone. It is used in training only."""
    head = torch.nn.Linear(hf_model.config.hidden_size, hf_model.config.vocab_size, bias=False)
    with torch.no_grad():
        head.weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(seed + 7919))
    return head


Trainable = list[tuple[str, torch.nn.Parameter]]  # (name, parameter): what trains


def make_optimizer(params: Trainable, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only."""
    decay = [p for n, p in params if p.ndim >= 2]
    rest = [p for n, p in params if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay},
         {"params": rest, "weight_decay": 0.0}],
        lr=config.lr, betas=(0.9, 0.95),
    )


def update_average(average: list[torch.Tensor] | None, trainable: Trainable,
                   decay: float) -> list[torch.Tensor]:
    """``average <- decay * average + (1 - decay) * weights``; the first call (``average``
    None) starts the average at the weights."""
    weights = [p.detach() for _, p in trainable]
    if average is None:
        return [w.clone() for w in weights]
    for a, w in zip(average, weights, strict=True):
        a.lerp_(w, 1 - decay)
    return average


def _load(trainable: Trainable, weights: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for (_, p), w in zip(trainable, weights, strict=True):
            p.copy_(w)


@contextmanager
def holding_average(trainable: Trainable,
                    average: list[torch.Tensor] | None) -> Iterator[dict | None]:
    """Inside the block the modules hold ``average`` (so that validation and the
    checkpoint see it), after it their own weights again; yields those by name. Without
    an average, nothing changes and it yields None."""
    if average is None:
        yield None
        return
    own = {name: p.detach().clone() for name, p in trainable}
    _load(trainable, average)
    try:
        yield own
    finally:
        _load(trainable, list(own.values()))


def _validate(hf, gate: FeedbackGate, data: TrainData, config: TrainConfig) -> dict:
    """Validation metrics by pass, with the modules back in their training mode after."""
    hf.eval()
    gate.eval()
    val = evaluate(hf, gate, data.val, max(3, config.max_passes), groups=data.val_tasks)
    hf.train(config.mode == "organism")
    gate.train()
    out = {"val_pass_losses": val["loss"], "val_last_token_accuracy": val["last_token_accuracy"]}
    if "group_accuracy" in val:
        out["val_task_accuracy"] = val["group_accuracy"]
    return out


def _loss(hf, gate, ids, valid, K, config: TrainConfig, generator, head):
    """The step's loss on one batch and its per-pass losses: ``K`` Jacobi passes
    (:func:`multipass_loss`), or ``"full"``, the exact full-recurrence state fed back
    through one pass (:func:`fixed_point_loss`)."""
    weights = answer_weights(valid, config.answer_weight)
    kw = dict(lam=config.lam, mixin=config.mixin, jitter=config.jitter, generator=generator,
              ahead_head=head, ahead=config.ahead_loss)
    if K == "full":
        return fixed_point_loss(hf, gate, ids, weights, **kw)[:2]
    return multipass_loss(hf, gate, ids, weights, K,
                          first_pass_grad=config.mode == "organism", **kw)[:2]


def train(
    model,
    gate: FeedbackGate,
    data: TrainData,
    config: TrainConfig,
    checkpoint_dir: str | Path,
    *,
    organism_config: dict | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> list[dict]:
    """Train (or resume training) and checkpoint into ``checkpoint_dir``; returns history.

    In organism mode every model parameter trains; in gate mode only the gate's. With
    ``--ema`` the modules end holding the average, as the checkpoint does. ``log``
    receives one line on resuming and one per validation."""
    from tqdm.auto import tqdm

    config = config.resolved()
    log = log or (lambda line: None)
    ckpt = Path(checkpoint_dir)
    hf = model.hf_model
    trainable = [(f"gate.{n}", p) for n, p in gate.named_parameters()]
    if config.mode == "organism":
        hf.requires_grad_(True)
        trainable += [(f"model.{n}", p) for n, p in hf.named_parameters()]
    else:
        hf.requires_grad_(False)
    head = ahead_head(hf, config.seed) if config.ahead_loss else None
    if head is not None:
        trainable += [(f"ahead.{n}", p) for n, p in head.named_parameters()]
    if config.short_first and not data.n_short:
        raise ValueError(f"--short-first draws rows of at most {data.short_len} tokens (the "
                         f"validation rows' length) and the training rows have none; "
                         f"train on 0-8 null updates too, or drop --short-first")
    if config.close_pairs and data.close_rows is None:
        raise ValueError("--close-pairs draws the organism's completion rows, and these "
                         "training rows have none; train on the completion task, or drop it")
    if config.fixed_point_rows == "long" and data.n_short == len(data.train):
        raise ValueError(f"--fixed-point-rows long draws rows longer than {data.short_len} "
                         f"tokens (the validation rows' length) and the training rows have "
                         f"none; train on 16-256 null updates too, or drop --fixed-point-rows")
    lookups = RegisterTokens.of(model.tokenizer) if config.match_hint else None
    opt = make_optimizer(trainable, config)
    start, history, average = 0, [], None
    if (ckpt / "config.json").is_file():
        start, history = restore_training(ckpt, gate=gate, model=model, config=config,
                                          optimizer=opt, ahead=head)
        average = restore_average(ckpt, trainable)
        log(f"resuming from {ckpt} at step {start}")

    if start == 0 and config.eval_every:  # where training starts from, for the curves
        history.append({"step": 0, **_validate(hf, gate, data, config), "time": 0.0})
    hf.train(config.mode == "organism")
    gate.train()
    bar = tqdm(range(start, config.steps), desc=f"train-feedback ({config.mode})", unit="step",
               initial=start, total=config.steps, disable=not progress)
    t0, t_done = time.time(), (history[-1]["time"] if history else 0.0)
    for step in bar:
        g = step_generator(config.seed, step)
        short = step < config.short_first
        ids, valid = data.batch(config.batch_size, g, "short" if short else "all")
        K = draw_passes(config.schedule, g) if step >= config.feedback_start else 1
        # drawn only when asked for, so that other recipes keep their random stream
        fixed = (config.fixed_point > 0 and step >= config.feedback_start
                 and float(torch.rand((), generator=g)) < config.fixed_point)
        if fixed and config.fixed_point_rows == "long" and not short:  # a second draw,
            ids, valid = data.batch(config.batch_size, g, "long")  # after the others'
        close = (config.close_pairs > 0 and step >= config.feedback_start and not short
                 and float(torch.rand((), generator=g)) < config.close_pairs)  # likewise
        if close and config.close_pairs_batch == "instead":
            ids, valid = data.close_batch(model, config.batch_size, g, config.close_pairs_rows)
        lr = lr_at(step, config)
        for group in opt.param_groups:
            group["lr"] = lr
        K = "full" if fixed else K
        total, losses = _loss(hf, gate, ids, valid, K, config, g, head)
        extra = {}
        hint = hint_weight(step, config.match_hint, config.match_hint_steps)
        if hint:  # on the plain pass; no random draw, so every stream stays as it was
            hint_loss = match_hint_loss(hf, ids, match_targets(ids, lookups),
                                        config.match_hint_parts)
            total = total + hint * hint_loss
            extra["match_hint_loss"] = hint_loss.item()
        if total.requires_grad:  # gate mode, K = 1: nothing trainable in the loss
            opt.zero_grad(set_to_none=True)
            total.backward()
            if close and config.close_pairs_batch == "added":  # drawn after the step's own
                close_ids, close_valid = data.close_batch(  # draws; the gradients add up
                    model, config.batch_size, g, config.close_pairs_rows)
                close_loss, _ = _loss(hf, gate, close_ids, close_valid, K, config, g, head)
                close_loss.backward()
                extra["close_loss"] = close_loss.item()
            if config.grad_clip:
                torch.nn.utils.clip_grad_norm_([p for _, p in trainable], config.grad_clip)
            opt.step()
        if config.ema and step >= config.feedback_start:
            average = update_average(average, trainable, config.ema)
        entry = {"step": step + 1, "passes": K, "lr": lr, "loss": total.item(),
                 "pass_losses": [v.item() for v in losses], **extra,
                 "time": t_done + time.time() - t0}
        done = step + 1 == config.steps
        if (config.eval_every and (step + 1) % config.eval_every == 0) or done:
            with holding_average(trainable, average):
                entry.update(_validate(hf, gate, data, config))
            log(f"step {step + 1}: val loss by pass " + " ".join(
                f"{v:.4f}" for v in entry["val_pass_losses"]) + "; last-token accuracy by pass "
                + " ".join(f"{v:.3f}" for v in entry["val_last_token_accuracy"])
                + "".join(f"; {task} " + " ".join(f"{v:.3f}" for v in acc)
                          for task, acc in entry.get("val_task_accuracy", {}).items()))
        history.append(entry)
        bar.set_postfix(loss=f"{total.item():.3f}", K=K)
        if (step + 1) % config.save_every == 0 or done:
            with holding_average(trainable, average) as last:
                save_checkpoint(ckpt, gate=gate, model=model, config=config, step=step + 1,
                                optimizer=opt, history=history,
                                organism_config=organism_config, ahead=head,
                                training_weights=last)
    bar.close()
    if average is not None:  # the trained model is the average, as the checkpoint says
        _load(trainable, average)
    hf.eval()
    gate.eval()
    hf.requires_grad_(False)
    return history
