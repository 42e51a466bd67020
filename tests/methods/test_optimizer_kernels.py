"""The optimizer's kernel (``atorch.auto.optimizer_kernels``): torch's fused Adam / AdamW / SGD where the
update is the same, the user's choice kept where they made one.

The fused kernel is chosen on CUDA only; here (CPU) the multi-rank test lets it apply to CPU tensors
too (``FUSED_DEVICES`` patched inside each rank), so every place a method builds the optimizer (the
plain path, ZeroRedundancyOptimizer, zero1's sharded state over tensor-parallel DTensors, fsdp's and
zero2's DTensor shards) is driven through the fused kernel and compared with the single-process
reference that steps torch's per-parameter loop: fp32, relative difference < 1e-5 in losses and all
final weights. ``tests/methods/test_gpu.py`` checks the real CUDA case."""
from __future__ import annotations

import functools

import pytest
import torch

from atorch.auto import optimizer_kernels
from atorch.auto.optimizer_kernels import fused_kernel_refusal, optimizer_args, param_tensors
from atorch.testing import run_distributed
from atorch.testing.training import relative_difference, train_gpt, train_plainly, weight_difference
from tests.parity import assert_matches

TP2 = ("parallel_mode", ([("tensor", 2)], None))
# SGD with momentum keeps fp32 parity tight (see train_gpt); over DTensor shards, where only Adam and AdamW
# fuse, AdamW with a small step
ADAMW = {"optim_func": torch.optim.AdamW, "optim_args": {"lr": 1e-3}}
OPTIMIZER = {"zero2": ADAMW, "fsdp": ADAMW, "tensor_zero1": ADAMW, "fsdp_sgd": {}}
CASES = {
    "ddp": ["parallel_mode"],
    "zero1": ["parallel_mode", "zero1"],
    "zero2": ["parallel_mode", "zero2"],
    "zero2_nofsdp": ["parallel_mode", ("zero2", {"not_use_fsdp": True})],
    "fsdp": ["parallel_mode", ("fsdp", {"atorch_wrap_cls": ("GPTBlock",)})],
    "tensor_zero1": [TP2, "tensor_parallel", "zero1"],  # not fused: norms stay plain beside DTensor weights
    "fsdp_sgd": ["parallel_mode", ("fsdp", {"atorch_wrap_cls": ("GPTBlock",)})],  # not fused: no DTensor rule
}


def _params(*tensors: torch.Tensor) -> list:
    return [torch.nn.Parameter(t) for t in tensors]


@pytest.fixture
def cpu_fused(monkeypatch):
    monkeypatch.setattr(optimizer_kernels, "FUSED_DEVICES", frozenset({"cpu"}))


def test_cpu_parameters_keep_torchs_own_kernel():
    params = _params(torch.zeros(3))
    assert optimizer_args(torch.optim.AdamW, {"lr": 1e-3}, params) == {"lr": 1e-3}
    assert "parameters on ['cpu']" in fused_kernel_refusal(torch.optim.AdamW, {}, params)


def test_the_fused_kernel_is_chosen_for_torchs_adam_adamw_sgd(cpu_fused):
    params = _params(torch.zeros(3), torch.ones(2))
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        assert optimizer_args(cls, {"lr": 0.1}, params) == {"lr": 0.1, "fused": True}
    groups = [{"params": params[:1], "lr": 0.1}, {"params": params[1:]}]
    assert optimizer_args(torch.optim.AdamW, {}, groups) == {"fused": True}
    built = torch.optim.AdamW(groups, **optimizer_args(torch.optim.AdamW, {}, groups))
    assert all(group["fused"] for group in built.param_groups)


def test_every_form_torch_builds_an_optimizer_over_is_read(cpu_fused):
    """Tensors, (name, tensor) pairs (what ``optim_param_func`` may return) and groups of either."""
    model = torch.nn.Linear(2, 2)
    weight, bias = model.weight, model.bias
    named = list(model.named_parameters())
    forms = [[weight, bias], named, [{"params": named}], [{"params": weight}, {"params": [bias]}]]
    for form in forms:
        assert [id(t) for t in param_tensors(form)] == [id(weight), id(bias)], form
        assert optimizer_args(torch.optim.AdamW, {}, form) == {"fused": True}
    built = torch.optim.AdamW(named, **optimizer_args(torch.optim.AdamW, {}, named))
    assert built.param_groups[0]["fused"]


@pytest.mark.parametrize("optim_func, optim_args, says", [
    (functools.partial(torch.optim.AdamW, lr=0.1), {}, "is not one of torch's"),
    (lambda ps, **kw: torch.optim.AdamW(ps, **kw), {}, "is not one of torch's"),
    (type("MyAdamW", (torch.optim.AdamW,), {}), {}, "MyAdamW is not one of torch's"),
    (torch.optim.RMSprop, {}, "RMSprop is not one of torch's Adam, AdamW, SGD"),
    (torch.optim.AdamW, {"foreach": True}, "optim_args set foreach: the user's choice is kept"),
    (torch.optim.AdamW, {"fused": False}, "optim_args set fused"),
    (torch.optim.SGD, {"differentiable": False}, "optim_args set differentiable"),
])
def test_the_users_optimizer_is_built_as_named_where_the_kernel_might_differ(cpu_fused, optim_func, optim_args,
                                                                             says):
    params = _params(torch.zeros(3))
    assert says in fused_kernel_refusal(optim_func, optim_args, params)
    assert optimizer_args(optim_func, optim_args, params) == optim_args


