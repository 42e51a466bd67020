"""zero1, zero2 and fsdp on real gloo ranks (2 and 4) against the single-process fp32 reference with
the same seed and global batch: each alone, with bf16 amp, with checkpoint, with gradient
accumulation 4 and with clipping (fp32: relative difference < 1e-5 in losses and all final weights;
bf16/fp16: < 2e-2); with parameter groups of (name, parameter) pairs (weight decay on matrices only);
FSDP units holding a tied parameter (T5's stacks, a tied GPT embedding). The same launch measures
per-rank parameter / gradient / optimizer-state bytes against DDP and checks that accumulation
micro-steps send no gradient collectives. DeepSpeed's ZeRO-1/2 run on CPU ranks here through its CPU
accelerator; those cases skip when it is absent."""
from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.profiler import ProfilerActivity, profile

from atorch.auto import opt_lib
from atorch.auto.opt_lib.deepspeed_zero import deepspeed_unavailable_reason, without_shared_memory_allreduce
from atorch.auto.opt_lib.fsdp import FSDPConfig, units_called, units_keeping_ties
from atorch.auto.opt_lib.tp_check import Probe
from atorch.models import GPT
from atorch.testing import run_distributed
from atorch.testing.hf_models import ZOO, zoo_model
from atorch.testing.training import SMALL_GPT, train_gpt
from tests.parity import BF16, CKPT, assert_matches, case_parts, run_suite

pytestmark = pytest.mark.multirank

HAS_DEEPSPEED = deepspeed_unavailable_reason() is None
CLIP = 0.5  # below the reference's gradient norms (0.56 .. 1.15), so clipping changes every step
ACC_BATCH = 16  # accumulation 4 on 4 ranks needs micro-batches of at least 4 samples
WRAP = {"atorch_wrap_cls": ("GPTBlock",)}
TIED_GPT = dataclasses.replace(SMALL_GPT, tie_weights=True)
METHODS = {
    "zero1": "zero1",
    "zero2": "zero2",
    "zero2_nofsdp": ("zero2", {"not_use_fsdp": True}),
    "fsdp": ("fsdp", WRAP),
}
ADAMW = {"optim_func": torch.optim.AdamW, "optim_args": {"lr": 1e-3}, "steps": 1, "measure_state": True}


def parity_cases() -> dict:
    cases: dict = {}
    for name, method in METHODS.items():
        base = ["parallel_mode", method]
        cases[name] = base
        cases[f"{name}_bf16"] = base + [BF16]
        cases[f"{name}_ckpt"] = base + [CKPT]
        cases[f"{name}_acc4"] = {"strategy": base, "accumulation": 4, "global_batch": ACC_BATCH}
        cases[f"{name}_clip"] = {"strategy": base, "max_grad_norm": CLIP}
    return cases


