"""The fingerprint the same-batch check compares over a tensor / pipeline group (``same_batch.py``; the
check itself on 2 ranks: ``test_model_parallel.py``)."""
from __future__ import annotations

import torch

from atorch.auto.opt_lib.same_batch import input_fingerprint


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
    assert got.tolist() == [2.0, 1.0, 3.0, 3.0]
