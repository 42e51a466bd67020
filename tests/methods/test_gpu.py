"""GPU-only checks: nccl, bf16 / fp16 amp, flash attention through SDPA, torch.compile and the
allocator's memory figures on CUDA. Every test skips with a reason on a machine without CUDA; run
them on a GPU machine (``pytest -m gpu``) whenever one is available.

One GPU holds one nccl rank, so the process-group tests run at world size 1 (the collectives,
FSDP2 and the optimizer wrappers still go through nccl).
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from atorch.testing.launcher import run_distributed
from atorch.testing.training import relative_difference, train_gpt, weight_difference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")]

BF16 = ("amp_native", {"dtype": torch.bfloat16})
FP16 = ("amp_native", {"dtype": torch.float16})
LOW_TOL = 2e-2
FP32_TOL = 1e-5
WRAP = {"atorch_wrap_cls": ("GPTBlock",)}
ADAMW = {"optim_func": torch.optim.AdamW, "optim_args": {"lr": 1e-3}}
# torch's own default on CUDA, named so that atorch keeps it: the reference the fused kernel is checked against
FOREACH_ADAMW = {"optim_func": torch.optim.AdamW, "optim_args": {"lr": 1e-3, "foreach": True}}
FUSED_CASES = {
    "adamw": [], "ddp_adamw": ["parallel_mode"], "zero1_adamw": ["parallel_mode", "zero1"],
    "fsdp_adamw": ["parallel_mode", ("fsdp", WRAP)], "fsdp_bf16_adamw": ["parallel_mode", BF16, ("fsdp", WRAP)],
    # fp16's GradScaler hands a fused optimizer its found-inf flag instead of skipping the step itself
    "ddp_fp16_adamw": ["parallel_mode", FP16],
}


def nccl_runs() -> dict:
    """On one nccl rank: the fp32 reference and each strategy, losses and weights."""
    import torch.distributed as dist

    cases = {
        "reference": [],
        "ddp_bf16": ["parallel_mode", BF16],
        "ddp_fp16": ["parallel_mode", FP16],
        "zero1_bf16": ["parallel_mode", "zero1", BF16],
        "fsdp_bf16_ckpt": ["parallel_mode", BF16, ("checkpoint", ("GPTBlock",)),
                           ("fsdp", {"atorch_wrap_cls": ("GPTBlock",)})],
        # each block's forward compiled, under FSDP2's hooks and inside the checkpoint's recomputation
        "fsdp_bf16_ckpt_compiled": ["parallel_mode", BF16, ("checkpoint", ("GPTBlock",)),
                                    ("fsdp", {"atorch_wrap_cls": ("GPTBlock",)}), "native_dynamo"],
    }
    out = {"backend": dist.get_backend()}
    for key, strategy in cases.items():
        run = train_gpt(strategy)
        out[key] = {"losses": run["losses"], "weights": run["weights"],
                    "device": next(iter(run["result"].model.parameters())).device.type}
    fused = {"reference_foreach_adamw": ([], FOREACH_ADAMW),
             **{key: (strategy, ADAMW) for key, strategy in FUSED_CASES.items()}}
    for key, (strategy, kwargs) in fused.items():
        run = train_gpt(strategy, **kwargs)
        out[key] = {"losses": run["losses"], "weights": run["weights"], "fused": _fused_flags(run["result"].optim)}
    return out


def _fused_flags(optimizer) -> list:
    inner = optimizer.torch_optimizer
    stepper = inner.optim if isinstance(getattr(inner, "optim", None), torch.optim.Optimizer) else inner
    return [group.get("fused") for group in stepper.param_groups]


@functools.lru_cache(maxsize=1)
def _nccl_results() -> dict:
    return run_distributed(nccl_runs, 1)[0]


@pytest.mark.multirank
def test_nccl_low_precision_strategies_match_the_fp32_reference():
    got = dict(_nccl_results())
    assert got["backend"] == "nccl"
    reference = got.pop("reference")
    for key, run in got.items():
        if key == "backend" or "adamw" in key:
            continue
        assert run["device"] == "cuda", key
        loss_diff = relative_difference(run["losses"], reference["losses"])
        weight_diff = weight_difference(run["weights"], reference["weights"])
        assert loss_diff < LOW_TOL and weight_diff < LOW_TOL, (key, loss_diff, weight_diff)


@pytest.mark.multirank
def test_adamw_steps_the_fused_kernel_on_cuda_with_torchs_numerics():
    """atorch.auto.optimizer_kernels: torch's AdamW named without a kernel steps fused on CUDA (plain
    parameters, ZeroRedundancyOptimizer's, FSDP2's DTensor shards) and trains as torch's default foreach
    AdamW does (fp32: 1e-5 relative in losses and all weights; with bf16 amp 2e-2); foreach named stays."""
    got = _nccl_results()
    reference = got["reference_foreach_adamw"]
    assert not any(reference["fused"]), reference["fused"]
    for key, strategy in FUSED_CASES.items():
        run = got[key]
        assert run["fused"] and all(run["fused"]), (key, run["fused"])
        tol = LOW_TOL if BF16 in strategy or FP16 in strategy else FP32_TOL
        loss_diff = relative_difference(run["losses"], reference["losses"])
        weight_diff = weight_difference(run["weights"], reference["weights"])
        assert loss_diff < tol and weight_diff < tol, (key, loss_diff, weight_diff)


def _tiny_hf(name: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=512, n_positions=128,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                         eos_token_id=0)
        return transformers.GPT2LMHeadModel._from_config(config, attn_implementation="eager")
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=128)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager")


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_module_replace_runs_flash_attention_in_bf16(name):
    """The replaced attention must be able to run on the flash kernel (no mask materialised): with
    SDPA restricted to FLASH_ATTENTION a call that needed the math path would raise."""
    pytest.importorskip("transformers")
    from atorch.auto.opt_lib.module_replace import replace_modules

    device = torch.device("cuda")
    original = _tiny_hf(name).to(device, torch.bfloat16)
    replaced = replace_modules(copy.deepcopy(original), ("hf_attention",), torch.bfloat16, device)
    ids = torch.randint(0, 512, (4, 128), device=device)
    want = original(input_ids=ids).logits.float()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        got = replaced(input_ids=ids).logits
        got.float().pow(2).mean().backward()
    assert all(p.grad is not None for p in replaced.parameters() if p.requires_grad)
    assert relative_difference(got.float().flatten(), want.flatten()) < LOW_TOL


@pytest.mark.parametrize("strategy", [["native_dynamo"], [("native_dynamo", {"scope": "model"})],
                                      [("checkpoint", ("GPTBlock",)), "native_dynamo"]],
                         ids=["blocks", "model", "checkpointed_blocks"])
def test_native_dynamo_on_cuda_trains_like_eager(strategy):
    eager = train_gpt([])
    compiled = train_gpt(strategy)
    assert next(compiled["result"].model.parameters()).is_cuda
    assert relative_difference(compiled["losses"], eager["losses"]) < 1e-4
    assert weight_difference(compiled["weights"], eager["weights"]) < 1e-4


def test_checkpoint_lowers_the_cuda_peak_of_a_step():
    """The allocator's peak for a step of a mid-size GPT: checkpointing cuts activations on CUDA."""
    from atorch.models import GPTConfig

    config = GPTConfig(vocab_size=1024, block_size=256, n_layer=4, n_head=8, n_embd=512)
    peaks = {}
    for key, strategy in {"plain": [], "ckpt": [("checkpoint", ("GPTBlock",))]}.items():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        train_gpt(strategy, steps=2, global_batch=16, config=config)
        peaks[key] = torch.cuda.max_memory_allocated()
    assert peaks["ckpt"] < 0.9 * peaks["plain"], peaks


