"""The fingerprint the same-batch check compares over a tensor / pipeline group (``same_batch.py``; the
check itself on 2 ranks: ``test_model_parallel.py``)."""
from __future__ import annotations

import torch

from atorch.auto.opt_lib.same_batch import input_fingerprint, same_fingerprint


def test_equal_inputs_agree_and_different_ones_do_not():
    ids = torch.randint(0, 100, (4, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 12, dtype=torch.bool)
    mine = input_fingerprint((ids,), {"attention_mask": mask, "labels": ids})
    assert torch.equal(mine, input_fingerprint((ids.clone(),), {"labels": ids.clone(), "attention_mask": mask}))
    others = [((ids.flip(0),), {"attention_mask": mask, "labels": ids.flip(0)}),  # the same rows, reordered
              ((ids + 1,), {"attention_mask": mask, "labels": ids + 1}),
              ((ids,), {"attention_mask": mask}),  # a tensor fewer
              ((ids[:2],), {"attention_mask": mask[:2], "labels": ids[:2]})]
    for args, kwargs in others:
        assert not torch.equal(mine, input_fingerprint(args, kwargs)), (args, kwargs)


def test_scalars_empty_tensors_and_non_tensors_are_read_without_error():
    got = input_fingerprint((torch.tensor(3.0), torch.zeros(0, 5), "text", None), {"n": 2})
    assert got.tolist() == [2.0, 1.0, 3.0, 3.0, 0.0, 0.0]


def test_inputs_holding_nan_or_both_infinities_agree_with_themselves():
    """A batch with NaN (missing values the model masks itself) or +inf and -inf in one tensor would sum to
    NaN, which equals nothing: the same batch on every rank was refused. Its finite values are summed and
    where the others sit counted: the same batch agrees, a different one (rows swapped, a shorter batch, the
    NaN in another row, the infinities swapped) does not."""
    features = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    features[1, 2] = float("nan")
    bias = torch.tensor([[0.0, float("-inf")], [float("inf"), 0.0]])
    mine = input_fingerprint((features, bias), {})
    assert mine.isfinite().all()
    assert same_fingerprint(mine, input_fingerprint((features.clone(), bias.clone()), {}))
    assert not same_fingerprint(mine, input_fingerprint((features.flip(0), bias), {}))
    assert not same_fingerprint(mine, input_fingerprint((features[:2], bias), {}))
    moved = features.clone()
    moved[1, 2], moved[2, 2] = moved[2, 2], float("nan")  # the NaN in another row
    assert not same_fingerprint(mine, input_fingerprint((moved, bias), {}))
    assert not same_fingerprint(mine, input_fingerprint((features, bias.flip(0)), {}))
