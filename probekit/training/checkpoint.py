"""Latent-feedback checkpoints: the one place trainers save and consumers load from.

A checkpoint is a folder (``<run>/checkpoint/`` of ``probekit train-feedback``)::

    config.json            format, mode, step, the model it belongs to (name, content hash,
                           d_model, n_blocks, source), the gate (d_model, feed: which top
                           state it feeds back; absent in older checkpoints = "normed"),
                           the resolved TrainConfig, the organism shape, AdamW's param groups
    model.safetensors      the gate (``gate.*``) and, with ``--ahead-loss``, the training-only
                           head of that loss (``ahead.*``)
    optimizer.safetensors  AdamW moments (for resuming)
    training.safetensors   with ``--ema``, once averaging has begun: the last weights
                           (``gate.*``, ``model.*``, ``ahead.*``), from which training
                           resumes; the organism and gate above then hold their average
    history.json           per-step losses and validations
    organism/              organism mode: an ordinary Hugging Face folder (load_model reads it)

Consumers (``probekit run state-tracking --mechanism latent-feedback``,
``probekit feedback-stability``, benchmarks, notebooks) call :func:`load_checkpoint`;
the trainer calls :func:`save_checkpoint` and, to resume, :func:`restore_training`. A
gate only fits the weights it was trained with, so a checkpoint is refused by a model of
another ``d_model`` or content hash, with the fix in the message.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from probekit.mechanisms.latent_feedback import FEEDS, FeedbackGate, check_gate
from probekit.runs import write_json
from probekit.training.config import TrainConfig

FORMAT = "probekit-feedback-checkpoint"


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

    @property
    def mode(self) -> str:
        return str(self.config["mode"])


def model_identity(model) -> dict:
    return {"name": model.name, "content_hash": model.content_hash, "d_model": model.d_model,
            "n_blocks": model.n_blocks, "source": model.source}


# ------------------------------------------------------------------------- save
def _write_safetensors(path: Path, tensors: dict[str, Tensor], step: int) -> None:
    """Atomically, with the training step in the header: a checkpoint whose files hold
    different steps was interrupted while saving (:func:`check_checkpoint` refuses it)."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp),
              metadata={"step": str(step)})
    os.replace(tmp, path)


def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, Tensor], list]:
    sd = opt.state_dict()
    tensors = {f"state.{i}.{k}": v if isinstance(v, Tensor) else torch.tensor(v)
               for i, st in sd["state"].items() for k, v in st.items()}
    return tensors, sd["param_groups"]


STEP_FILE = "probekit-step.json"  # the training step of an organism folder
TRAINING_WEIGHTS = "training.safetensors"  # the last weights when the saved ones average them


def _save_organism(folder: Path, model, step: int) -> None:
    """Replace ``folder/organism`` by the model's current weights (swap, then delete)."""
    from probekit.core.models import content_hash
    from probekit.training.organism import save_organism

    tmp = folder / ".organism.tmp"
    save_organism(tmp, model.hf_model, model.tokenizer)
    write_json(tmp / STEP_FILE, {"step": step})
    if (folder / "organism").exists():
        os.replace(folder / "organism", folder / ".organism.old")
    os.replace(tmp, folder / "organism")
    shutil.rmtree(folder / ".organism.old", ignore_errors=True)
    model.content_hash = content_hash(model.hf_model)  # the weights changed in training


def save_checkpoint(folder: str | Path, *, gate: FeedbackGate, model, config: TrainConfig,
                    step: int, optimizer: torch.optim.Optimizer | None = None,
                    history: list | None = None, organism_config: dict | None = None,
                    ahead: torch.nn.Module | None = None,
                    training_weights: dict[str, Tensor] | None = None) -> Path:
    """Write a checkpoint folder (module docstring). Files are replaced one by one
    atomically, ``config.json`` last, so a reader never sees a newer config than weights.
    ``training_weights``: the weights training resumes from, by trainable name, when the
    modules hold their ``--ema`` average."""
    folder = Path(folder)
    config = config.resolved()
    if gate.feed != config.feed:
        raise ValueError(f"the gate feeds back the {gate.feed} state but the config says "
                         f"--feed {config.feed}; build the gate with feed={config.feed!r}")
    folder.mkdir(parents=True, exist_ok=True)
    if config.mode == "organism":
        _save_organism(folder, model, step)
    tensors = {f"gate.{k}": v for k, v in gate.state_dict().items()}
    if ahead is not None:
        tensors.update({f"ahead.{k}": v for k, v in ahead.state_dict().items()})
    _write_safetensors(folder / "model.safetensors", tensors, step)
    groups: list = []
    if optimizer is not None:
        tensors, groups = _optimizer_tensors(optimizer)
        _write_safetensors(folder / "optimizer.safetensors", tensors, step)
    if training_weights is not None:
        _write_safetensors(folder / TRAINING_WEIGHTS, training_weights, step)
    else:
        (folder / TRAINING_WEIGHTS).unlink(missing_ok=True)
    if history is not None:
        write_json(folder / "history.json", history)
    identity = model_identity(model)
    if config.mode == "organism":  # the model to name in messages: the saved organism
        identity["name"] = str(folder / "organism")
    write_json(folder / "config.json", {
        "format": FORMAT, "version": 1, "mode": config.mode, "step": step,
        "model": identity, "gate": {"d_model": gate.d_model, "feed": gate.feed},
        "train": asdict(config), "organism": organism_config, "optimizer_param_groups": groups,
    })
    return folder


