"""Engine speed on a real model (default SmolLM2-135M), as ratios measured in one run.

    .venv/bin/python benchmarks/bench_engine.py [--tokens 256] [--batches 1 8] [--big-batch 32]
    .venv/bin/python benchmarks/bench_engine.py --model gemma3-270m [--tokens 64]
    .venv/bin/python benchmarks/bench_engine.py --backend nnsight [--tokens 64] [--batches 1]

(a) the engine with no recurrence vs Hugging Face's own cached decoding loop
    (model(input_ids=x_t, past_key_values=cache) per token on an un-bridged copy of
    the same weights) — target overhead <= 15%;
(b) a recirculated step vs a no-recurrence step, next to the compute bound
    (2L - d - 1) / L (a recirculated step runs L + (L-d-1) blocks) — target within 10%;
(c) the engine vs the naive loop users write: no cache, re-run the whole prefix through
    HF at every token with a hook that writes the stored mixed states back at block d
    (one prefix forward per token, the cheapest exact naive loop). Its cost grows with
    the prefix, so it is timed at a few prefix lengths and summed over t = 0..T-1 from a
    least-squares line (stated in the output) — target >= 10x;
(d) tokens/s of the recirculated engine at batch 32 vs batch 1.

``--backend nnsight`` instead times the nnsight backend (every embed, block range and
readout one nnsight trace) against the lens backend and HF's cached decode, plain and
recirculated, on a separate copy of the weights (the lens backend wraps its copy).

Each contender is timed ``--repeats`` times, alternating, and the fastest run counts.
Times are the process's CPU time (``time.process_time``) by default, with torch on one
thread (``--threads 1``): on a shared machine wall time mostly measures the other
tenants, CPU time measures our work. ``--clock wall`` switches to wall time.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from transformers import DynamicCache

from probekit import Recirculation, StepEngine, load_model
from probekit.core.architecture import layout
from probekit.mechanisms.recirculation import default_pair, mix

CLOCK = time.process_time


def best_of(fns: dict, repeats: int) -> dict:
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = CLOCK()
            fn()
            times[k].append(CLOCK() - t0)
    return {k: min(v) for k, v in times.items()}


@torch.no_grad()
def hf_decode(hf, ids):
    cache = DynamicCache(config=hf.config)
    for t in range(ids.shape[1]):
        hf(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True)


@torch.no_grad()
def naive_prefix_step(hf, ids, t, stored, s, d, alpha):
    """One token of the naive loop: forward x[:t+1], positions < t get their stored z'_d."""
    grabbed = {}

    def at_d(mod, args, out):
        h = out[0] if isinstance(out, tuple) else out
        grabbed["d"] = h[:, t].clone()
        if t:
            h = h.clone()
            h[:, :t] = stored[:, :t]
        return (h, *out[1:]) if isinstance(out, tuple) else h

    def at_s(mod, args, out):
        grabbed["s"] = (out[0] if isinstance(out, tuple) else out)[:, t].clone()

    layers = layout(hf).layers
    hs = [layers[d].register_forward_hook(at_d), layers[s].register_forward_hook(at_s)]
    try:  # the readout of position t only: the other rows of the logits are never needed
        hf(ids[:, : t + 1], use_cache=False, logits_to_keep=1)
    finally:
        for h in hs:
            h.remove()
    stored[:, t] = mix(grabbed["s"], grabbed["d"], torch.tensor(alpha), torch.tensor(1 - alpha),
                       "ratio")


