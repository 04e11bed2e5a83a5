"""Which parts of register binding has an organism learned? Probes per depth, part by part.

Answering ``query = r5`` / ``Value:`` from ``r5 = 1`` earlier in the row takes three
parts (associative recall: the register name is the key, its digit the value): each
value token must carry the name of the register it was assigned to (the name sits two
tokens before it), the final colon must carry the queried name (three tokens before it),
and the colon must match the two and read the digit. ``DepthProbe`` (grouped by update
schedule, as the sweeps' probes) measures at every depth how well a linear probe reads

- the register name at each value token (chance 1/m);
- the queried register's name at the final colon (chance 1/m);
- the answer at the final colon (chance 0.50).

It runs on an organism folder (an HF Llama folder with the task tokenizer, as
``register_plateau.py --save`` writes), plain pass, on fresh rows of ``registers_dataset``'s
format (``--registers`` m, ``--writes`` per register, ``--null-updates`` counts, each with
its own ``--groups``).

    python experiments/register_parts.py once --registers 8 --writes 1
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
import tyro

from probekit.commands.common import script_error


@dataclasses.dataclass(frozen=True)
class Args:
    organism: tyro.conf.Positional[str]
    """an organism folder (an HF folder with config.json, e.g. a register_plateau --save)"""
    registers: int = 8
    """register count m of the rows"""
    writes: int = 1
    """writes per register of the rows"""
    null_updates: tuple[int, ...] = (0, 2, 4)
    """scratch null updates of the rows (each count its own groups)"""
    groups: int = 16
    """schedules per null-update count (each: the schedule and its complement, m queries)"""
    seed: int = 123
    """the rows' random stream (register_plateau's training rows use 7, its held-out 99)"""


def value_positions(ids: list[int], names: dict[int, int], equals: int) -> list[tuple[int, int]]:
    """``(position, register)`` of every value token of a row: the token two after a
    register name that is followed by ``=`` (the query line's name is followed by a newline,
    so it is not one)."""
    return [(p + 2, names[ids[p]]) for p in range(len(ids) - 2)
            if ids[p] in names and ids[p + 1] == equals]


def residuals(model: transformers.LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """``[batch, n_blocks + 1, tokens, d_model]``: the residual stream at every depth, as
    SEMANTICS.md counts them (depth 0 the embedding, depth r the output of block r - 1;
    HF's last ``hidden_states`` entry is after the final norm, so the top depth is read
    from the norm's input instead)."""
    top: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_pre_hook(lambda _, args: top.append(args[0]))
    try:
        with torch.no_grad():
            states = model(ids, output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    return torch.stack([*states[:-1], top[0]], 1)


usage_error = functools.partial(script_error, "register_parts")


def main() -> int:
    args = tyro.cli(Args)
    if not (Path(args.organism) / "config.json").is_file():
        return usage_error(f"{args.organism} is not an organism folder (no config.json); give "
                           "the --save folder of register_plateau.py")
    if args.registers < 2 or args.writes < 1 or args.groups < 2 or min(args.null_updates) < 0:
        return usage_error("--registers must be >= 2 (one register has no name to find), "
                           "--writes >= 1, --groups >= 2 and --null-updates >= 0")
    from probekit.analysis.probing import DepthProbe
    from probekit.training.data import pad_batch
    from probekit.training.organism import REGISTER_NAMES, fit_tokenizer
    from synthetic.registers import registers_dataset

    if args.registers > REGISTER_NAMES:
        return usage_error(f"--registers must be <= {REGISTER_NAMES} (the tokenizer knows "
                           f"r0..r{REGISTER_NAMES - 1}); got {args.registers}")
    torch.set_num_threads(1)
    tok = fit_tokenizer()
    model = transformers.LlamaForCausalLM.from_pretrained(args.organism).eval()
    names = {tok.convert_tokens_to_ids(f"r{i}"): i for i in range(REGISTER_NAMES)}
    equals = tok.convert_tokens_to_ids("=")

    texts, answers, queries, groups = [], [], [], []
    for n in args.null_updates:
        data = registers_dataset(tok, m=args.registers, writes_per_register=args.writes,
                                 distractors=n, n_groups=args.groups, task="plateau",
                                 seed=(args.seed, args.registers, args.writes, n))
        texts += [ex.text for ex in data.examples]
        answers += [ex.label_id for ex in data.examples]
        queries += [ex.condition["query"] for ex in data.examples]
        groups += [f"{n}/{ex.group}" for ex in data.examples]
    ids = tok(texts, add_special_tokens=False)["input_ids"]

    colon, value, value_name, value_group, seen = [], [], [], [], set()
    for start in range(0, len(ids), 64):
        batch, _ = pad_batch(ids[start:start + 64], tok.pad_token_id)
        states = residuals(model, batch)  # right padding: no real token attends to a pad
        for row, seq in enumerate(ids[start:start + 64]):
            i = start + row
            colon.append(states[row, :, len(seq) - 1].numpy())
            history = texts[i].rpartition("query = ")[0]
            if history in seen:  # each history's value tokens once
                continue
            seen.add(history)
            for p, name in value_positions(seq, names, equals):
                value.append(states[row, :, p].numpy())
                value_name.append(name)
                value_group.append(groups[i])
    parts = {
        "name at value token": (np.stack(value), value_name, value_group),
        "queried name at colon": (np.stack(colon), queries, groups),
        "answer at colon": (np.stack(colon), answers, groups),
    }
    probes = {part: DepthProbe().fit(X, np.array(y), np.array(g))
              for part, (X, y, g) in parts.items()}
    print(f"{args.organism}: m={args.registers}, writes per register {args.writes}, "
          f"{len(texts)} rows, {len(value)} value tokens; chance " + ", ".join(
              f"{part} {probe.chance_:.3f}" for part, probe in probes.items()))
    for depth in range(len(probes["answer at colon"].accuracy_mean_)):
        print(f"depth {depth}: " + ", ".join(f"{part} {probe.accuracy_mean_[depth]:.3f}"
                                             for part, probe in probes.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