FSDP_OPTIONS = {
    "fsdp_fp16": ["parallel_mode", ("fsdp", WRAP), "amp_native"],
    "fsdp_half_bf16": ["parallel_mode", ("half", "bf16"), "fsdp"],
    "fsdp_cpu_offload": ["parallel_mode", ("fsdp", dict(WRAP, cpu_offload=True))],
    "fsdp_size_based_prefetch_sync": ["parallel_mode", ("fsdp", {
        "atorch_size_based_min_num_params": 4000, "forward_prefetch": True, "sync_module_states": True,
        "limit_all_gathers": True, "use_orig_params": True})],
    "fsdp_ignored_cls": ["parallel_mode", ("fsdp", dict(WRAP, atorch_ignored_cls=("LayerNorm",)))],
    # a DDP loop's accumulation: `with model.no_sync():` around every micro-step but the last
    "fsdp_acc4_no_sync": {"strategy": ["parallel_mode", ("fsdp", WRAP)], "accumulation": 4, "global_batch": ACC_BATCH,
                          "accumulate_via": "no_sync"},
    "fsdp_ignored_cls_acc4": {"strategy": ["parallel_mode", ("fsdp", dict(WRAP, atorch_ignored_cls=("LayerNorm",)))],
                              "accumulation": 4, "global_batch": ACC_BATCH},
    # native_dynamo compiles each block's forward; FSDP2's gather / reshard hooks and the checkpoint
    # wrapper stay around it
    "fsdp_ckpt_compiled": ["parallel_mode", ("fsdp", WRAP), CKPT, "native_dynamo"],
    "fsdp_clip_via_model": {"strategy": ["parallel_mode", ("fsdp", WRAP)], "max_grad_norm": CLIP, "clip_via": "model"},
    # the loop's own lr scheduler built on result.optim (LambdaLR refused anything not a torch.optim.Optimizer)
    "zero1_loop_scheduler": {"strategy": ["parallel_mode", "zero1"], "loop_scheduler": True},
    "fsdp_bf16_loop_scheduler": {"strategy": ["parallel_mode", ("fsdp", WRAP), BF16], "loop_scheduler": True},
    # torch.nn.utils.clip_grad_norm_ over a part of the parameters: that part's global norm
    "fsdp_clip_part_via_torch": {"strategy": ["parallel_mode", ("fsdp", WRAP)], "max_grad_norm": CLIP,
                                 "clip_via": "torch_part"},
    "zero2_nofsdp_clip_part_via_torch": {"strategy": ["parallel_mode", ("zero2", {"not_use_fsdp": True})],
                                         "max_grad_norm": CLIP, "clip_via": "torch_part"},
    "zero2_nofsdp_clip_via_model": {"strategy": ["parallel_mode", ("zero2", {"not_use_fsdp": True})],
                                    "max_grad_norm": CLIP, "clip_via": "model"},
    "zero2_nofsdp_fp16_clip": {"strategy": ["parallel_mode", ("zero2", {"not_use_fsdp": True}), "amp_native"],
                               "max_grad_norm": CLIP},
    # units holding a parameter tied to a module outside them (FSDP2 refuses to split a tied parameter):
    # T5's stacks share their embedding with `shared`, the tied GPT's embedding is its output layer
    "fsdp_tied_t5_stacks": {"strategy": ["parallel_mode", ("fsdp", {"atorch_wrap_cls": ("T5Stack",)})],
                            "hf_model": "t5"},
    "fsdp_tied_gpt_embedding": {"strategy": ["parallel_mode", ("fsdp", {"atorch_wrap_cls": ("Embedding", "GPTBlock")})],
                                "config": TIED_GPT},
    # an nn.Sequential the model iterates (timm's checkpoint_seq) is never called: its blocks are the units,
    # whether it is named or the size rule chooses it
    "fsdp_iterated_sequential": {"strategy": ["parallel_mode", ("fsdp", {"atorch_wrap_cls": ("Sequential",)})],
                                 "hf_model": "timm_vit_checkpoint_seq"},
    "fsdp_size_based_iterated_sequential": {
        "strategy": ["parallel_mode", ("fsdp", {"atorch_size_based_min_num_params": 20000})],
        "hf_model": "timm_vit_checkpoint_seq"},
}


def named_decay_groups(model: torch.nn.Module) -> list[dict]:
    """Parameter groups as users write them for AdamW-style decay, as (name, parameter) pairs (torch's
    optimizers take them; ZeroRedundancyOptimizer does not): decay on matrices, none and another
    learning rate on the rest."""
    decay = [(n, p) for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [(n, p) for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 0.05}]


