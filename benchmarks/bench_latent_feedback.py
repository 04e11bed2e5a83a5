"""Latent feedback speed on the default model, as ratios measured in one run.

    .venv/bin/python benchmarks/bench_latent_feedback.py [--checkpoint C] [--prompt 64]
        [--new-tokens 32] [--passes 1 2 4 8 16] [--repeats 3] [--threads 1]

(a) per-token decoding cost of ``soft`` vs ``standard`` (full-bandwidth paper Sec. 3.1:
    "under 1% per token" on GPU). Both decode through the step engine's KV cache one
    token at a time; per-token time = (time for N new tokens - time for 1) / (N - 1), so
    the prefill cancels. Also the bare gate (two D x D products, two RMSNorms and the
    final norm) next to one plain decoding step.
(b) Jacobi prefill with ``passes=n`` vs exact token-by-token ``full`` prefill on the same
    prompt: time ratio and max |delta logits| against ``full`` as n grows (``passes=T``
    equals ``full`` exactly; tests pin it).

Without ``--checkpoint`` a fresh gate (``FeedbackGate.for_model``) is used: speed does
not depend on the weights, but the |delta logits| column then describes an untrained
map. Each contender is timed ``--repeats`` times, alternating, and the fastest run
counts (this machine is shared and noisy; the minimum is the least disturbed run).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from probekit import StepEngine, load_model
from probekit.mechanisms.generation import generate
from probekit.mechanisms.latent_feedback import FeedbackGate, prefill


def best_of(fns: dict, repeats: int) -> dict:
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: min(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--checkpoint", default=None, help="a train-feedback checkpoint folder")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=32, help="decoded tokens")
    ap.add_argument("--passes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    if args.checkpoint:
        from probekit.training.checkpoint import load_checkpoint

        ck = load_checkpoint(args.checkpoint)
        model, gate = ck.model, ck.gate
    else:
        model = load_model(args.model)
        gate = FeedbackGate.for_model(model)
    engine = StepEngine(model)
    from probekit.data.corpora import load_corpus, make_windows

    window = make_windows(load_corpus("wiki"), model.tokenizer, args.prompt, 1, bos=False,
                          max_tokens=model.n_ctx)[0]
    ids = torch.tensor([window.input_ids])
    T, N = ids.shape[1], args.new_tokens
    print(f"model {model.name} (L={model.n_blocks}, D={model.d_model}), threads "
          f"{args.threads}, prompt {T} tokens, {N} new tokens, best of {args.repeats}")

    # (a) per-token decoding overhead
    def dec(regime, n):
        return lambda: generate(engine, ids, gate=gate, regime=regime, max_new_tokens=n, eos=-1)

    t = best_of({(r, n): dec(r, n) for r in ("standard", "soft") for n in (1, N)}, args.repeats)
    per = {r: (t[(r, N)] - t[(r, 1)]) / (N - 1) for r in ("standard", "soft")}
    h = torch.randn(1, 1, model.d_model)
    e = torch.randn(1, 1, model.d_model)
    norm = model.hf_model.model.norm
    with torch.no_grad():
        g = best_of({"gate": lambda: [gate(norm(h), e) for _ in range(100)]}, args.repeats)
    gate_ms = g["gate"] / 100 * 1e3
    print("\n(a) decoding, per token")
    print(f"  standard {per['standard'] * 1e3:8.2f} ms")
    ratio = per["soft"] / per["standard"]
    print(f"  soft     {per['soft'] * 1e3:8.2f} ms   soft/standard = {ratio:.4f} "
          f"({100 * (ratio - 1):+.2f}%)")
    print(f"  the bare gate + final norm: {gate_ms:.3f} ms = "
          f"{100 * gate_ms / (per['standard'] * 1e3):.2f}% of a standard step")

    # (b) Jacobi prefill vs token-by-token full prefill
    with torch.no_grad():
        full = prefill(engine, ids, gate, "full", return_logits=True).logits
    fns = {"full": lambda: prefill(engine, ids, gate, "full")}
    for n in args.passes:
        fns[n] = lambda n=n: prefill(engine, ids, gate, f"passes={n}")
    t = best_of(fns, args.repeats)
    print(f"\n(b) prefill of {T} tokens: passes=n (Jacobi) vs full (token by token, "
          f"{t['full']:.2f} s)")
    print(f"  {'n':>4} {'seconds':>8} {'time / full':>12} {'max |delta logits|':>19}")
    for n in args.passes:
        with torch.no_grad():
            got = prefill(engine, ids, gate, f"passes={n}", return_logits=True).logits
        delta = float((got - full).abs().max())
        print(f"  {n:>4} {t[n]:>8.2f} {t[n] / t['full']:>12.3f} {delta:>19.3e}")


if __name__ == "__main__":
    main()
