"""Latent feedback: fuse the previous top-layer state into the next input (full-bandwidth).

Implements ``papers/latent-feedback-full-bandwidth-transformer.md`` Sec. 3.1 (Eq. 4),
Sec. 3.3 (Eqs. 8-11, the Jacobi passes), App. C (the normalisation) and the prefill
regimes of Sec. 4.1 / 4.4 / App. F, as ``SEMANTICS.md`` "Latent feedback" pins them.

The gate (:class:`FeedbackGate`, Eq. 4 with App. C's norms)::

    u_t = RMSNorm_u( (W_U h_{t-1}) * sigmoid(W_G RMSNorm_e(e_t)) )        W_U, W_G in R^{D x D}

``h_{t-1}`` is the previous position's top-layer state **after the model's final norm**
(the vector the unembedding reads). That is the one fixed choice SEMANTICS.md asks
for; reasons: its scale is bounded whatever the depth (the paper's "stationary
hidden-state scale", Sec. 3.3), the training jitter ``sigma`` is then in a meaningful
unit, and with tied embeddings it already lives in the embedding basis (the paper's
"shared input basis"), which the identity initialisation of ``W_U`` below relies on.
(Before vs after the norm only differs by the norm's per-dimension weight, which
``W_U`` could absorb, because ``RMSNorm_u`` removes any overall scale.)

Position 0, and every position where feedback is off, gets the plain embedding.

Initialisation: ``W_U = I`` and ``W_G = I``, and ``RMSNorm_u``'s weight starts at the
per-dimension RMS of the model's embedding matrix (:meth:`FeedbackGate.for_model`), so
a fused input has the scale of an ordinary token embedding instead of RMS 1 (SmolLM2's
embeddings have RMS ~0.14). With ``W_U = I`` the value pathway starts as the state the
model just used to predict this very token (with tied weights it points toward the
predicted token's embedding), gated by the token's own normalised embedding. That is
as harmless as Eq. 4 allows, which is not much: the token enters only through the
multiplicative gate, so no initialisation lets a frozen model read its input token
before the gate is trained. Measured on SmolLM2-135M (docs/latent-feedback.md): a fresh
gate's fused pass has a mean NLL of ~10.7 against the plain model's 3.0, about that of
a uniform guess, and a random init is no better (10.4). The first pass (the readout of
``none`` and of soft decoding's prompt) is untouched whatever the gate.

The strategy (:class:`LatentFeedback`) plugs into :class:`probekit.StepEngine`. For a
chunk of positions ``c0 .. c1-1``::

    pass 1   x_p = fuse(h_{p-1}, e_p) for p = c0 (h_{c0-1} carried from the last chunk)
             x_p = e_p                for p > c0 (not computed yet: Jacobi pass 1)
    pass j   x_p = fuse(h^{(j-1)}_{p-1}, e_p): the previous pass's states shifted right
             (the engine's ``rerun(0, x)``: every block's keys/values are replaced)

With one position per chunk (``block_size=1``) this is the exact recurrence of Eq. 8
(``full``); with the whole sequence as one chunk and ``passes=n`` it is Eqs. 9-11
(``passes=n``). A chunk of ``K`` positions is exact after ``K`` passes (pass ``j``
makes positions ``c0 .. c0+j-1`` exact); further passes would recompute identical
numbers, so they are skipped. The readout of the engine is its first pass; for
multi-pass chunks the strategy keeps the last pass's top states and :func:`prefill`
reads the logits from them (the paper's prefill passes are scored on the last pass).

Regimes (:class:`Regime`, :func:`plan`, :func:`prefill`) for a prompt of length ``T``:

=============  ================================================  =====================
``none``       the plain model, one parallel forward             1 forward
``last-k``     plain forward of positions ``< T-k``, then the     ~``k + 1`` forwards
               final ``k`` positions token by token, fused
``full``       every position after the first fused, token by     ``T`` sequential steps
               token
``passes=n``   ``n`` Jacobi passes over the whole prompt           ``n`` forwards
=============  ================================================  =====================

Ragged batches are right-padded; ``last-k`` acts on each row's own final ``k`` tokens.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from probekit.analysis.capture import Mechanism
from probekit.core.engine import Recurrence, Rerun, RunResult, Step, StepEngine, score

__all__ = [
    "FeedbackGate",
    "LatentFeedback",
    "LatentFeedbackMechanism",
    "Regime",
    "plan",
    "prefill",
    "reference_latent_feedback",
]

INITS = ("identity", "random")


class FeedbackGate(nn.Module):
    """The gated fusion of Eq. 4 with the RMSNorms of App. C.

    ``forward(h_prev, e) = RMSNorm_u( W_U(h_prev) * sigmoid(W_G(RMSNorm_e(e))) )``.

    Args:
        d_model: residual width ``D`` (the model's ``d_model``).
        init: ``"identity"`` (``W_U = W_G = I``, the default; see the module docstring)
            or ``"random"`` (PyTorch's default ``Linear`` init, for ablations).
        output_scale: ``[D]`` initial weight of ``RMSNorm_u`` (the scale of a fused input);
            None leaves 1. :meth:`for_model` sets it to the embedding's RMS per dimension.
        eps: epsilon of both RMSNorms.
    """

    def __init__(self, d_model: int, *, init: str = "identity",
                 output_scale: Tensor | None = None, eps: float = 1e-6) -> None:
        super().__init__()
        if not isinstance(d_model, int) or d_model < 1:
            raise ValueError(f"d_model must be a positive integer; got {d_model!r}")
        if init not in INITS:
            raise ValueError(f"init must be one of {INITS}; got {init!r}")
        self.d_model = d_model
        self.W_U = nn.Linear(d_model, d_model, bias=False)
        self.W_G = nn.Linear(d_model, d_model, bias=False)
        self.norm_e = nn.RMSNorm(d_model, eps=eps)
        self.norm_u = nn.RMSNorm(d_model, eps=eps)
        if init == "identity":
            with torch.no_grad():
                self.W_U.weight.copy_(torch.eye(d_model))
                self.W_G.weight.copy_(torch.eye(d_model))
        if output_scale is not None:
            output_scale = torch.as_tensor(output_scale, dtype=torch.float32)
            if output_scale.shape != (d_model,):
                raise ValueError(
                    f"output_scale must have shape ({d_model},); got {tuple(output_scale.shape)}"
                )
            with torch.no_grad():
                self.norm_u.weight.copy_(output_scale)

    @classmethod
    def for_model(cls, model, *, init: str = "identity", seed: int = 0) -> FeedbackGate:
        """A fresh gate for a :class:`probekit.LoadedModel` (output scale = embedding RMS)."""
        emb = model.hf_model.get_input_embeddings().weight.detach().float()
        scale = emb.pow(2).mean(0).sqrt()  # [D] typical magnitude of each input dimension
        with torch.random.fork_rng(devices=[]):  # "random" init: seeded, caller's RNG untouched
            torch.manual_seed(seed)
            return cls(model.d_model, init=init, output_scale=scale)

    def forward(self, h_prev: Tensor, e: Tensor) -> Tensor:
        """``h_prev``, ``e``: ``[..., D]`` (broadcastable) -> fused input ``[..., D]``.

        Computed in the gate's dtype; the result has ``e``'s dtype (the model's)."""
        if h_prev.shape[-1] != self.d_model or e.shape[-1] != self.d_model:
            raise ValueError(
                f"gate of d_model {self.d_model} got states of width {h_prev.shape[-1]} and "
                f"embeddings of width {e.shape[-1]}"
            )
        dtype = self.W_U.weight.dtype
        h_prev, e_in = h_prev.to(dtype), e.to(dtype)
        u = self.W_U(h_prev) * torch.sigmoid(self.W_G(self.norm_e(e_in)))
        return self.norm_u(u).to(e.dtype)


def final_norm(model) -> nn.Module:
    """The model's final norm (Llama family: ``model.model.norm``): ``h`` is read after it."""
    return model.hf_model.model.norm


def check_gate(gate: FeedbackGate, model) -> None:
    """Raise ValueError unless ``gate`` fits ``model``'s residual width."""
    if gate.d_model != model.d_model:
        raise ValueError(
            f"feedback gate has d_model {gate.d_model} but model {model.name!r} has d_model "
            f"{model.d_model}; use a gate trained for this model"
        )


class LatentFeedback(Recurrence):
    """Latent feedback as a :class:`probekit.StepEngine` strategy (module docstring).

    Args:
        gate: the :class:`FeedbackGate`.
        model: the :class:`probekit.LoadedModel` the engine runs (its final norm gives
            ``h``; its ``d_model`` must match the gate's).
        passes: Jacobi passes per chunk (1 with ``block_size=1`` is the exact ``full``).
        initial_state: ``[batch, D]`` state ``h`` of position ``start - 1`` when a run
            continues from a cache (``start > 0``); needed if position ``start`` is active.
        record_tops: keep the last pass's top-block outputs (``tops``, ``[batch, seq, D]``,
            before the final norm) for reading logits of multi-pass chunks.
        on_pass: optional ``fn(pass_index, step, h)`` called after every pass of every chunk
            with the chunk's states ``h`` ``[batch, pos, D]`` (after the final norm).

    After a run, ``state`` is ``[batch, D]``: ``h`` of the run's last position (the carry
    for a continuation, e.g. the next decoding step).
    """

    name = "latent-feedback"

    def __init__(
        self,
        gate: FeedbackGate,
        model,
        *,
        passes: int = 1,
        initial_state: Tensor | None = None,
        record_tops: bool = False,
        on_pass: Callable[[int, Step, Tensor], None] | None = None,
    ) -> None:
        check_gate(gate, model)
        if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
            raise ValueError(f"passes must be an integer >= 1; got {passes!r}")
        if initial_state is not None and (
            initial_state.ndim != 2 or initial_state.shape[1] != gate.d_model
        ):
            raise ValueError(
                f"initial_state must be [batch, {gate.d_model}]; got {tuple(initial_state.shape)}"
            )
        self.gate = gate
        self.norm = final_norm(model)
        self.passes = passes
        self.initial_state = initial_state
        self.record_tops = record_tops
        self.on_pass = on_pass
        self.n_blocks = model.n_blocks
        self.state: Tensor | None = None
        self.tops: Tensor | None = None
        self._embeds: Tensor | None = None

    def __repr__(self) -> str:
        return f"LatentFeedback(d_model={self.gate.d_model}, passes={self.passes})"

    def check(self, n_blocks: int) -> None:
        if n_blocks != self.n_blocks:
            raise ValueError(
                f"LatentFeedback was built for a {self.n_blocks}-block model; the engine "
                f"runs {n_blocks} blocks"
            )

    def begin(self, batch_size: int, seq_len: int) -> None:
        init = self.initial_state
        if init is not None and init.shape[0] != batch_size:
            raise ValueError(
                f"initial_state has {init.shape[0]} rows but the batch has {batch_size}"
            )
        self.state = init
        self.tops = None
        self._seq = seq_len

    def _fuse(self, step: Step, embeds: Tensor, h_prev: Tensor | None) -> Tensor:
        """Chunk input: ``fuse(h_prev[p], e[p])`` where active and ``h_prev`` exists."""
        if h_prev is None:  # position 0: nothing before it
            return embeds
        fused = self.gate(h_prev, embeds)
        return torch.where(step.active[..., None], fused, embeds)

    def form_input(self, step: Step, embeds: Tensor) -> Tensor:
        self._embeds = embeds
        if step.start > 0 and self.state is None and bool(step.active[:, 0].any()):
            raise ValueError(
                f"latent feedback at position {step.start} needs the state of position "
                f"{step.start - 1}: pass initial_state= when continuing from a cache"
            )
        x = embeds.clone()
        if self.state is not None:  # the chunk's first position: the carried state
            x[:, :1] = self._fuse(_first(step), embeds[:, :1], self.state[:, None])
        return x

    def after_first_pass(
        self, step: Step, captured: dict[int, Tensor], top: Tensor, rerun: Rerun
    ) -> None:
        embeds, width = self._embeds, len(step.positions)
        h = self.norm(top)
        if self.on_pass is not None:
            self.on_pass(0, step, h)
        # A chunk of `width` positions is exact after `width` passes (module docstring).
        for j in range(1, min(self.passes, width)):
            prev = h[:, :-1]
            if self.state is not None:
                prev = torch.cat([self.state[:, None], prev], 1)
                x = self._fuse(step, embeds, prev)
            else:  # the chunk starts the sequence: its first position stays plain
                rest = Step(step.start + 1, step.positions[1:], step.active[:, 1:],
                            step.input_ids[:, 1:])
                x = torch.cat([embeds[:, :1], self._fuse(rest, embeds[:, 1:], prev)], 1)
            top = rerun(0, x, capture=(self.n_blocks - 1,))[self.n_blocks - 1]
            h = self.norm(top)
            if self.on_pass is not None:
                self.on_pass(j, step, h)
        if self.record_tops:
            if self.tops is None:
                self.tops = top.new_full((top.shape[0], self._seq, top.shape[-1]), float("nan"))
            self.tops[:, step.positions] = top
        self.state = h[:, -1]


def _first(step: Step) -> Step:
    return Step(step.start, step.positions[:1], step.active[:, :1], step.input_ids[:, :1])


# ------------------------------------------------------------------------ regimes
_PASSES = re.compile(r"passes=(\d+)")
KINDS = ("none", "last-k", "full", "passes")


@dataclass(frozen=True)
class Regime:
    """A prefill regime (SEMANTICS.md "Latent feedback").

    Args:
        kind: ``"none"``, ``"last-k"``, ``"full"`` or ``"passes"``.
        k: number of final positions fused under ``last-k`` (>= 1).
        passes: number of Jacobi passes under ``passes`` (>= 1; 1 is the plain model).
    """

    kind: str
    k: int | None = None
    passes: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"regime must be none, last-k, full or passes=<n>; got {self.kind!r}"
            )
        if self.kind == "last-k" and (not isinstance(self.k, int) or self.k < 1):
            raise ValueError(f"regime last-k needs k >= 1 (--k); got k={self.k!r}")
        if self.kind == "passes" and (not isinstance(self.passes, int) or self.passes < 1):
            raise ValueError(f"regime passes=<n> needs n >= 1; got {self.passes!r}")

    @classmethod
    def parse(cls, text: str, *, k: int | None = None) -> Regime:
        """``"none"``, ``"full"``, ``"last-k"`` (with ``k``), ``"last-3"`` or ``"passes=4"``."""
        text = text.strip().lower()
        if m := _PASSES.fullmatch(text):
            return cls("passes", passes=int(m.group(1)))
        if m := re.fullmatch(r"last-(\d+)", text):
            return cls("last-k", k=int(m.group(1)))
        return cls(text, k=k if text == "last-k" else None)

    def __str__(self) -> str:
        if self.kind == "last-k":
            return f"last-{self.k}"
        if self.kind == "passes":
            return f"passes={self.passes}"
        return self.kind


@dataclass
class Plan:
    """How to run one regime on the engine: ``engine.run(ids, recurrence, mask=mask,
    block_size=block_size)``; activations of the readout pass have ``pass_index``."""

    recurrence: LatentFeedback | None
    mask: Tensor | None
    block_size: int | list[int]
    pass_index: int


def plan(regime: Regime | str, gate: FeedbackGate | None, model, lengths: Tensor) -> Plan:
    """The engine call for ``regime`` on a right-padded batch with real ``lengths``."""
    regime = Regime.parse(regime) if isinstance(regime, str) else regime
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    seq = int(lengths.max())
    if regime.kind == "none":
        if gate is None:
            return Plan(None, None, seq, 0)
        # Feedback off everywhere: the plain model, but the strategy still reports the
        # last state ``h`` (what soft decoding carries into its first generated token).
        off = torch.zeros(len(lengths), seq, dtype=torch.bool)
        return Plan(LatentFeedback(gate, model), off, seq, 0)
    if gate is None:
        raise ValueError(f"regime {regime} needs a feedback gate (--checkpoint)")
    if regime.kind == "full":
        return Plan(LatentFeedback(gate, model), None, 1, 0)
    if regime.kind == "passes":
        n = regime.passes
        rec = LatentFeedback(gate, model, passes=n, record_tops=n > 1)
        return Plan(rec, None, seq, min(n, seq) - 1)
    # last-k: each row fuses its own final k positions; every active position must be
    # alone in its chunk, so the parallel chunk stops before the shortest row's suffix.
    t = torch.arange(seq)[None, :]
    mask = (t >= lengths[:, None] - regime.k) & (t < lengths[:, None])
    head = max(1, int(lengths.min()) - regime.k)
    return Plan(LatentFeedback(gate, model), mask, [head] + [1] * (seq - head), 0)


def prefill(
    engine: StepEngine,
    input_ids,
    gate: FeedbackGate | None,
    regime: Regime | str = "none",
    **run_kw,
) -> RunResult:
    """Run ``input_ids`` under ``regime``; logits/log-probs come from the readout pass.

    ``run_kw`` go to :meth:`StepEngine.run` (``return_logits``, ``return_cache``,
    ``fwd_hooks``, ``temperature``, ``progress``). The result's ``extras["state"]`` is the
    ``[batch, D]`` top state ``h`` of the last position (the carry for decoding) and
    ``extras["pass_index"]`` the readout pass.
    """
    ids, lengths = engine.batch(input_ids)
    p = plan(regime, gate, engine.model, lengths)
    # the original rows, not the padded tensor: the engine must see the real lengths
    result = engine.run(input_ids, p.recurrence, mask=p.mask, block_size=p.block_size, **run_kw)
    rec = p.recurrence
    if rec is not None and rec.tops is not None:  # multi-pass: re-read the last pass
        logits = engine.backend.unembed(rec.tops)
        result.log_probs = score(logits, ids, lengths, run_kw.get("temperature", 1.0))
        if result.logits is not None:
            result.logits = logits
    result.extras["state"] = rec.state if rec is not None else None
    result.extras["pass_index"] = p.pass_index
    return result


# ---------------------------------------------------------------------- reference
@torch.no_grad()
def reference_latent_feedback(model, gate: FeedbackGate, tokens, *, active=None) -> Tensor:
    """Slow reference of the exact recurrence (Eq. 8): ``[len, vocab]`` logits of one
    sequence. No cache and no engine: step ``t`` re-runs the whole prefix of inputs
    ``u_0 .. u_t`` through the plain Hugging Face forward (``inputs_embeds``) and reads
    ``h_t`` at position ``t``. ``active`` (``[len]`` bools) says where feedback is on."""
    hf = model.hf_model
    ids = torch.tensor([list(tokens)])
    T = ids.shape[1]
    active = [True] * T if active is None else [bool(a) for a in active]
    e = hf.get_input_embeddings()(ids)  # [1, T, D]
    inputs = [e[:, 0]]
    logits = []
    for t in range(T):
        out = hf.model(inputs_embeds=torch.stack(inputs, 1), use_cache=False)
        h = out.last_hidden_state[:, -1]  # after the final norm
        logits.append(hf.lm_head(h)[0])
        if t + 1 < T:
            inputs.append(gate(h, e[:, t + 1]) if active[t + 1] else e[:, t + 1])
    return torch.stack(logits)


# ------------------------------------------------------ state-tracking mechanism

class LatentFeedbackMechanism(Mechanism):
    """Latent feedback as a prefill mechanism of ``probekit run state-tracking``.

    ``--mechanism latent-feedback --checkpoint C`` with ``--recurrence none, last-k, full``
    (or ``passes=<n>``). A gate checkpoint runs on the ``--model`` it was trained for; an
    organism checkpoint brings its own model (``C/organism``, used when ``--model`` is
    left at its default).

    Args:
        gate: the trained :class:`FeedbackGate`.
        model: the model the gate belongs to.
        checkpoint: where the gate came from (recorded in results).
        step: the checkpoint's training step (recorded in results).
    """

    name = "latent-feedback"

    def __init__(self, gate: FeedbackGate, model, *, checkpoint: str | None = None,
                 step: int | None = None) -> None:
        check_gate(gate, model)
        self.gate = gate
        self.model = model
        self.checkpoint = checkpoint
        self.step = step

    def __repr__(self) -> str:
        return f"LatentFeedbackMechanism(checkpoint={self.checkpoint!r}, step={self.step})"

    @staticmethod
    def add_args(p) -> None:
        p.add_argument("--checkpoint", default=None,
                       help="latent-feedback checkpoint folder from `probekit train-feedback` "
                            "(needed by --mechanism latent-feedback)")

    @staticmethod
    def _checkpoint(args) -> str:
        path = getattr(args, "checkpoint", None)
        if not path:
            raise ValueError(
                "--mechanism latent-feedback needs --checkpoint C, a folder written by "
                "`probekit train-feedback` (e.g. runs/train-feedback-<hash>/checkpoint)"
            )
        return path

    @classmethod
    def load_model(cls, args):
        """The model to run: an organism checkpoint's own model unless ``--model`` names
        another (which :meth:`from_args` then rejects), else ``--model``."""
        from probekit.core.models import DEFAULT_MODEL, load_model
        from probekit.training.feedback import read_checkpoint_config

        path = Path(cls._checkpoint(args))
        cfg = read_checkpoint_config(path)
        if cfg["mode"] == "organism" and args.model in (DEFAULT_MODEL, "default"):
            model = load_model(str(path / "organism"))
            return model
        return load_model(args.model)

    @classmethod
    def from_args(cls, args, model) -> LatentFeedbackMechanism:
        from probekit.training.feedback import load_checkpoint

        ckpt = load_checkpoint(cls._checkpoint(args), model)
        return cls(ckpt.gate, model, checkpoint=str(ckpt.path), step=ckpt.step)

    def check_regime(self, regime: str) -> None:
        Regime.parse(regime)

    def check(self, n_blocks: int) -> None:
        if n_blocks != self.model.n_blocks:
            raise ValueError(
                f"the feedback gate belongs to a {self.model.n_blocks}-block model; this one "
                f"has {n_blocks} blocks"
            )

    def config(self) -> dict:
        return {"mechanism": self.name, "checkpoint": self.checkpoint, "step": self.step,
                "d_model": self.gate.d_model}

    def notes(self) -> list[str]:
        return [
            "latent feedback changes the model input (depth 0) itself: under none, depth 0 "
            "is the final token's embedding (identical for every example, so chance); under "
            "last-k / full it is the gate's fusion of the previous top state",
            "h is read after the final norm; the readout of passes=n is the last pass",
        ]

    def run(self, engine: StepEngine, input_ids: Tensor, regime: str, *,
            fwd_hooks=()) -> RunResult:
        return prefill(engine, input_ids, self.gate, regime, fwd_hooks=fwd_hooks,
                       return_cache=True)
