"""Capture the final token's residual stream at every depth, under a prefill regime.

The state-tracking experiment of the full-bandwidth paper (latent-feedback paper,
Sec. 4.4, Fig. 7, App. F "Probe construction" and "Recurrent-suffix controls") reads
one vector per residual depth at the shared final token of every example::

    resid[i, r]   example i, residual depth r = 0 .. L   ->   [batch, L + 1, d_model]

Depth ``r < L`` is the input of block ``r`` (TransformerLens
``blocks.{r}.hook_resid_pre``; ``r = 0`` is the model input: the token embedding, or the
fused input under latent feedback); depth ``L`` is the output of the last block
(``blocks.{L-1}.hook_resid_post``). In a first pass with no edits the input of block
``r`` is the output of block ``r - 1``, so this is SEMANTICS.md's "depth ``r = b + 1`` is
the output of block ``b``". Only the final token's vectors are kept (hooks pick that
position out of every chunk), so memory is ``batch x (L + 1) x d_model`` whatever the
prompt length.

Two ways to read them, with the same result (a test compares them): hooks on every
depth during the run (general; any pass), or, when the mechanism knows the final token's
depth-0 input in advance and reads out on the first pass (recirculation:
:meth:`Mechanism.final_input`), a run with no hooks (the backend's fast block path) and
then one extra pass of the final position over the run's cache, which by the readout
rule below is exactly its readout pass.

Which pass: by default the **readout pass** of the final token, the pass its logits come
from (the first pass for recirculation; the last Jacobi pass for latent feedback's
``passes=n``). ``pass_index=p`` asks for the state as of pass ``p`` instead: each depth
reports the latest pass ``<= p`` that computed it. Recirculation's second pass starts
above block ``d``, so depths ``0 .. d`` of pass 1 are pass 0's and depth ``d + 1`` is the
mixed state ``z'_d`` the second pass started from; a regime with no second pass at the
final token (``none``) reports pass 0 everywhere.

A **mechanism** (:class:`probekit.mechanisms.prefill.Mechanism`) says how a batch is
prefilled under a :class:`~probekit.mechanisms.regimes.Regime`; what each regime means
for recirculation and for latent feedback is in :mod:`probekit.mechanisms.prefill`.
Recirculation leaves depths ``0 .. d + 1`` of the final token the same under every
regime up to float rounding (a parallel and a token-by-token run sum in different
orders; a test pins it), and ``last-1`` equals ``none`` there.

Causal patching (:mod:`probekit.analysis.causal`) re-runs only the final position from a patched
depth on the context the readout pass saw; :class:`Capture` carries that context (the
KV cache of positions ``< T - 1``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from probekit.core.engine import StepEngine
from probekit.core.kv_cache import KVCache
from probekit.mechanisms.prefill import Mechanism
from probekit.mechanisms.regimes import Regime


def depth_hook_names(n_blocks: int) -> list[str]:
    """TransformerLens hook of each residual depth ``0 .. L`` (module docstring)."""
    return [f"blocks.{r}.hook_resid_pre" for r in range(n_blocks)] + [
        f"blocks.{n_blocks - 1}.hook_resid_post"
    ]


@dataclass
class Capture:
    """Final-token residuals of one batch under one regime.

    Attributes:
        resid: ``[batch, L + 1, d_model]`` float32, depth 0 .. L (module docstring).
        cache: KV cache holding positions ``< T - 1`` as the final token's readout pass
            saw them (room for one more position): the context for causal patching.
        position: the final position ``T - 1``.
        pass_index: the pass asked for (each depth: the latest pass ``<=`` it).
        readout_top: ``[batch, d_model]`` depth ``L`` of the readout pass (its logits are
            ``unembed(readout_top)``); ``resid[:, L]`` when ``pass_index`` is the readout.
    """

    resid: Tensor
    cache: KVCache
    position: int
    pass_index: int
    readout_top: Tensor


@torch.no_grad()
def capture_final(
    engine: StepEngine,
    mechanism: Mechanism,
    input_ids: Tensor,
    regime: Regime,
    *,
    pass_index: int | None = None,
    fwd_hooks: Sequence[tuple[str, Callable]] = (),
) -> Capture:
    """Residual of the final token at every depth, for rows of equal length.

    Args:
        input_ids: ``[batch, T]``, every row a real prompt of ``T`` tokens (batch prompts
            by length; ``probekit.analysis.state_tracking`` does).
        regime: the prefill regime (:class:`~probekit.mechanisms.regimes.Regime`).
        pass_index: None for the readout pass, or a pass number: the state as of that
            pass (module docstring).
        fwd_hooks: extra TransformerLens hooks, run before the capturing ones.

    Raises:
        ValueError: for a regime the mechanism does not run, a bad ``pass_index``, or a
            ragged or empty batch.
    """
    input_ids = torch.as_tensor(input_ids)
    if input_ids.ndim != 2 or input_ids.shape[1] < 1 or input_ids.shape[0] < 1:
        raise ValueError(
            f"input_ids must be [batch, T] with equal-length rows (batch prompts by length); "
            f"got shape {tuple(input_ids.shape)}"
        )
    if pass_index is not None and (not isinstance(pass_index, int) or pass_index < 0):
        raise ValueError(f"pass_index must be None (readout pass) or an integer >= 0; "
                         f"got {pass_index!r}")
    mechanism.check_regime(regime)
    L = engine.n_blocks
    final = input_ids.shape[1] - 1
    if pass_index in (None, 0) and not fwd_hooks:
        x0 = mechanism.final_input(engine, input_ids, regime)
        if x0 is not None:
            return _capture_by_final_rerun(engine, mechanism, input_ids, regime, x0)
    names = depth_hook_names(L)
    # seen[pass][depth] = [batch, d_model] residual of the final token in that pass.
    seen: dict[int, dict[int, Tensor]] = {}

    def make_hook(depth: int):
        def hook(act: Tensor, hook=None) -> Tensor:
            # engine.state is the hooks' read-only view of where the engine is
            positions = engine.state.positions
            if positions is not None and int(positions[0]) <= final <= int(positions[-1]):
                at = final - int(positions[0])
                seen.setdefault(engine.state.pass_index, {})[depth] = (
                    act[:, at].detach().float().clone()
                )
            return act
        return hook

    hooks = list(fwd_hooks) + [(n, make_hook(r)) for r, n in enumerate(names)]
    result = _run(engine, mechanism, input_ids, regime, hooks)
    readout = int(result.extras.get("pass_index", 0))
    want = readout if pass_index is None else pass_index

    def latest(r: int, upto: int) -> Tensor:
        # The latest pass <= upto that computed depth r (module docstring).
        got = [seen[p][r] for p in sorted(seen) if p <= upto and r in seen[p]]
        if not got:
            raise RuntimeError(f"depth {r} was never captured at the final token")
        return got[-1]

    resid = torch.stack([latest(r, want) for r in range(L + 1)], 1)
    result.cache.truncate(range(L), final)
    return Capture(resid, result.cache, final, want, latest(L, readout))


def _run(engine: StepEngine, mechanism: Mechanism, input_ids: Tensor, regime: Regime,
         hooks: Sequence[tuple[str, Callable]] = ()):
    result = mechanism.run(engine, input_ids, regime, fwd_hooks=hooks)
    if result.cache is None:
        raise RuntimeError(f"{type(mechanism).__name__}.run must return its cache")
    return result


def _capture_by_final_rerun(engine: StepEngine, mechanism: Mechanism, input_ids: Tensor,
                            regime: Regime, x0: Tensor) -> Capture:
    """Run with no hooks attached, then the final position's blocks once more from ``x0``
    on the cache of positions ``< T - 1`` (:meth:`StepEngine.rerun_position`, which takes
    the backend's fast block path and leaves the cache as it found it)."""
    L, final = engine.n_blocks, input_ids.shape[1] - 1
    cache = _run(engine, mechanism, input_ids, regime).cache
    cache.truncate(range(L), final)
    _, out = engine.rerun_position(cache, final, x0, capture=range(L))
    resid = torch.stack([x0.float()] + [out[b].float() for b in range(L)], 1)
    return Capture(resid, cache, final, 0, resid[:, L].clone())