def bench_nnsight(engine, hf, rec, args) -> None:
    """Step cost of the nnsight backend as ratios to the lens backend and to HF decode."""
    nn = StepEngine(load_model(args.model), backend="nnsight")
    T = args.tokens
    g = torch.Generator().manual_seed(0)
    for B in args.batches:
        ids = torch.randint(0, hf.config.vocab_size, (B, T), generator=g)
        t = best_of({
            "hf": lambda: hf_decode(hf, ids),
            "lens": lambda: engine.run(ids),
            "nnsight": lambda: nn.run(ids),
            "lens_rec": lambda: engine.run(ids, rec),
            "nnsight_rec": lambda: nn.run(ids, rec),
        }, args.repeats)
        ms = {k: v / T * 1e3 for k, v in t.items()}
        print(f"\nbatch {B}: ms/token HF decode {ms['hf']:.1f}, lens {ms['lens']:.1f}, nnsight "
              f"{ms['nnsight']:.1f}; recirculated: lens {ms['lens_rec']:.1f}, nnsight "
              f"{ms['nnsight_rec']:.1f}")
        print(f"  nnsight / lens       = {t['nnsight'] / t['lens']:.2f} (no recurrence), "
              f"{t['nnsight_rec'] / t['lens_rec']:.2f} (recirculated)")
        print(f"  nnsight / HF decode  = {t['nnsight'] / t['hf']:.2f} (no recurrence)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--big-batch", type=int, default=32)
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m or gemma3-270m")
    ap.add_argument("--source", type=int, default=None, help="default: the model's rule pair")
    ap.add_argument("--destination", type=int, default=None)
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--backend", choices=["lens", "nnsight"], default="lens",
                    help="nnsight: time the nnsight backend against lens and HF decode")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    engine = StepEngine(load_model(args.model))
    hf = load_model(args.model).hf_model  # a second copy that TransformerLens never touched
    L = engine.n_blocks
    T = args.tokens
    rule_s, rule_d = default_pair(L)
    s = rule_s if args.source is None else args.source
    d = rule_d if args.destination is None else args.destination
    rec = Recirculation(s, d, args.alpha)
    print(f"{args.model}, {L} blocks, {T} tokens, s={s} d={d} alpha={args.alpha}, "
          f"torch threads {torch.get_num_threads()}, {args.clock} time, best of {args.repeats}")
    if args.backend == "nnsight":
        bench_nnsight(engine, hf, rec, args)
        return
    g = torch.Generator().manual_seed(0)
    rows = []
    for B in args.batches:
        ids = torch.randint(0, hf.config.vocab_size, (B, T), generator=g)
        t = best_of({
            "hf": lambda: hf_decode(hf, ids),
            "engine": lambda: engine.run(ids),
            "recirc": lambda: engine.run(ids, rec),
        }, args.repeats)
        # (c): time the naive loop at a few prefix lengths, sum a fitted line over t.
        probes = sorted({0, T // 4, T // 2, 3 * T // 4, T - 1})
        stored = torch.zeros(B, T, engine.model.d_model)
        per_t = []
        for tt in probes:
            t0 = CLOCK()
            naive_prefix_step(hf, ids, tt, stored, s, d, args.alpha)
            per_t.append(CLOCK() - t0)
        a, b = np.polyfit(probes, per_t, 1)[::-1]
        naive_total = sum(a + b * tt for tt in range(T))
        rows.append((B, t, naive_total, probes, per_t))
        bound = (2 * L - d - 1) / L
        print(f"\nbatch {B}: HF decode {t['hf'] / T * 1e3:.1f} ms/token, engine "
              f"{t['engine'] / T * 1e3:.1f}, recirculated {t['recirc'] / T * 1e3:.1f}")
        print(f"  (a) engine / HF decode          = {t['engine'] / t['hf']:.3f}   "
              f"(target <= 1.15)")
        print(f"  (b) recirculated / no recurrence = {t['recirc'] / t['engine']:.3f}   "
              f"compute bound (2L-d-1)/L = {bound:.3f}; ratio/bound = "
              f"{t['recirc'] / t['engine'] / bound:.3f} (target <= 1.10)")
        print(f"  (c) naive prefix loop (est. {naive_total:.1f} s: per-token cost "
              f"{a * 1e3:.1f} ms + {b * 1e3:.3f} ms x t, fitted on t={probes}) / "
              f"recirculated engine ({t['recirc']:.1f} s) = {naive_total / t['recirc']:.1f}x "
              f"(target >= 10x)")
    B = args.big_batch
    ids = torch.randint(0, hf.config.vocab_size, (B, T), generator=g)
    one = next((r for r in rows if r[0] == 1), None)
    t_big = best_of({"recirc": lambda: engine.run(ids, rec)}, 1)["recirc"]
    t_one = one[1]["recirc"] if one else best_of({"r": lambda: engine.run(ids[:1], rec)}, 1)["r"]
    print(f"\n(d) recirculated tokens/s: batch 1 {T / t_one:.1f}, batch {B} {B * T / t_big:.1f} "
          f"-> {B * t_one / t_big:.1f}x")


if __name__ == "__main__":
    main()