def test_search_on_cuda_picks_a_measured_candidate_and_predicts_its_memory(tmp_path):
    """The fully automatic search in one CUDA process: amp bf16 / fp16 and checkpointing are real
    candidates here; the memory model is checked against the allocator's peak of each dry run."""
    from atorch.auto.accelerate import auto_accelerate
    from atorch.models import GPTConfig, SyntheticTokenDataset, gpt_loss
    from atorch.testing.training import build_gpt

    config = GPTConfig(vocab_size=1024, block_size=256, n_layer=4, n_head=8, n_embd=512)
    status, result, strategy = auto_accelerate(
        build_gpt(0, config), torch.optim.AdamW, SyntheticTokenDataset(64, config.block_size, config.vocab_size),
        gpt_loss, optim_args={"lr": 1e-3}, dataloader_args={"batch_size": 16}, model_input_format="unpack_dict",
        report_dir=str(tmp_path), use_profile_cache=False, excluded=["native_dynamo"], verbose=True)
    assert status
    rows = result.args.extras["search"].rows
    print(result.args.extras["search"].table)
    measured = [r for r in rows if r.measured_memory]
    assert {r.label.split("+")[1] for r in measured} & {"amp_bf16", "amp_fp16"}
    assert all(abs(r.memory_error) < 0.15 for r in measured), result.args.extras["search"].table
