"""Does a plain training loop learn register binding where probekit's trainer has not?

An independent check of the Fig. 7b finding (docs/latent-feedback.md): an organism-shaped
Llama (``build_organism``: 4 blocks, d_model 128, 4 heads, tied embeddings) trained by a
plain AdamW loop, with none of probekit's trainer (no gate, no feedback passes, no length
buckets, no answer-weighted mix of tasks), on register rows of one kind
(``registers_dataset``: the paper's format, no intermediate reads, no padding). It prints
the accuracy on held-out groups every 100 steps beside the shortcut "the latest write,
whatever the register". ``--loss last`` trains only the answer; ``--loss all`` every next
token with the answer weighted 20, as the organism trainer does. ``--pad-rows`` puts the
sweeps' padding remainder line (``#`` + 0-5 `` pad``, as in the organism's training rows)
before the query in that share of the training and held-out rows; the accuracy is then
printed for the held-out rows with and without it too, per register count and per writes
per register when there are several. Several ``--null-updates`` counts move the
assignments away from the query by varied distances (the accuracy is then printed per count
too). ``--save`` keeps the trained organism (also when the run is stopped with Ctrl-C or
SIGTERM), ``--init`` starts from one (staged training: two registers first, then more),
``--evaluate`` only scores one (also per queried register), ``--until`` stops once every
register count reaches an accuracy, ``--d-model`` / ``--n-heads`` / ``--n-blocks`` change
the shape and ``--init-std`` the scale of the fresh weights, ``--lr-schedule cosine``
decays the learning rate as probekit's trainer does,
``--names random`` trains on rows whose register names are drawn per row (from the
first ``--name-pool`` names), ``--values 10`` draws the assigned values from the digits
0-9 instead of bits (training and held-out rows; the answer is then the digit), and
``--queries every`` makes each training row ask for every register its history was asked
for, one answer after another (the held-out rows keep one question). ``--echo-rows``
turns that share of the training rows into rows that ask for the queried register's
name instead of its value (``query = r5`` / ``state: r5``): the step of carrying the
query to the final colon, trained on its own (the held-out rows are then scored on
their echo too). ``--attention-hint WEIGHT`` adds probekit's match hint
(``probekit.training.match_hint``, the trainer's ``--match-hint``): a loss that pulls the
attention of head 0 of the last block, at the final colon, onto the digit the question
asks for (with ``--hint-parts circuit`` also two heads of block 0 onto the lookup's
inputs), its weight decayed linearly to zero over ``--hint-steps``; every log line then
adds each hinted head's held-out attention on its target.

    python experiments/register_plateau.py --registers 2 --writes 1 2 --loss last
    python experiments/register_plateau.py --registers 2 --writes 1 2 --loss all
    python experiments/register_plateau.py --registers 2 --writes 1 2 --pad-rows 0.5
    python experiments/register_plateau.py --registers 2 --writes 1 2 --loss all \
        --pad-rows 0.5 --d-model 256 --n-heads 8 --until 0.98 --save two
    python experiments/register_plateau.py --init two --evaluate --null-updates 0 2 8
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
import signal
import sys
import time
from pathlib import Path
from typing import Literal

import torch
import transformers
import tyro

from probekit.commands.common import script_error
from probekit.training.config import OrganismConfig
from probekit.training.organism import REGISTER_NAMES  # the pool of --names random

#: Weight of each row's answer under ``--loss all`` (the organism's default answer weight).
ANSWER_WEIGHT = 20.0


@dataclasses.dataclass(frozen=True)
class Args:
    registers: tuple[int, ...] = (2,)
    """register counts m of the rows"""
    writes: tuple[int, ...] = (1, 2)
    """writes per register of the rows"""
    null_updates: tuple[int, ...] = (0,)
    """scratch null updates of the rows (each count its own groups: several vary where the
    assignments sit relative to the query)"""
    loss: Literal["last", "all"] = "last"
    """train on the answer only, or on every next token (answer weighted 20)"""
    steps: int = 1600
    lr: float = 1e-3
    """AdamW learning rate (the peak under --lr-schedule cosine)"""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """constant --lr, or linear warm-up over --warmup steps then cosine decay to --lr / 10
    at --steps (the schedule of probekit's trainer)"""
    warmup: int = 0
    """warm-up steps of --lr-schedule cosine"""
    batch_size: int = 64
    groups: int = 2000
    """training groups (schedule, complement, every query) per (m, writes)"""
    names: Literal["paper", "random"] = "paper"
    """register names of the training rows: the paper's r0..r(m-1), or m distinct names
    drawn per row from the --name-pool (every name then trains on every register count;
    the held-out rows keep the paper's names, those of the probe sets)"""
    name_pool: int | None = None
    """--names random draws from r0..r(N-1) (default all 16; a curriculum of names: a
    two-register organism that binds r0 and r1 meets r2, r3 with --name-pool 4)"""
    values: int = 2
    """values a register can hold: 2 is the paper's bits (answer zero / one); more draws
    every assignment from the digits 0..N-1 and answers the digit (a diagnostic: with two
    values half the other assignments carry the answer too)"""
    queries: Literal["one", "every"] = "one"
    """training rows ask for one register (the paper's rows), or for every register their
    history was queried for, one "query = r2 / Value: one" after another in random order
    (the dense supervision of multi-query associative recall; held-out rows ask for one)"""
    echo_rows: float = 0.0
    """share of the training rows that end "state: r5" (the queried name) instead of
    "Value: one": the query carried to the final colon, with its own loss"""
    attention_hint: float = 0.0
    """weight at step 0 of the match hint (probekit.training.match_hint): -log(attention
    of head 0 of the last block, at the final colon, on the queried register's latest
    digit) (0: no hint)"""
    hint_steps: int = 500
    """steps over which the --attention-hint weight decays linearly to zero"""
    hint_parts: Literal["match", "circuit"] = "match"
    """the match alone, or the whole lookup circuit (also: head 0 of block 0 from the
    colon onto the queried name, head 1 of block 0 from each digit onto its name)"""
    pad_rows: float = 0.0
    """share of the rows with the "# pad" line before the query"""
    seed: int = 0
    """seeds the initialisation and the batch order (the rows are fixed)"""
    init: str | None = None
    """start from this organism folder (a --save of an earlier run: staged training)"""
    save: str | None = None
    """write the trained organism here (an HF folder that --init and load_model read)"""
    evaluate: bool = False
    """only score the --init organism on the held-out rows (no training)"""
    until: float | None = None
    """stop at the first held-out accuracy >= this, on every register count"""
    d_model: int = 128
    """organism residual width (ignored with --init)"""
    n_heads: int = 4
    """organism attention heads (ignored with --init)"""
    n_blocks: int = 4
    """organism transformer blocks (ignored with --init)"""
    init_std: float = 0.02
    """standard deviation of the fresh organism's weights (HF's Llama default; larger
    starts attention further from uniform; ignored with --init)"""


def widen_values(text: str, values: int, rng: random.Random) -> str:
    """``text`` (a row with its answer) with every assignment's value redrawn from the digits
    0..values-1 and the answer the queried register's latest digit."""
    latest: dict[str, int] = {}

    def redraw(assignment: re.Match) -> str:
        latest[assignment.group(1)] = value = rng.randrange(values)
        return f"{assignment.group(1)} = {value}"

    body = re.sub(r"^(r\d+) = [01]$", redraw, text.rpartition(" ")[0], flags=re.M)
    query = re.search(r"query = (r\d+)", body).group(1)
    return f"{body} {latest[query]}"


def ask_every_register(rows: list[str], rng: random.Random) -> list[str]:
    """``rows`` (inputs with their answers) merged by update history: one row per history
    that asks, in random order, every question its rows asked (``query = r2\nValue: one``
    each) -- the dense supervision of multi-query associative recall (Arora et al. 2023,
    "Zoology")."""
    histories: dict[str, list[str]] = {}
    for row in rows:
        history, _, question = row.rpartition("query = ")
        histories.setdefault(history, []).append("query = " + question)
    merged = []
    for history, questions in histories.items():
        rng.shuffle(questions)
        merged.append(history + "\n".join(questions))
    return merged


def every_answer_weights(ids: torch.Tensor, valid: torch.Tensor, answer_ids: torch.Tensor,
                         loss: str) -> torch.Tensor:
    """Target weights (``[B, T-1]``, as ``pad_batch``'s ``valid``) of rows that ask several
    questions: every target that is an answer word weighs ``ANSWER_WEIGHT`` beside the
    other valid targets' 1 (``loss`` "all"), or 1 alone (``loss`` "last")."""
    answers = valid & torch.isin(ids[:, 1:], answer_ids)
    return answers.float() if loss == "last" else torch.where(answers, ANSWER_WEIGHT,
                                                              valid.float())


def echo_query(ids: list[int], state: int, colon: int) -> list[int]:
    """Token ids of a row that ends ``query = rX`` / ``Value: <answer>``, asking instead for
    the queried register's name: ``query = rX`` / ``state: rX``."""
    return ids[:-3] + [state, colon, ids[-5]]


def rename_registers(text: str, names: list[int]) -> str:
    """``text`` with every register ``r<i>`` renamed ``r<names[i]>`` (the query too)."""
    return re.sub(r"\br(\d+)\b", lambda r: f"r{names[int(r.group(1))]}", text)


usage_error = functools.partial(script_error, "register_plateau")


def main() -> int:
    args = tyro.cli(Args)
    for name in ("steps", "batch_size", "groups"):
        if getattr(args, name) < 1:
            return usage_error(f"--{name.replace('_', '-')} must be >= 1; got "
                               f"{getattr(args, name)}")
    if not 0 <= args.warmup < args.steps:
        return usage_error(f"--warmup must lie in [0, --steps); got {args.warmup}")
    if args.warmup and args.lr_schedule == "constant":
        return usage_error("--warmup needs --lr-schedule cosine (the constant rate has no "
                           "warm-up)")
    if min(args.registers + args.writes) < 1 or min(args.null_updates) < 0:
        return usage_error("--registers and --writes must be counts >= 1 and "
                           "--null-updates >= 0")
    if args.name_pool is not None and args.names != "random":
        return usage_error("--name-pool needs --names random (the paper's names are "
                           "r0..r(m-1))")
    pool = REGISTER_NAMES if args.name_pool is None else args.name_pool
    if not 1 <= pool <= REGISTER_NAMES:
        return usage_error(f"--name-pool must lie in [1, {REGISTER_NAMES}] (the tokenizer "
                           f"knows r0..r{REGISTER_NAMES - 1}); got {pool}")
    if args.names == "random" and max(args.registers) > pool:
        return usage_error(f"--names random draws from {pool} register names; "
                           f"--registers {max(args.registers)} needs more")
    if not 2 <= args.values <= 10:
        return usage_error(f"--values must lie in [2, 10] (the digits the tokenizer knows); "
                           f"got {args.values}")
    if args.queries == "every" and args.values > 2:
        return usage_error("--queries every asks for registers whose answers are bits; "
                           "drop --values")
    if not 0 <= args.echo_rows <= 1:
        return usage_error(f"--echo-rows must lie in [0, 1]; got {args.echo_rows}")
    if args.echo_rows and args.queries == "every":
        return usage_error("--echo-rows turns a row's one question into an echo; drop "
                           "--queries every")
    if args.attention_hint < 0:
        return usage_error(f"--attention-hint must be >= 0; got {args.attention_hint}")
    if args.attention_hint and args.queries == "every":
        return usage_error("--attention-hint supervises a row's one question; drop "
                           "--queries every")
    if args.hint_steps < 1:
        return usage_error(f"--hint-steps must be >= 1; got {args.hint_steps}")
    if not 0 <= args.pad_rows <= 1:
        return usage_error(f"--pad-rows must lie in [0, 1]; got {args.pad_rows}")
    if args.until is not None and not 0 < args.until <= 1:
        return usage_error(f"--until must lie in (0, 1]; got {args.until}")
    if args.evaluate and args.init is None:
        return usage_error("--evaluate scores a trained organism; give its folder with --init")
    if args.init is not None and not (Path(args.init) / "config.json").is_file():
        return usage_error(f"--init {args.init} is not an organism folder (no config.json); "
                           "give the --save folder of an earlier run")
    try:
        shape = OrganismConfig(n_blocks=args.n_blocks, d_model=args.d_model,
                               n_heads=args.n_heads, init_std=args.init_std)
    except ValueError as err:
        return usage_error(str(err))
    from probekit.training.data import pad_batch
    from probekit.training.match_hint import (
        EDGES,
        PARTS,
        RegisterTokens,
        attention_loss,
        fits,
        hint_weight,
        match_targets,
    )
    from probekit.training.objective import answer_weights, token_loss
    from probekit.training.organism import build_organism, fit_tokenizer, save_organism
    from probekit.training.train import warmup_cosine
    from synthetic.dataset import filler_line
    from synthetic.registers import LABEL_WORDS, registers_dataset

    torch.set_num_threads(1)
    tok = fit_tokenizer()

    def rows(n_groups: int, stream: int, training: bool = False
             ) -> tuple[list[list[int]], list[int], list[int], list[bool], list[int],
                        list[int]]:
        """Token ids of every row, each row's register count and writes per register,
        whether it has the pad line, its null updates and its queried register (-1 when it
        asks for several); ``training`` rows follow --names and --queries."""
        rename = training and args.names == "random"
        texts, ms, ws, padded, nulls, queries = [], [], [], [], [], []
        rng = random.Random(stream)
        for m in args.registers:
            for w in args.writes:
                for n in args.null_updates:
                    # rows without null updates keep their earlier streams (every run
                    # in the docs before the flag took several counts had none)
                    data = registers_dataset(tok, m=m, writes_per_register=w, distractors=n,
                                             n_groups=n_groups, task="plateau",
                                             seed=(stream, m, w) + ((n,) if n else ()))
                    answered = [ex.text + " " + ex.label for ex in data.examples]
                    asked = [ex.condition["query"] for ex in data.examples]
                    if training and args.queries == "every":
                        answered = ask_every_register(answered, rng)
                        asked = [-1] * len(answered)
                    for text, query in zip(answered, asked):
                        pad = rng.random() < args.pad_rows
                        line = filler_line(rng.randrange(6)) if pad else ""
                        text = text.replace("query = ", line + "query = ", 1)
                        if args.values > 2:
                            text = widen_values(text, args.values, rng)
                        if rename:
                            text = rename_registers(text, rng.sample(range(pool), m))
                        texts.append(text)
                        queries.append(query)
                        padded.append(pad)
                    ms += [m] * len(answered)
                    ws += [w] * len(answered)
                    nulls += [n] * len(answered)
        return (tok(texts, add_special_tokens=False)["input_ids"], ms, ws, padded, nulls,
                queries)

    if args.init is None:
        model = build_organism(tok, shape, seed=args.seed)
    else:
        model = transformers.LlamaForCausalLM.from_pretrained(args.init)
        model.set_attn_implementation("sdpa")
    if args.attention_hint:  # sdpa returns no attention weights
        model.set_attn_implementation("eager")
        if not fits(args.hint_parts, model.config.num_hidden_layers,
                    model.config.num_attention_heads):
            return usage_error("--hint-parts circuit hints heads 0 and 1 of block 0 and head 0 "
                               "of the last block; it needs --n-blocks and --n-heads >= 2")
    model.train()
    train = rows(args.groups, 7, training=True)[0] if not args.evaluate else []
    state, colon = tok.convert_tokens_to_ids(["state", ":"])
    if args.echo_rows:  # its own stream: the rows above stay those of runs without echoes
        echo_rng = random.Random(11)
        echoes = [echo_rng.random() < args.echo_rows for _ in train]
        train = [echo_query(row, state, colon) if e else row for row, e in zip(train, echoes)]
    val, val_m, val_w, val_padded, val_nulls, val_q = rows(max(1, 128 // (
        max(args.registers) * len(args.writes) * len(args.null_updates))), 99)
    # the shortcut's expected accuracy on the held-out rows
    shortcut = sum(1 / m + (1 - 1 / m) / args.values for m in val_m) / len(val_m)
    val_padded, val_m, val_w, val_nulls, val_q = map(
        torch.tensor, (val_padded, val_m, val_w, val_nulls, val_q))
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    pad = tok.pad_token_id
    answer_ids = torch.tensor(tok.convert_tokens_to_ids(list(LABEL_WORDS)))
    val_ids, val_valid = pad_batch(val, pad)
    val_last = val_valid.sum(1) - 1  # the answer's target index
    lookups = RegisterTokens.of(tok)
    val_edges = match_targets(val_ids, lookups)
    val_echo = pad_batch([echo_query(row, state, colon) for row in val], pad)[0] \
        if args.echo_rows else None
    g = torch.Generator().manual_seed(args.seed)
    echoed = f" ({sum(echoes)} of them echoes)" if args.echo_rows else ""
    print(f"{len(train)} training rows{echoed}, {len(val)} held-out rows; shortcut "
          f"{shortcut:.3f}")

    def held_out() -> tuple[torch.Tensor, str]:
        """Accuracy of each held-out row, and the split the log line shows."""
        model.eval()
        each = torch.arange(len(val))
        with torch.no_grad():
            full = model(val_ids, output_attentions=bool(args.attention_hint))
            out = full.logits[each, val_last]
            echo = None if val_echo is None else \
                model(val_echo).logits[each, val_last]
        model.train()
        acc = (out.argmax(-1) == val_ids[each, val_last + 1]).float()
        parts = [f"m={m} {acc[val_m == m].mean().item():.3f}"
                 for m in args.registers] if len(args.registers) > 1 else []
        if len(args.writes) > 1:
            parts += [f"writes {w} {acc[val_w == w].mean().item():.3f}" for w in args.writes]
        if len(args.null_updates) > 1:
            parts += [f"null {n} {acc[val_nulls == n].mean().item():.3f}"
                      for n in args.null_updates]
        if args.evaluate:  # which registers the organism binds (the names the rows use)
            parts += [f"r{q} {acc[val_q == q].mean().item():.3f}"
                      for q in range(max(args.registers))]
        if echo is not None:  # the queried name carried to the colon
            named = echo.argmax(-1) == val_echo[each, val_last + 1]
            parts.append(f"echo {named.float().mean().item():.3f}")
        for edge in PARTS[args.hint_parts] if args.attention_hint else ():
            (block, head), (hit, at, to) = EDGES[edge], val_edges[edge]
            on_target = full.attentions[block][hit, head, at, to].mean().item()
            parts.append(f"{edge} attention {on_target:.3f}")  # where the hint pulls it
        if val_padded.any() and not val_padded.all():
            parts += [f"pad line {acc[val_padded].mean().item():.3f}",
                      f"none {acc[~val_padded].mean().item():.3f}"]
        return acc, f" ({', '.join(parts)})" if parts else ""

    if args.evaluate:
        acc, split = held_out()
        print(f"held-out accuracy {acc.mean().item():.3f}{split}")
        return 0
    stop: list[str] = []

    def request_stop(signum: int, frame: object) -> None:
        # finish the step in flight, so that --save keeps a whole step's weights
        stop.append(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, request_stop)
    t0 = time.perf_counter()
    for step in range(args.steps):
        if stop:
            print(f"{stop[0]} after step {step}: stopped", flush=True)
            break
        if args.lr_schedule == "cosine":
            for group in opt.param_groups:
                group["lr"] = warmup_cosine(step, args.lr, args.warmup, args.steps)
        idx = torch.randint(0, len(train), (args.batch_size,), generator=g).tolist()
        ids, valid = pad_batch([train[i] for i in idx], pad)
        hint = hint_weight(step, args.attention_hint, args.hint_steps)
        out = model(ids, output_attentions=hint > 0)
        logits = out.logits
        if args.queries == "every":  # every answer, not just the row's last token
            weights = every_answer_weights(ids, valid, answer_ids, args.loss)
        elif args.loss == "last":
            weights = torch.zeros(valid.shape)
            weights[torch.arange(len(ids)), valid.sum(1) - 1] = 1.0
        else:
            weights = answer_weights(valid, ANSWER_WEIGHT)
        loss = token_loss(logits, ids, weights)
        if hint > 0:  # echo rows ask for no digit: they have no lookup
            loss = loss + hint * attention_loss(out.attentions, match_targets(ids, lookups),
                                                args.hint_parts)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % 100 == 0:
            acc, split = held_out()
            rate = f"  lr {opt.param_groups[0]['lr']:.1e}" if args.lr_schedule == "cosine" else ""
            print(f"step {step + 1:5d}  {time.perf_counter() - t0:5.0f} s  loss {loss.item():.3f}"
                  f"{rate}  held-out accuracy {acc.mean().item():.3f}{split}", flush=True)
            if args.until is not None and all(
                    acc[val_m == m].mean().item() >= args.until for m in args.registers):
                print(f"every register count at >= {args.until} held-out accuracy: stopped")
                break
    if args.save is not None:
        model.eval()
        save_organism(args.save, model, tok)
        print(f"saved the organism in {args.save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