# ------------------------------------------------------------------------- load
#: config.json keys every consumer reads (``model`` and ``gate`` are objects)
REQUIRED = {"mode": None, "step": None, "model": ("name", "content_hash", "d_model"),
            "gate": ("d_model",)}
DAMAGED = "the checkpoint is damaged: restore it or train it again"


def read_checkpoint_config(path: str | Path) -> dict:
    """The ``config.json`` of a checkpoint folder, checked to be one with every key
    consumers read (ValueError naming the file and what is wrong)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(
            f"no feedback checkpoint at {path}: expected a folder with config.json and "
            f"model.safetensors written by `probekit train-feedback`"
        )
    try:
        cfg = json.loads(cfg_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file} is not valid JSON ({e}); {DAMAGED}") from None
    if not isinstance(cfg, dict) or cfg.get("format") != FORMAT:
        raise ValueError(f"{cfg_file} is not a probekit feedback checkpoint (format {FORMAT!r})")
    for key, inner in REQUIRED.items():
        if key not in cfg or (inner and not isinstance(cfg[key], dict)):
            raise ValueError(f"{cfg_file} lacks {key!r}; {DAMAGED}")
        missing = [k for k in inner or () if k not in cfg[key]]
        if missing:
            raise ValueError(f"{cfg_file} lacks {key}.{missing[0]}; {DAMAGED}")
    if cfg["mode"] not in ("gate", "organism"):
        raise ValueError(f"{cfg_file} has mode {cfg['mode']!r}, not gate or organism; {DAMAGED}")
    if gate_feed(cfg) not in FEEDS:
        raise ValueError(f"{cfg_file} has gate.feed {gate_feed(cfg)!r}, not one of "
                         f"{', '.join(FEEDS)}; {DAMAGED}")
    return cfg


def gate_feed(cfg: dict) -> str:
    """Which top state a checkpoint's gate feeds back; checkpoints from before the
    choice existed have no ``gate.feed`` and fed back the normed state."""
    return cfg["gate"].get("feed", "normed")


def check_checkpoint(path: str | Path) -> dict:
    """:func:`read_checkpoint_config`, then the cheap checks of the files a load reads,
    without loading weights: each safetensors header is whole (a truncated or random file
    fails here). ValueError names the damaged file."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    cfg = read_checkpoint_config(path)
    weights = [path / "model.safetensors"]
    if cfg["mode"] == "organism":
        weights.append(path / "organism" / "model.safetensors")
    steps = {}
    for f in weights:
        if not f.is_file():
            raise ValueError(f"{f} is missing; {DAMAGED}")
        try:
            with safe_open(str(f), framework="pt") as st:
                st.keys()
                steps[f] = (st.metadata() or {}).get("step")
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{f} is not a readable safetensors file ({e}); {DAMAGED}") from None
    for extra in ("optimizer.safetensors", TRAINING_WEIGHTS):
        if (path / extra).is_file():
            with safe_open(str(path / extra), framework="pt") as st:
                steps[path / extra] = (st.metadata() or {}).get("step")
    if (path / "organism" / STEP_FILE).is_file():
        steps[path / "organism" / STEP_FILE] = json.loads(
            (path / "organism" / STEP_FILE).read_text()).get("step")
    for f, step in steps.items():  # older checkpoints record no step: nothing to compare
        if step is not None and int(step) != int(cfg["step"]):
            raise ValueError(f"{f} holds step {step} but {path / 'config.json'} says step "
                             f"{cfg['step']} (saving was interrupted); {DAMAGED}")
    return cfg