NAMED_GROUP_CASES = {
    "zero1_named_groups": {"strategy": ["parallel_mode", "zero1"], "optim_param_func": named_decay_groups},
    "zero2_nofsdp_named_groups": {"strategy": ["parallel_mode", ("zero2", {"not_use_fsdp": True})],
                                  "optim_param_func": named_decay_groups},
    "fsdp_named_groups": {"strategy": ["parallel_mode", ("fsdp", WRAP)], "optim_param_func": named_decay_groups},
}
# zero1 over tensor-parallel (DTensor) parameters steps them with its own sharded-state optimizer
TENSOR_NAMED_GROUP_CASES = {
    "tensor2_zero1_named_groups": {
        "strategy": [("parallel_mode", ([("tensor", 2), ("data", 2)], None)), "tensor_parallel", "zero1"],
        "optim_param_func": named_decay_groups},
}
DEEPSPEED_CASES = {
    "ds_zero1": ["parallel_mode", ("zero1", {"use_ds_zero": True})],
    "ds_zero1_bf16": ["parallel_mode", ("zero1", {"use_ds_zero": True}), BF16],
    "ds_zero2_acc4_clip": {"strategy": ["parallel_mode", ("zero2", {"use_ds_zero": True})], "accumulation": 4,
                           "global_batch": ACC_BATCH, "max_grad_norm": CLIP},
    # torch.nn.utils.clip_grad_norm_ in the loop: DeepSpeed keeps the gradients in its own buffers, so
    # torch's function alone found none and never clipped; it now sets DeepSpeed's threshold
    "ds_zero1_clip_via_torch": {"strategy": ["parallel_mode", ("zero1", {"use_ds_zero": True})],
                                "max_grad_norm": CLIP, "clip_via": "torch"},
    "ds_zero2_loop_scheduler": {"strategy": ["parallel_mode", ("zero2", {"use_ds_zero": True})],
                                "loop_scheduler": True},
    # a DDP loop's accumulation: DeepSpeed's own no_sync refused ZeRO-2 (AssertionError)
    "ds_zero2_acc4_no_sync": {"strategy": ["parallel_mode", ("zero2", {"use_ds_zero": True})], "accumulation": 4,
                              "global_batch": ACC_BATCH, "accumulate_via": "no_sync", "loop_backward": True},
}
# refused with a typed error in the loop's first step, each with the words its error starts with and holds
DEEPSPEED_REFUSED = {
    # DeepSpeed's gradients are in its buffers, so a part of the parameters clipped through torch's function
    # was silently left unclipped (norm 0.0)
    "ds_zero1_clip_part_via_torch": {"strategy": ["parallel_mode", ("zero1", {"use_ds_zero": True})],
                                     "max_grad_norm": CLIP, "clip_via": "torch_part"},
    # a window accumulated without marking its boundaries: each backward's reduction replaced the last, so the
    # step had the last micro-step's gradients only (silently); by optim.backward and by the loop's own
    "ds_zero1_acc4_unmarked": {"strategy": ["parallel_mode", ("zero1", {"use_ds_zero": True})], "accumulation": 4,
                               "global_batch": ACC_BATCH, "accumulate_via": "unmarked"},
    "ds_zero2_acc4_unmarked_loop_backward": {"strategy": ["parallel_mode", ("zero2", {"use_ds_zero": True})],
                                             "accumulation": 4, "global_batch": ACC_BATCH,
                                             "accumulate_via": "unmarked", "loop_backward": True},
}
REFUSAL_WORDS = {"ds_zero1_clip_part_via_torch": ("MethodConfigError: use_ds_zero", "a part of the parameters"),
                 "ds_zero1_acc4_unmarked": ("LoopError: use_ds_zero", "earlier micro-step's gradients would be lost"),
                 "ds_zero2_acc4_unmarked_loop_backward": ("LoopError: use_ds_zero", "model.no_sync()")}
MEMORY_CASES = {
    f"memory_{name}": {"strategy": ["parallel_mode"] + ([method] if method else []), **ADAMW}
    for name, method in {"ddp": None, **METHODS}.items()
}
# which of parameters / gradients / optimizer state each method shards
SHARDS = {"zero1": ("optim_state",), "zero2": ("grads", "optim_state"), "zero2_nofsdp": ("grads", "optim_state"),
          "fsdp": ("params", "grads", "optim_state")}
GRADIENT_COLLECTIVES = ("allreduce", "all_reduce", "reduce_scatter", "gloo:reduce", "c10d::reduce_")


def _reference_key(case) -> tuple:
    _, kwargs = case_parts(case)
    part = kwargs.get("clip_via") == "torch_part"  # clips a part; every other clip_via clips all
    return (kwargs.get("global_batch", 8), kwargs.get("max_grad_norm"), kwargs.get("hf_model"),
            repr(kwargs.get("config")), kwargs.get("optim_param_func"), "torch_part" if part else "optimizer",
            kwargs.get("loop_scheduler", False))


_REFERENCES: dict = {}


def reference_for(case) -> dict:
    key = _reference_key(case)
    if key not in _REFERENCES:
        _REFERENCES[key] = train_gpt([], global_batch=key[0], max_grad_norm=key[1], hf_model=key[2],
                                     config=case_parts(case)[1].get("config"), optim_param_func=key[4],
                                     clip_via=key[5], loop_scheduler=key[6])
    return _REFERENCES[key]


def micro_step_collectives(strategy) -> dict:
    """Collectives seen in the backward of a non-boundary micro-step and of the boundary one."""
    run = train_gpt(strategy, steps=1)
    result = run["result"]
    batch = result.prepare_input(next(iter(result.dataloader)))
    seen = {}
    for boundary in (False, False, True):
        result.optim.set_gradient_accumulation_boundary(boundary)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss = result.loss_func(batch, result.model(**batch))
            result.optim.backward(loss)
        names = sorted({e.name for e in prof.events() if e.name.startswith(("gloo:", "c10d::"))})
        seen.setdefault("boundary" if boundary else "micro", []).append(names)
    result.optim.zero_grad()
    return seen


