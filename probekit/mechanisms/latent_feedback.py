"""Latent feedback: fuse the previous top-layer state into the next input (full-bandwidth).

Implements ``papers/latent-feedback-full-bandwidth-transformer.md`` Sec. 3.1 (Eq. 4),
Sec. 3.3 (Eqs. 8-11, the Jacobi passes), App. C (the normalisation) and the prefill
regimes of Sec. 4.1 / 4.4 / App. F, as ``SEMANTICS.md`` "Latent feedback" pins them.

The gate (:class:`FeedbackGate`, Eq. 4 with App. C's norms)::

    u_t = RMSNorm_u( (W_U h_{t-1}) * sigmoid(W_G RMSNorm_e(e_t)) )        W_U, W_G in R^{D x D}

``h_{t-1}`` is the previous position's top-layer state. SEMANTICS.md asks for one stated
choice of *which* top state, and the paper supports two readings, so the gate stores the
choice (``FeedbackGate(..., feed=...)``, the trainer's ``--feed``) and everything that
feeds back (the engine strategy, the training objective, the slow reference) follows it:

- ``feed="normed"`` (the default): the top residual **after the model's final norm**,
  the vector the unembedding reads (Sec. 2 defines ``h^L`` as what the head projects).
  Its scale is bounded whatever the depth, the training jitter ``sigma`` is then in a
  meaningful unit, and with tied embeddings it already lives in the embedding basis (the
  paper's "shared input basis", Sec. 3.3), which the identity initialisation of ``W_U``
  below relies on.
- ``feed="residual"``: the top residual stream **before the final norm**. Sec. 3.3's
  "stationary hidden-state scale" uses depth scaling so that ``||h^L|| ~ O(1)`` rather
  than the ``O(L)`` of "a standard pre-norm model": a concern only for the un-normed
  stream, so this is the state that reading implies. (probekit's models have no depth
  scaling: their residual's scale is whatever the model's is.) The logits still come
  from the normed state; only what is fed back changes.

With an RMSNorm final norm (Llama, the organism) the normed state is the residual times
a per-position scalar and the norm's per-dimension weight: ``RMSNorm_u`` removes the
scalar (up to its epsilon) and ``W_U`` can absorb the weight, so both feeds can express
the same gates. They differ where training starts and what it sees: ``W_U = I`` starts on
different vectors (unless the norm's weight is uniform), and the absolute jitter
``sigma`` is small or large relative to the state depending on the residual's scale.

Position 0, and every position where feedback is off, gets the plain embedding.

Initialisation: ``W_U = I`` and ``W_G = I``, and ``RMSNorm_u``'s weight starts at the
per-dimension RMS of the model's embedding matrix (:meth:`FeedbackGate.for_model`), so
a fused input has the scale of an ordinary token embedding instead of RMS 1. With
``W_U = I`` the value pathway starts as the state the model just used to predict this
very token (with tied weights it points toward the predicted token's embedding), gated
by the token's own normalised embedding. That is as harmless as Eq. 4 allows, which is
not much: the token enters only through the multiplicative gate, so no initialisation
lets a frozen model read its input token before the gate is trained (docs/latent-feedback.md
measures a fresh gate). The first pass (the readout of ``none`` and of soft decoding's
prompt) is untouched whatever the gate.

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
numbers, so they are skipped. :func:`prefill` reads each chunk's logits from its last
pass (the engine's ``readout="last"``; the paper scores its prefill passes on the last).

The prefill regimes (:mod:`probekit.mechanisms.regimes`: ``none``, ``last-k``, ``full``,
``passes=n``) become engine calls in :func:`prefill`; ragged batches are right-padded
and ``last-k`` fuses each row's own final ``k`` tokens. The state-tracking plug-in is
:class:`probekit.mechanisms.prefill.LatentFeedbackMechanism`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from probekit.core.architecture import layout
from probekit.core.engine import Recurrence, Rerun, RunResult, Step, StepEngine
from probekit.mechanisms.regimes import Regime, plan

__all__ = [
    "FeedbackGate",
    "LatentFeedback",
    "FEEDS",
    "check_gate",
    "final_norm",
    "final_norm_inputs",
    "prefill",
    "reference_latent_feedback",
]

INITS = ("identity", "random")
#: which top state is fed back (module docstring): after or before the final norm
FEEDS = ("normed", "residual")


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
        feed: which top state ``h`` this gate is trained on, kept as ``gate.feed``:
            ``"normed"`` (after the final norm, the default) or ``"residual"`` (before it);
            see the module docstring. Not a weight: checkpoints store it in config.json.
    """

    def __init__(self, d_model: int, *, init: str = "identity",
                 output_scale: Tensor | None = None, eps: float = 1e-6,
                 feed: str = "normed") -> None:
        super().__init__()
        if not isinstance(d_model, int) or d_model < 1:
            raise ValueError(f"d_model must be a positive integer; got {d_model!r}")
        if init not in INITS:
            raise ValueError(f"init must be one of {INITS}; got {init!r}")
        if feed not in FEEDS:
            raise ValueError(f"feed must be one of {', '.join(FEEDS)}; got {feed!r}")
        self.d_model = d_model
        self.feed = feed
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
    def for_model(cls, model, *, init: str = "identity", seed: int = 0,
                  feed: str = "normed") -> FeedbackGate:
        """A fresh gate for a :class:`probekit.LoadedModel` (output scale = embedding RMS)."""
        emb = model.hf_model.get_input_embeddings().weight.detach().float()
        scale = emb.pow(2).mean(0).sqrt()  # [D] typical magnitude of each input dimension
        with torch.random.fork_rng(devices=[]):  # "random" init: seeded, caller's RNG untouched
            torch.manual_seed(seed)
            return cls(model.d_model, init=init, output_scale=scale, feed=feed)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, feed={self.feed!r}"

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
    """The model's final norm (``model.model.norm`` in Llama, ``transformer.ln_f`` in GPT-2;
    :func:`probekit.core.architecture.layout`): ``feed="normed"`` reads ``h`` after it,
    ``feed="residual"`` before it."""
    return layout(model.hf_model).final_norm