def read_history(path: str | Path) -> list:
    """The checkpoint's per-step training record (``history.json``; empty if absent)."""
    path = Path(path)
    if not (path / "history.json").is_file():
        return []
    try:
        return json.loads((path / "history.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path / 'history.json'} is not valid JSON ({e}); {DAMAGED}") from None


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


def _load_part(module: torch.nn.Module, path: Path, prefix: str, what: str) -> None:
    """The ``prefix``-named tensors of the checkpoint's ``model.safetensors`` into
    ``module`` (ValueError naming the file if they do not fit it): the gate
    (``gate.``), and the ``--ahead-loss`` head (``ahead.``) when training resumes."""
    from safetensors.torch import load_file

    weights = load_file(str(path / "model.safetensors"))
    try:
        module.load_state_dict({k[len(prefix):]: v for k, v in weights.items()
                                if k.startswith(prefix)})
    except RuntimeError as e:  # missing, unexpected or misshapen tensors
        raise ValueError(f"{path / 'model.safetensors'} does not hold {what} "
                         f"({str(e).splitlines()[0]}); {DAMAGED}") from None


def _load_gate(gate: FeedbackGate, path: Path) -> None:
    """The checkpoint's gate weights into ``gate`` (ValueError naming the file if they
    are not a gate of this size)."""
    _load_part(gate, path, "gate.", "this checkpoint's gate")


def load_checkpoint(path: str | Path, model=None) -> FeedbackCheckpoint:
    """Load a checkpoint folder.

    Organism checkpoints bring their own model (``<path>/organism``); a ``model`` given
    must then be that organism. Gate checkpoints need the model they were trained for:
    ``model`` (checked) or, when None, loaded by the recorded name.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        ValueError: a damaged checkpoint (naming the file), or one that belongs to a model
            of another ``d_model`` or weights.
    """
    from probekit.core.models import load_model

    path = Path(path)
    cfg = check_checkpoint(path)
    history = read_history(path)
    if model is None:
        if cfg["mode"] == "organism":
            model = load_model(str(path / "organism"))
            model.name = str(path / "organism")
        else:
            model = load_model(cfg["model"]["name"])
    check_model_matches(cfg, model, path)
    gate = FeedbackGate(cfg["gate"]["d_model"], feed=gate_feed(cfg))
    _load_gate(gate, path)
    gate.eval()
    check_gate(gate, model)
    return FeedbackCheckpoint(gate, model, cfg, path, history)


def restore_training(path: str | Path, *, gate: FeedbackGate, model, config: TrainConfig,
                     optimizer: torch.optim.Optimizer,
                     ahead: torch.nn.Module | None = None) -> tuple[int, list[dict]]:
    """Load a checkpoint's gate, organism weights (organism mode), ``--ahead-loss`` head
    and optimizer state in place, to resume training; returns ``(step, history)``."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = check_checkpoint(path)
    if cfg["mode"] != config.mode:
        raise ValueError(f"{path} holds a {cfg['mode']}-mode checkpoint, not {config.mode}")
    if gate_feed(cfg) != gate.feed:
        raise ValueError(f"{path} holds a gate that feeds back the {gate_feed(cfg)} state, "
                         f"not {gate.feed}; use --feed {gate_feed(cfg)} or another run dir")
    ema = cfg.get("train", {}).get("ema", 0.0)  # older checkpoints: no average
    if ema != config.ema:
        raise ValueError(f"{path} was trained with --ema {ema}, not {config.ema}: resume it "
                         f"with --ema {ema}, or train into another folder")
    history = read_history(path)
    _load_gate(gate, path)
    if ahead is not None:
        _load_part(ahead, path, "ahead.", "the --ahead-loss head")
    if config.mode == "organism":
        own = load_file(str(path / "organism" / "model.safetensors"))
        missing, unexpected = model.hf_model.load_state_dict(own, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:  # lm_head is tied
            raise ValueError(f"{path}/organism does not fit this organism shape "
                             f"(missing {missing}, unexpected {unexpected})")
    else:
        check_model_matches(cfg, model, path)
    if (path / "optimizer.safetensors").is_file():
        state: dict[int, dict[str, Tensor]] = {}
        for key, v in load_file(str(path / "optimizer.safetensors")).items():
            _, i, k = key.split(".", 2)
            state.setdefault(int(i), {})[k] = v
        optimizer.load_state_dict({"state": state,
                                   "param_groups": cfg["optimizer_param_groups"]})
    return int(cfg["step"]), history


def restore_average(path: str | Path,
                    trainable: list[tuple[str, torch.nn.Parameter]]) -> list[Tensor] | None:
    """After :func:`restore_training`, whose modules then hold an ``--ema`` checkpoint's
    average: that average (in ``trainable``'s order), with the last weights of
    ``training.safetensors`` loaded into the modules to resume from. None, and nothing
    changed, when the checkpoint holds no average."""
    from safetensors.torch import load_file

    path = Path(path) / TRAINING_WEIGHTS
    if not path.is_file():
        return None
    last = load_file(str(path))
    missing = [name for name, _ in trainable if name not in last]
    if missing:
        raise ValueError(f"{path} lacks {missing[0]}; {DAMAGED}")
    average = [p.detach().clone() for _, p in trainable]
    with torch.no_grad():
        for name, p in trainable:
            p.copy_(last[name])
    return average