def without_deepspeed() -> str:
    """zero1 with use_ds_zero when DeepSpeed cannot be imported: the error users get."""
    sys.modules["deepspeed"] = None  # makes `import deepspeed` raise ImportError in this process
    deepspeed_unavailable_reason.cache_clear()
    try:
        train_gpt(["parallel_mode", ("zero1", {"use_ds_zero": True})], steps=1)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


# units fully_shard makes when none is named: the model's layers, found from its structure ("auto" too);
# () asks for the root alone
UNIT_CASES = {
    "fsdp_default": (["parallel_mode", "fsdp"], None, ["GPT"] + ["GPTBlock"] * SMALL_GPT.n_layer),
    "fsdp_auto_torch_encoder": (["parallel_mode", ("fsdp", {"atorch_wrap_cls": "auto"})], "torch_encoder",
                                ["TorchEncoderLM"] + ["TransformerEncoderLayer"] * 4),
    "zero2_default_timm_vit": (["parallel_mode", "zero2"], "timm_vit", ["TimmViT"] + ["Block"] * 4),
    "fsdp_root_alone": (["parallel_mode", ("fsdp", {"atorch_wrap_cls": ()})], None, ["GPT"]),
}


def fsdp_units(strategy: list, hf_model) -> list[str]:
    """The classes fully_shard made units of (FSDP2 subclasses each one), in module order (the root first)."""
    model = train_gpt(strategy, steps=1, hf_model=hf_model)["result"].model
    return [next(c for c in type(m).__mro__ if not issubclass(c, FSDPModule)).__name__
            for m in model.modules() if isinstance(m, FSDPModule)]


def launch(cases: dict, comm_strategies: dict) -> dict:
    out = run_suite(cases)
    if comm_strategies:  # world 2
        out["units"] = {key: fsdp_units(strategy, model) for key, (strategy, model, _) in UNIT_CASES.items()}
    out["collectives"] = {key: micro_step_collectives(s) for key, s in comm_strategies.items()}
    out["without_deepspeed"] = without_deepspeed()
    return out


def _check(results: list, cases: dict, world: int) -> None:
    for key, case in cases.items():
        if key in DEEPSPEED_REFUSED:
            starts, holds = REFUSAL_WORDS[key]
            for per_rank in results:
                error = per_rank[key].get("error", "no error")
                assert error.startswith(starts) and holds in error, error
            continue
        if key.startswith("memory_"):
            continue
        strategy, _ = case_parts(case)
        for rank, per_rank in enumerate(results):
            assert_matches(per_rank[key], reference_for(case), strategy, f"world {world}, rank {rank}, {key}")


def _check_memory(results: list, world: int) -> None:
    for rank, per_rank in enumerate(results):
        ddp = per_rank["memory_ddp"]["state_bytes"]
        for name, kinds in SHARDS.items():
            held = per_rank[f"memory_{name}"]["state_bytes"]
            for kind in kinds:
                ratio = held[kind] / ddp[kind]
                assert ratio <= 1.1 / world, (f"rank {rank} {name}: {kind} {held[kind]} B is {ratio:.3f} of DDP's "
                                              f"(limit {1.1 / world:.3f})")


def _check_collectives(results: list) -> None:
    for per_rank in results:
        for key, seen in per_rank["collectives"].items():
            for names in seen["micro"]:
                grads = [n for n in names if any(c in n for c in GRADIENT_COLLECTIVES)]
                assert not grads, f"{key}: gradient collectives {grads} inside an accumulation window"
            if key == "zero2":  # parameters stay gathered between micro-steps: only the first gathers
                assert seen["micro"][1] == [], f"zero2: second micro-step communicates {seen['micro'][1]}"
            assert any(any(c in n for c in GRADIENT_COLLECTIVES) for n in seen["boundary"][0]), (
                f"{key}: boundary did not reduce")


def _cases(world: int) -> dict:
    cases = {**parity_cases(), **MEMORY_CASES}
    cases.update(TENSOR_NAMED_GROUP_CASES if world == 4 else NAMED_GROUP_CASES)
    if world == 2:
        cases.update(FSDP_OPTIONS)
        if HAS_DEEPSPEED:
            cases.update(DEEPSPEED_CASES)
            cases.update(DEEPSPEED_REFUSED)
    return cases


