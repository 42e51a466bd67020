"""A model with a 0-dim parameter (CLIP's logit_scale) under fp16 amp and a sharding method: fully_shard
leaves the scalar replicated as a plain tensor beside the DTensor shards, and the grad scaler's fused
unscale once read the mixed gradient list as all DTensors (AttributeError 'placements'). Losses and the
scalar itself over 3 SGD steps on 2 gloo ranks against the single-process fp16 amp run with the same
seed and global batch (relative difference < 2e-2, the low-precision tolerance of the other tests)."""
from __future__ import annotations

import pytest
import torch

import atorch
from atorch.testing import run_distributed
from atorch.testing.hf_models import ZOO
from atorch.testing.training import relative_difference
from atorch.utils.batch import call_with_batch

pytestmark = pytest.mark.multirank

# a first loss scale no step overflows at: under fsdp / zero2 the gradients are fp16 (param_dtype) before
# their fp32 reduction, where autocast keeps fp32 ones, so 2**16 overflows there first and the two runs
# would skip different steps (dynamic loss scaling doing its job, not a difference in the update)
FP16 = ("amp_native", {"dtype": torch.float16, "init_scale": 128.0})
LOW_TOL = 2e-2


def clip_fp16_steps(strategy: list, steps: int = 3) -> dict:
    import torch.distributed as dist

    clip = ZOO["clip"]
    torch.manual_seed(0)
    _, result, _ = atorch.auto_accelerate(
        clip.build(), torch.optim.SGD, clip.make_dataset(8 * steps), clip.loss_func, optim_args={"lr": 0.1},
        dataloader_args={"batch_size": 8}, model_input_format=clip.input_format, load_strategy=strategy)
    losses = []
    for _, batch in zip(range(steps), result.dataloader):
        loss = result.loss_func(batch, call_with_batch(result.model, batch, clip.input_format))
        result.optim.backward(loss)
        result.optim.step()
        result.optim.zero_grad()
        value = loss.detach().float().clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(float(value))
    scale = next(p for name, p in result.model.named_parameters() if name.endswith("logit_scale"))
    return {"losses": losses, "logit_scale": float(scale.detach()), "skipped": result.optim.skipped_steps}


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_distributed(clip_fp16_steps, 1, [FP16])[0]


@pytest.mark.parametrize("sharding", ["zero2", "fsdp"])
def test_fp16_amp_with_sharding_trains_a_model_with_a_scalar_parameter_like_one_process(reference, sharding):
    got = run_distributed(clip_fp16_steps, 2, ["parallel_mode", sharding, FP16])
    assert got[0] == got[1]  # every rank reports the same mean losses and the same replicated scalar
    assert got[0]["skipped"] == reference["skipped"] == 0
    assert relative_difference(got[0]["losses"], reference["losses"]) < LOW_TOL, (got[0], reference)
    assert relative_difference([got[0]["logit_scale"]], [reference["logit_scale"]]) < LOW_TOL, (got[0], reference)