def test_sgd_over_dtensor_shards_keeps_torchs_own_kernel(cpu_fused):
    from torch.distributed.tensor import DTensor

    fake = type("FakeShard", (DTensor,), {})  # an isinstance check is all the rule reads
    shard = torch.Tensor._make_subclass(fake, torch.zeros(3))
    assert "SGD's fused op has no DTensor sharding rule" in fused_kernel_refusal(torch.optim.SGD, {}, [shard])
    assert fused_kernel_refusal(torch.optim.AdamW, {}, [shard]) is None
    mixed = fused_kernel_refusal(torch.optim.AdamW, {}, [shard, torch.nn.Parameter(torch.zeros(2))])
    assert mixed.startswith("1 of 2 parameters are DTensors"), mixed


def test_non_floating_parameters_keep_torchs_own_kernel(cpu_fused):
    params = [torch.zeros(3), torch.zeros(3, dtype=torch.complex64)]
    assert fused_kernel_refusal(torch.optim.AdamW, {}, params) == "a parameter is not floating point"


def _plain_fp16_adamw(steps: int, **kernel: bool) -> dict:
    """Plain PyTorch: the test GPT cast to fp16, AdamW with the given kernel, train_gpt's data and loss."""
    from atorch.models import SyntheticTokenDataset, gpt_loss
    from atorch.testing.training import SMALL_GPT, build_gpt

    model = build_gpt(0).half()
    data = torch.utils.data.DataLoader(SyntheticTokenDataset(num_samples=8 * steps, seq_len=SMALL_GPT.block_size,
                                                             vocab_size=SMALL_GPT.vocab_size), batch_size=8)
    losses = train_plainly(model, data, gpt_loss, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, **kernel))
    return {"losses": losses, "weights": {k: v.float() for k, v in model.state_dict().items()}}


def test_fp16_parameters_step_adam_with_the_fused_kernel_which_updates_in_fp32():
    """half fp16 with AdamW's default eps (1e-8, which is 0 in fp16): torch's foreach update divides by zero
    wherever a gradient's second moment underflows, so every run left parameters inf after its first step.
    atorch steps it with the fused kernel (the update in fp32, on CPU too): 3 steps equal plain PyTorch's fp16
    model stepped by AdamW(fused=True) (relative difference < 1e-3, fp16) and stay finite, where the foreach
    run does not."""
    run = train_gpt([("half", "fp16")], steps=3, optim_func=torch.optim.AdamW, optim_args={"lr": 1e-3})
    assert all(group["fused"] for group in run["result"].optim.param_groups)
    assert all(torch.isfinite(w).all() for w in run["weights"].values())
    reference = _plain_fp16_adamw(3, fused=True)
    assert relative_difference(run["losses"], reference["losses"]) < 1e-3, (run["losses"], reference["losses"])
    assert weight_difference(run["weights"], reference["weights"]) < 1e-3
    foreach = _plain_fp16_adamw(1, foreach=True)
    assert any(not torch.isfinite(w).all() for w in foreach["weights"].values()), "the foreach update stayed finite"


@pytest.mark.parametrize("optim_func, optim_args, says", [
    (torch.optim.RMSprop, {"lr": 1e-3}, "RMSprop would update float16 parameters with eps=1e-08, which is 0 in"),
    (torch.optim.AdamW, {"lr": 1e-3, "foreach": True}, "AdamW would update float16.*cannot step these parameters"),
])
def test_an_fp16_update_that_would_divide_by_zero_is_refused_when_the_optimizer_is_built(optim_func, optim_args,
                                                                                           says):
    from atorch.errors import InputError

    with pytest.raises(InputError, match=says):
        train_gpt([("half", "fp16")], steps=1, optim_func=optim_func, optim_args=optim_args)
    run = train_gpt([("half", "fp16")], steps=1, optim_func=optim_func, optim_args={**optim_args, "eps": 1e-4})
    assert all(torch.isfinite(w).all() for w in run["weights"].values())


def _fused_groups(optimizer) -> list:
    """The ``fused`` flag of every parameter group of the torch optimizer(s) that step."""
    inner = optimizer.torch_optimizer
    # ZeroRedundancyOptimizer steps its ``optim``, zero1's sharded state over DTensors its ``inner``
    steppers = [s for s in (getattr(inner, "optim", None), getattr(inner, "inner", None))
                if isinstance(s, torch.optim.Optimizer)] or [inner]
    return [group.get("fused") for s in steppers for group in s.param_groups]


def fused_on_cpu_ranks(cases: dict) -> dict:
    optimizer_kernels.FUSED_DEVICES = frozenset({"cpu"})
    out = {}
    for key, strategy in cases.items():
        run = train_gpt(strategy, steps=3, **OPTIMIZER.get(key, {}))
        out[key] = {"losses": run["losses"], "weights": run["weights"],
                    "fused": _fused_groups(run["result"].optim)}
    return out


@pytest.mark.multirank
def test_every_method_steps_the_fused_kernel_with_the_references_numerics():
    references = {"sgd": train_gpt([], steps=3), "adamw": train_gpt([], steps=3, **ADAMW)}
    for rank, per_rank in enumerate(run_distributed(fused_on_cpu_ranks, 2, CASES, timeout_s=600)):
        for key, run in per_rank.items():
            fused = key not in ("fsdp_sgd", "tensor_zero1")
            assert run["fused"] and all(bool(f) == fused for f in run["fused"]), (
                f"rank {rank} {key}: groups stepped with fused={run['fused']}")
            reference = references["adamw" if OPTIMIZER.get(key) is ADAMW else "sgd"]
            assert_matches(run, reference, CASES[key], f"rank {rank}, {key}")
