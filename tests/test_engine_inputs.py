"""Strict inputs of the engine and of Recirculation: nothing is silently coerced
(issue: float ids ran as truncated ints, bool ids as 0/1, a longer mask was cut, a float
mask 0.1 counted as True, alpha="0.5" failed only at run time, True passed as a number)."""

from __future__ import annotations

import pytest
import torch

from probekit import Recirculation, RecirculationPath


def test_float_ids_are_rejected(tiny_engine):
    with pytest.raises(ValueError, match=r"input_ids must be integer token ids; got float32"):
        tiny_engine.run(torch.tensor([[1.7, 2.9, 3.2, 4.99]]))
    with pytest.raises(ValueError, match=r"input_ids must be integer token ids; got 1\.5"):
        tiny_engine.run([[1, 1.5, 3]])


def test_bool_ids_are_rejected(tiny_engine):
    with pytest.raises(ValueError, match=r"input_ids must be integer token ids; got bool"):
        tiny_engine.run(torch.tensor([[True, False, True]]))
    with pytest.raises(ValueError, match=r"input_ids must be integer token ids; got True"):
        tiny_engine.run([[True, 2, 3]])


def test_mask_must_match_the_sequence_exactly(tiny_engine):
    rec = Recirculation(3, 1, 0.1)
    with pytest.raises(ValueError, match=r"mask must be \[seq\] or \[batch, seq\] = 1 x 4"):
        tiny_engine.run([[1, 2, 3, 4]], rec, mask=torch.ones(6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask must be \[seq\] or \[batch, seq\] = 1 x 4"):
        tiny_engine.run([[1, 2, 3, 4]], rec, mask=torch.ones(3, dtype=torch.bool))


def test_mask_must_be_boolean(tiny_engine):
    rec = Recirculation(3, 1, 0.1)
    with pytest.raises(ValueError, match=r"mask must be boolean \(or 0/1 integers\); got float"):
        tiny_engine.run([[1, 2, 3, 4]], rec, mask=torch.tensor([0.1, 0.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match=r"mask must be boolean \(or 0/1 integers\); got 2"):
        tiny_engine.run([[1, 2, 3, 4]], rec, mask=torch.tensor([0, 2, 1, 0]))
    # 0/1 integers are an unambiguous boolean mask and stay accepted
    a = tiny_engine.run([[1, 2, 3, 4]], rec, mask=torch.tensor([0, 1, 1, 0]))
    b = tiny_engine.run([[1, 2, 3, 4]], rec, mask=torch.tensor([False, True, True, False]))
    assert torch.equal(a.log_probs, b.log_probs)


@pytest.mark.parametrize("kw, message", [
    ({"alpha": "0.5"}, r"alpha must lie in \[0, 1\]; got '0.5'"),
    ({"alpha": True}, r"alpha must lie in \[0, 1\]; got True"),
    ({"beta": "1"}, r"beta must lie in \[0, 1\] \(or None for 1 - alpha\); got '1'"),
    ({"alpha": float("nan")}, r"alpha must lie in \[0, 1\]; got nan"),
])
def test_path_numbers_are_checked_at_construction(kw, message):
    with pytest.raises(ValueError, match=message):
        RecirculationPath(3, 1, **{"alpha": 0.1, **kw})
    with pytest.raises(ValueError, match=message):
        Recirculation(3, 1, **{"alpha": 0.1, **kw})


@pytest.mark.parametrize("name", ["ramp", "iterations"])
def test_bool_is_not_an_integer_option(name):
    with pytest.raises(ValueError, match=rf"{name} must be an integer"):
        Recirculation(3, 1, 0.1, **{name: True})


def test_an_unknown_hook_name_is_one_clear_error(tiny_engine):
    with pytest.raises(ValueError, match=r"unknown hook 'blocks\.1\.hook_resid_prex': "
                                         r"TransformerLens names look like"):
        tiny_engine.run([[1, 2, 3]], fwd_hooks=[("blocks.1.hook_resid_prex", lambda a, hook: a)])