@pytest.mark.parametrize("world", [2, 4])
def test_sharding_methods_match_reference_and_shard_state(world):
    cases = _cases(world)
    comm = {name: ["parallel_mode", method] for name, method in METHODS.items()} if world == 2 else {}
    results = run_distributed(launch, world, cases, comm, timeout_s=900)
    _check(results, cases, world)
    _check_memory(results, world)
    _check_collectives(results)
    for per_rank in results:
        error = per_rank["without_deepspeed"]
        assert error.startswith("RequirementError") and "DeepSpeed" in error and "zero1" in error, error
        for key, (_, _, expected) in UNIT_CASES.items():
            assert world != 2 or per_rank["units"][key] == expected, (key, per_rank["units"][key])
        returned = per_rank["fsdp"]["strategy"].get("fsdp")  # plain data after pickling: normalize it again
        assert opt_lib.get_optimization("fsdp").normalize(returned) == FSDPConfig(atorch_wrap_cls=("GPTBlock",))


def test_a_unit_holding_a_tied_parameter_is_sharded_by_its_parts():
    """A block whose parameter another module outside it also holds is replaced by its parts, down to
    where none is tied outside; the tied leaf stays with the root (FSDP2 refuses a split tie)."""
    t5 = ZOO["t5"].build()
    stacks = [m for m in t5.modules() if type(m).__name__ == "T5Stack"]
    units = units_keeping_ties(t5, stacks)
    assert [type(u).__name__ for u in units] == ["T5Block"] * sum(type(m).__name__ == "T5Block" for m in t5.modules())
    gpt = GPT(TIED_GPT)
    assert units_keeping_ties(gpt, [gpt.wte, gpt.wpe, *gpt.blocks]) == [gpt.wpe, *gpt.blocks]
    untied = GPT(SMALL_GPT)
    assert units_keeping_ties(untied, [untied.wte, *untied.blocks]) == [untied.wte, *untied.blocks]


def test_an_iterated_sequential_is_sharded_by_its_called_parts():
    """A Sequential unit the model calls stays one unit; one it iterates (in training mode only, as
    timm's checkpoint_seq under HF-style ``if self.training``) becomes its blocks. The probe leaves the
    model's values, mode and RNG as they were. A module without a forward becomes its parts (those
    holding parameters)."""
    for name, iterated in (("timm_vit", False), ("timm_vit_checkpoint_seq", True)):
        model = zoo_model(name).build()
        zoo = zoo_model(name)
        probe = Probe(zoo.make_dataset(1, 0)[0][None], lambda m, x: m(x))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        rng = torch.get_rng_state()
        units = units_called(model, [model.blocks], lambda: probe)
        assert units == (list(model.blocks) if iterated else [model.blocks]), name
        assert units_called(model, [model.blocks], lambda: None) == [model.blocks]
        assert model.training and torch.equal(torch.get_rng_state(), rng)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    failing = Probe(None, lambda m, x: m(torch.zeros(1, 5)))  # fails on the model: the blocks stay as given
    assert units_called(model, [model.blocks], lambda: failing) == [model.blocks]
    holder = torch.nn.Module()  # no forward of its own: never called, whatever the probe
    holder.first, holder.second = torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU())
    assert units_called(holder, [holder], lambda: None) == [holder.first]


def _units_when_one_rank_s_probe_fails() -> list[str]:
    model = zoo_model("timm_vit_checkpoint_seq").build()
    row = zoo_model("timm_vit_checkpoint_seq").make_dataset(1, 0)[0][None]
    if torch.distributed.get_rank() == 1:  # rank-local: this rank's row fails while rank 0's runs
        row = torch.zeros(1, 5)
    units = units_called(model, [model.blocks], lambda: Probe(row, lambda m, x: m(x)))
    return [type(u).__name__ for u in units]


def test_a_probe_failing_on_one_rank_leaves_every_rank_the_same_units():
    """The row fails on rank 1 only while rank 0 is in the agreeing all-reduce: both keep the blocks as
    given (the same units on every rank, no rank left waiting)."""
    assert run_distributed(_units_when_one_rank_s_probe_fails, 2, timeout_s=120) == [["Sequential"]] * 2