@contextlib.contextmanager
def final_norm_inputs(hf_model) -> Iterator[list[Tensor]]:
    """Within the block, every forward of the Hugging Face model ``hf_model`` appends the
    input of its final norm (the un-normed top residual ``[batch, pos, D]``, in the
    autograd graph) to the yielded list: the ``feed="residual"`` state of a plain forward
    (the training objective and the slow reference, which do not run the engine)."""
    seen: list[Tensor] = []
    handle = layout(hf_model).final_norm.register_forward_pre_hook(
        lambda module, args: seen.append(args[0]))
    try:
        yield seen
    finally:
        handle.remove()


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
        on_pass: optional ``fn(pass_index, step, h)`` called after every pass of every chunk
            with the chunk's fed-back states ``h`` ``[batch, pos, D]``: after the final norm
            for a ``feed="normed"`` gate, before it for ``"residual"`` (:meth:`normed` maps
            either to what the unembedding reads).

    After a run, ``state`` is ``[batch, D]``: the fed-back ``h`` (the gate's ``feed``) of
    the run's last position (the carry for a continuation, e.g. the next decoding step).
    """

    name = "latent-feedback"

    def __init__(
        self,
        gate: FeedbackGate,
        model,
        *,
        passes: int = 1,
        initial_state: Tensor | None = None,
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
        self.on_pass = on_pass
        self.n_blocks = model.n_blocks
        self.state: Tensor | None = None
        self._embeds: Tensor | None = None

    def __repr__(self) -> str:
        return (f"LatentFeedback(d_model={self.gate.d_model}, feed={self.gate.feed!r}, "
                f"passes={self.passes})")

    def fed_back(self, top: Tensor) -> Tensor:
        """The state ``h`` fed back from top residuals ``top`` (the gate's ``feed``)."""
        return self.norm(top) if self.gate.feed == "normed" else top

    def normed(self, h: Tensor) -> Tensor:
        """The final-normed state (what the unembedding reads) of fed-back states ``h``."""
        return h if self.gate.feed == "normed" else self.norm(h)

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
        h = self.fed_back(top)
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
            h = self.fed_back(top)
            if self.on_pass is not None:
                self.on_pass(j, step, h)
        self.state = h[:, -1]


def _first(step: Step) -> Step:
    return Step(step.start, step.positions[:1], step.active[:, :1], step.input_ids[:, :1])


# ------------------------------------------------------------------------ prefill
def prefill(
    engine: StepEngine,
    input_ids,
    gate: FeedbackGate | None,
    regime: Regime | str = "none",
    **run_kw,
) -> RunResult:
    """Run ``input_ids`` under ``regime`` (:func:`probekit.mechanisms.regimes.plan`); logits
    and log-probs come from the readout pass, the last pass of each chunk.

    ``regime`` is a :class:`Regime`; a string is read with :meth:`Regime.parse` (the Python
    API's edge, e.g. ``prefill(engine, ids, gate, "passes=4")``). ``gate`` None runs only
    ``none``. ``run_kw`` go to :meth:`StepEngine.run` (``return_logits``, ``return_cache``,
    ``fwd_hooks``, ``temperature``, ``readout``, ``progress``). The result's
    ``extras["state"]`` is the ``[batch, D]`` top state ``h`` of the last position (the
    carry for decoding, on the gate's ``feed`` side of the final norm; None without a
    gate) and ``extras["pass_index"]`` the readout pass.
    """
    regime = regime if isinstance(regime, Regime) else Regime.parse(regime)
    _, lengths = engine.batch(input_ids)
    p = plan(regime, lengths)
    if gate is None and not p.off:
        raise ValueError(f"regime {regime} needs a feedback gate (--checkpoint)")
    # With a gate, `none` still runs the strategy (mask all off, so the plain model) for
    # the state h it reports: what soft decoding carries into its first generated token.
    rec = None if gate is None else LatentFeedback(gate, engine.model, passes=p.passes)
    run_kw.setdefault("readout", "last")  # passes=n is scored on its last pass
    # the original rows, not a padded tensor: the engine must see the real lengths
    result = engine.run(input_ids, rec, mask=p.mask, block_size=p.block_size, **run_kw)
    result.extras["state"] = rec.state if rec is not None else None
    # passes=n is one chunk of the whole prompt, exact (and stopped) after T passes
    result.extras["pass_index"] = min(p.passes, int(lengths.max())) - 1
    return result


# ---------------------------------------------------------------------- reference
@torch.no_grad()
def reference_latent_feedback(model, gate: FeedbackGate, tokens, *, active=None) -> Tensor:
    """Slow reference of the exact recurrence (Eq. 8): ``[len, vocab]`` logits of one
    sequence. No cache and no engine: step ``t`` re-runs the whole prefix of inputs
    ``u_0 .. u_t`` through the plain Hugging Face forward (``inputs_embeds``) and reads
    ``h_t`` at position ``t``: the output for ``feed="normed"``, the final norm's input
    (a hook on the Hugging Face norm) for ``"residual"``. ``active`` (``[len]`` bools)
    says where feedback is on."""
    hf = model.hf_model
    ids = torch.tensor([list(tokens)])
    T = ids.shape[1]
    active = [True] * T if active is None else [bool(a) for a in active]
    e = hf.get_input_embeddings()(ids)  # [1, T, D]
    inputs = [e[:, 0]]
    logits = []
    with final_norm_inputs(hf) as tops:
        for t in range(T):
            out = hf.model(inputs_embeds=torch.stack(inputs, 1), use_cache=False)
            normed = out.last_hidden_state[:, -1]  # after the final norm
            residual = tops.pop()[:, -1]  # before it
            logits.append(hf.lm_head(normed)[0])
            h = normed if gate.feed == "normed" else residual
            if t + 1 < T:
                inputs.append(gate(h, e[:, t + 1]) if active[t + 1] else e[:, t + 1])
    return torch.stack(logits)