def test_clipping_changes_the_reference():
    """The clip cases would pass without clipping only if clipping did nothing: it must not; clipping a
    part of the parameters (all but the embedding) is not the same as clipping them all."""
    clipped, plain = reference_for({"strategy": [], "max_grad_norm": CLIP}), reference_for([])
    assert all(norm > CLIP for norm in clipped["grad_norms"]), clipped["grad_norms"]
    assert clipped["losses"][-1] != pytest.approx(plain["losses"][-1], rel=1e-4)
    part = reference_for({"strategy": [], "max_grad_norm": CLIP, "clip_via": "torch_part"})
    assert all(norm > CLIP for norm in part["grad_norms"]), part["grad_norms"]
    assert part["losses"][-1] != pytest.approx(clipped["losses"][-1], rel=1e-4)


@pytest.mark.skipif(HAS_DEEPSPEED, reason="DeepSpeed is installed; its cases run in the sharding launch")
def test_deepspeed_absent_is_reported():
    assert "DeepSpeed" in (deepspeed_unavailable_reason() or "")


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed")
def test_deepspeeds_backend_is_made_without_its_shared_memory_allreduce():
    """atorch's engines reduce through torch.distributed: DeepSpeed's CPU shared-memory all-reduce
    extension (its inference all-reduce only) is neither built nor started in their processes."""
    from deepspeed.comm.torch import build_shm_op

    without_shared_memory_allreduce()
    assert build_shm_op() is None


@pytest.mark.parametrize("name, config, words", [
    ("fsdp", {"atorch_wrap_cls": ("GPTBlock",), "shard_everything": True}, ["shard_everything", "atorch_wrap_cls"]),
    ("fsdp", {"atorch_wrap_cls": ("GPTBlock",), "atorch_size_based_min_num_params": 10}, ["either"]),
    ("fsdp", {"sharding_strategy": "HYBRID_SHARD"}, ["HYBRID_SHARD", "FULL_SHARD"]),
    ("fsdp", {"cpu_offload": "yes"}, ["cpu_offload", "bool"]),
    ("zero1", {"use_ds": True}, ["use_ds", "use_ds_zero"]),
    ("zero1", "deepspeed", ["dict"]),
    ("zero2", {"use_ds_zero": True, "not_use_fsdp": True}, ["one"]),
    ("zero2", {"not_use_fsdp": True, "atorch_wrap_cls": ("GPTBlock",)}, ["FSDP"]),
    ("zero2", {"reshard_after_forward": True}, ["ZeRO-3"]),
])
def test_bad_sharding_configs_name_the_problem(name, config, words):
    from atorch.errors import MethodConfigError

    with pytest.raises(MethodConfigError) as info:
        opt_lib.get_optimization(name).normalize(config)
    for word in words:
        assert word in str(info.value), str(info.value)


def offload_on_gpu() -> dict:
    """One fsdp + cpu_offload step on CUDA: where the parameters and optimizer state live."""
    from torch.distributed.tensor import DTensor

    run = train_gpt(["parallel_mode", ("fsdp", dict(WRAP, cpu_offload=True))], steps=2,
                    optim_func=torch.optim.AdamW, optim_args={"lr": 1e-3})
    result = run["result"]
    params = [p.to_local() if isinstance(p, DTensor) else p for p in result.model.parameters()]
    states = [v for s in result.optim.torch_optimizer.state.values() for v in s.values()
              if torch.is_tensor(v) and v.dim()]
    return {"param_devices": sorted({p.device.type for p in params}),
            "state_devices": sorted({(v.to_local() if isinstance(v, DTensor) else v).device.type for v in states}),
            "losses": run["losses"]}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_fsdp_cpu_offload_keeps_state_on_cpu_on_a_gpu():
    got = run_distributed(offload_on_gpu, 1)[0]
    assert got["param_devices"] == ["cpu"] and got["state_devices"] == ["cpu"], got
    assert all(torch.isfinite(torch.tensor(got["losses"]))), got["losses"]


def test_fsdp_cpu_offload_on_one_rank_trains_like_the_reference():
    """Offloading alone (one rank, nothing to shard across) still applies and trains correctly."""
    got = run_distributed(offload_on_gpu, 1)[0]
    reference = train_gpt([], steps=2, optim_func=torch.optim.AdamW, optim_args={"lr": 1e-3})
    assert got["param_devices"] == ["cpu"] and got["state_devices"] == ["cpu"], got
    assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5)
