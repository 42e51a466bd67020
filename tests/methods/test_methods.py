"""Single-process behaviour of the spine and its methods beyond parity: skipping non-finite steps,
checkpoint recomputation, user-registered methods, dry-run reports, results and saved strategies."""
import contextlib
import copy
import dataclasses
import logging
import pickle
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from atorch.auto import opt_lib
from atorch.auto.accelerate import auto_accelerate
from atorch.auto.opt_lib.activation_checkpoint import evenly_chosen, matching_modules
from atorch.auto.opt_lib.base import Optimization
from atorch.auto.strategy import Strategy
from atorch.errors import InputError, LoopError, MethodConfigError
from atorch.models import GPTBlock, SyntheticTokenDataset, gpt_loss
from atorch.testing.hf_models import ZOO, zoo_model
from atorch.testing.training import SMALL_GPT, build_gpt, train_gpt
from atorch.utils.forward_patch import PatchedForward
from atorch.utils.modules import resolve_auto_targets


def gpt_accelerate(strategy, **overrides):
    kwargs = dict(
        optim_func=torch.optim.SGD, dataset=SyntheticTokenDataset(32, 16, 64), loss_func=gpt_loss,
        optim_args={"lr": 0.1}, dataloader_args={"batch_size": 4}, model_input_format="unpack_dict",
        load_strategy=strategy,
    )
    kwargs.update(overrides)
    model = build_gpt(0, SMALL_GPT)
    status, result, final = auto_accelerate(model, **kwargs)
    assert status
    return model, result, final


def one_step(result, poison_grad: bool = False):
    batch = result.prepare_input(next(iter(result.dataloader)))
    loss = result.loss_func(batch, result.model(**batch))
    result.optim.backward(loss) if result.args.use_optim_backward else loss.backward()
    if poison_grad:
        next(result.model.parameters()).grad[0, 0] = float("inf")
    result.optim.step()
    result.optim.zero_grad()


@pytest.mark.parametrize("config, skips", [
    ({"dtype": torch.float16}, True),
    ({"dtype": torch.bfloat16, "skip_if_nonfinite": True}, True),
    ({"dtype": torch.bfloat16}, False),
])
def test_non_finite_gradients_skip_the_step(config, skips):
    model, result, _ = gpt_accelerate([("amp_native", config)])
    assert result.args.use_optim_backward
    before = {k: v.clone() for k, v in model.state_dict().items()}
    one_step(result, poison_grad=True)
    unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert unchanged == skips and result.optim.last_step_skipped == skips
    one_step(result)  # a finite step afterwards trains again
    assert not result.optim.last_step_skipped
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_fp16_amp_runs_forward_and_loss_in_half_precision():
    _, result, _ = gpt_accelerate(["amp_native"])
    batch = result.prepare_input(next(iter(result.dataloader)))
    assert result.model(**batch).dtype == torch.float16
    assert isinstance(result.optim.scaler, torch.amp.GradScaler)


@pytest.mark.parametrize("clip_via", ["optimizer", "torch"])
def test_clipping_under_fp16_amp_clips_the_unscaled_gradients(clip_via):
    """The loop's own ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` too: torch's function
    alone took the norm of the loss-scaled gradients (about 65536 times the true one here) and shrank every
    update by the scale (the loop has no scaler to unscale first)."""
    clip = 0.5
    reference = train_gpt([], steps=3, max_grad_norm=clip)
    run = train_gpt([("amp_native", {"dtype": torch.float16})], steps=3, max_grad_norm=clip, clip_via=clip_via)
    assert all(norm > clip for norm in reference["grad_norms"]), reference["grad_norms"]  # every step clips
    for norm, expected in zip(run["grad_norms"], reference["grad_norms"]):
        assert abs(norm - expected) < 0.05 * expected, (run["grad_norms"], reference["grad_norms"])
    moved = sum(float((run["weights"][k] - reference["weights"][k]).abs().max()) for k in reference["weights"])
    assert moved < 0.05, moved


def test_the_loop_s_own_scheduler_and_step_hooks_take_result_optim():
    """``result.optim`` is a torch.optim.Optimizer, as the loop's own scheduler demands (LambdaLR and
    transformers' schedules raised "AtorchOptimizer is not an Optimizer"): under fp16 amp the schedule
    reaches the torch optimizer's learning rate, the run matches fp32 with the same schedule and not
    fp32 without it, and a step hook registered on ``result.optim`` runs at every step."""
    reference = train_gpt([], steps=3, loop_scheduler=True)
    unscheduled = train_gpt([], steps=3)
    run = train_gpt([("amp_native", {"dtype": torch.float16})], steps=3, loop_scheduler=True)
    optim = run["result"].optim
    assert isinstance(optim, torch.optim.Optimizer) and optim.torch_optimizer.param_groups[0]["lr"] == 0.2 / 4
    def apart(weights: dict) -> float:
        return sum(float((weights[k] - reference["weights"][k]).abs().max()) for k in reference["weights"])

    moved, unmoved = apart(run["weights"]), apart(unscheduled["weights"])
    assert moved < 0.05 < unmoved, (moved, unmoved)
    calls = []
    optim.register_step_pre_hook(lambda opt, args, kwargs: calls.append(type(opt).__name__))
    batch = run["result"].prepare_input(next(iter(run["result"].dataloader)))
    optim.backward(run["result"].loss_func(batch, run["result"].model(**batch)))
    optim.step()
    assert calls == ["SGD"], calls


def test_a_compiled_model_is_accelerated_by_the_module_it_compiles():
    """``torch.compile(model)`` given: a warning says its compilation is not kept and how to compile;
    the strategy and the returned model are the module's (no ``_orig_mod.`` names)."""
    with pytest.warns(UserWarning, match="torch.compile's wrapper of a GPT"):
        run = train_gpt(["amp_native"], steps=1, compiled_input=True)
    assert type(run["result"].model).__name__ == "GPT"
    assert not any("_orig_mod" in name for name, _ in run["result"].model.named_parameters())


@pytest.fixture
def one_process_group():
    """A gloo group of one process: torch's DistributedDataParallel needs a process group to be built."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("wrapper", ["DistributedDataParallel", "DataParallel"])
def test_a_model_given_inside_ddp_or_data_parallel_is_accelerated_by_the_module_inside(wrapper, request):
    """A script that wraps its model before anything else (``DDP(model)``, nanoGPT's
    ``DDP(torch.compile(model))``): the strategy applies to the module inside, with a warning naming each
    wrapper; the same steps as the plain model, to the last bit (the wrapper's own hooks do not run)."""
    if wrapper == "DistributedDataParallel":
        request.getfixturevalue("one_process_group")
    plain = train_gpt(["amp_native"], steps=2)
    with pytest.warns(UserWarning, match=f"{wrapper} of torch.compile's wrapper of a GPT") as warned:
        given = train_gpt(["amp_native"], steps=2, compiled_input=True, given_wrapper=wrapper)
    # the warning names the first line outside atorch: here this file's call (atorch.testing's train_gpt is inside)
    ours = [w.filename for w in warned if "wrapper of a GPT" in str(w.message)]
    assert ours == [__file__], ours
    assert type(given["result"].model).__name__ == "GPT"
    assert given["losses"] == plain["losses"]
    assert all(torch.equal(given["weights"][k], v) for k, v in plain["weights"].items())


def test_a_model_already_sharded_is_refused_with_the_method_to_name_instead(one_process_group):
    """fully_shard or parallelize_module applied before auto_accelerate: each rank holds parts of the
    weights, which no method can start from; InputError names the sharded part and what to name."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1,))
    sharded = build_gpt(0, SMALL_GPT)
    fully_shard(sharded.blocks[0], mesh=mesh)
    with pytest.raises(InputError, match=r"already sharded: blocks\.0 \(FSDPGPTBlock\) is fully_shard.*'fsdp'"):
        auto_accelerate(sharded, torch.optim.SGD, load_strategy=["amp_native"])
    split = build_gpt(0, SMALL_GPT)
    parallelize_module(split.blocks[0].mlp.up_proj, mesh, ColwiseParallel())
    with pytest.raises(InputError, match=r"parameter blocks\.0\.mlp\.up_proj\.weight is a DTensor.*'tensor_parallel'"):
        auto_accelerate(split, torch.optim.SGD, load_strategy=["amp_native"])


def test_a_step_after_loss_backward_under_fp16_amp_says_to_call_optim_backward():
    """fp16 amp scales the loss in ``optim.backward``; a loop that calls ``loss.backward()`` had GradScaler's
    AssertionError (first step) and, once a scale existed, would divide unscaled gradients by it (a
    silently tiny update). A LoopError names the call, before any parameter changes; the next step by
    ``optim.backward`` trains."""
    model, result, _ = gpt_accelerate(["amp_native"])

    def backward_by_the_loop_then_step():
        batch = result.prepare_input(next(iter(result.dataloader)))
        result.loss_func(batch, result.model(**batch)).backward()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(LoopError, match=r"Call result.optim.backward\(loss\) instead of loss.backward\(\)"):
            result.optim.step()
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        result.optim.zero_grad()

    backward_by_the_loop_then_step()  # before the scaler has a scale
    one_step(result)  # by optim.backward: the scale exists now
    backward_by_the_loop_then_step()


def test_the_returned_model_has_no_sync_as_a_ddp_loop_calls_it():
    """``with model.no_sync():`` around every micro-step but the last (a DDP loop's accumulation): the
    returned model has it under every strategy (one process here: gradients accumulate as without it); a
    pickled copy's is a plain context, with nothing to skip."""
    def accumulate(no_sync: bool) -> dict:
        model, result, _ = gpt_accelerate([])
        batches = iter(result.dataloader)
        for micro in range(2):
            batch = result.prepare_input(next(batches))
            with result.model.no_sync() if no_sync and micro == 0 else contextlib.nullcontext():
                assert result.optim.is_gradient_accumulation_boundary == (not no_sync or micro == 1)
                (result.loss_func(batch, result.model(**batch)) / 2).backward()
        result.optim.step()
        assert result.optim.is_gradient_accumulation_boundary
        return {"model": result.model, "weights": {k: v.clone() for k, v in model.state_dict().items()}}

    marked, plain = accumulate(True), accumulate(False)
    assert all(torch.equal(plain["weights"][k], v) for k, v in marked["weights"].items())
    copied = pickle.loads(pickle.dumps(marked["model"]))
    with copied.no_sync():
        pass


def test_half_casts_parameters_and_floating_inputs():
    model = nn.Linear(4, 1)
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    status, result, _ = auto_accelerate(
        model, torch.optim.SGD, data, lambda batch, out: nn.functional.mse_loss(out, batch[1]),
        optim_args={"lr": 0.1}, dataloader_args={"batch_size": 4}, load_strategy=[("half", "bf16")],
        prepare_input=lambda batch, device: batch, model_input_format=None,
    )
    batch = result.prepare_input(next(iter(result.dataloader)))
    assert model.weight.dtype == torch.bfloat16 and batch[0].dtype == torch.bfloat16
    assert result.model(batch[0]).dtype == torch.bfloat16


@pytest.mark.parametrize("config", [(GPTBlock,), ("blocks.*",), {"wrap_class": ("GPTBlock",), "no_reentrant": False},
                                    ("atorch.models.GPTBlock",)])
def test_checkpoint_recomputes_the_chosen_blocks(config):
    model, result, _ = gpt_accelerate([("checkpoint", config)])
    calls = []
    model.blocks[0].attn.register_forward_hook(lambda *args: calls.append(1))
    one_step(result)
    assert len(calls) == 2  # forward once, recomputed once in backward
    assert list(model.state_dict()) == list(build_gpt(0, SMALL_GPT).state_dict())  # keys unchanged


@pytest.mark.parametrize("item", ["checkpoint", ("checkpoint", "auto"), ("checkpoint", {"no_reentrant": False})])
def test_checkpoint_naming_no_module_recomputes_the_model_s_layers(item):
    """Named without modules (or "auto", as EPL's gradient_checkpoint.type), checkpoint recomputes the
    layers it finds in the module tree: every block, and nothing outside them; the returned strategy
    keeps "auto", so it finds them again on the model it is loaded for."""
    model, result, final = gpt_accelerate([item])
    calls: dict = {}
    for name, module in [(f"blocks.{i}", block.attn) for i, block in enumerate(model.blocks)] + [("ln_f", model.ln_f)]:
        module.register_forward_hook(lambda *args, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    one_step(result)
    assert calls == {**{f"blocks.{i}": 2 for i in range(len(model.blocks))}, "ln_f": 1}
    assert final.get("checkpoint").wrap_class == ("auto",)


@pytest.mark.parametrize("target, recomputed", [
    ("blocks", {0, 1}),          # the ModuleList of layers: never called, so its layers are recomputed
    ("ModuleList", {0, 1}),
    ("attn", {0, 1}),            # a name's end, as nnScaler's recompute_modules: every blocks.*.attn
    ("blocks.1.attn", {1}),
])
def test_checkpoint_of_a_list_of_layers_or_a_name_s_end_recomputes_what_it_names(target, recomputed):
    """Naming the list that holds the layers checkpointed the list, which is never called: nothing was
    recomputed, silently. Its layers are now; a bare name matches every module whose name ends with it."""
    model, result, _ = gpt_accelerate([("checkpoint", (target,))])
    calls: dict = {}
    for i, block in enumerate(model.blocks):  # inside the attention: runs again when it is recomputed
        block.attn.q_proj.register_forward_hook(lambda *args, i=i: calls.__setitem__(i, calls.get(i, 0) + 1))
    one_step(result)
    assert calls == {i: 2 if i in recomputed else 1 for i in range(len(model.blocks))}


@pytest.mark.parametrize("zoo_name", ["timm_vit", "timm_vit_checkpoint_seq"])
def test_checkpoint_of_a_sequential_of_layers_recomputes_each_layer(zoo_name):
    """timm's ``blocks`` is an nn.Sequential of Blocks. Checkpointed whole, its backward recomputed every
    block at once (every activation alive together: no memory saved); where the model iterates it (timm's
    checkpoint_seq), never. Each Block is patched instead, and the step is one process's."""
    zoo = zoo_model(zoo_name)
    runs = []
    for strategy in ([], [("checkpoint", ("blocks",))]):
        torch.manual_seed(0)
        model = zoo.build()
        status, result, _ = auto_accelerate(model, torch.optim.SGD, zoo.make_dataset(8, 0), zoo.loss_func,
                                            optim_args={"lr": 0.1}, dataloader_args={"batch_size": 4},
                                            load_strategy=strategy, model_input_format=zoo.input_format)
        batch = result.prepare_input(next(iter(result.dataloader)))
        result.loss_func(batch, result.model(batch)).backward()
        patched = [isinstance(m.__dict__.get("forward"), PatchedForward) for m in [model.blocks, *model.blocks]]
        runs.append(([p.grad.clone() for p in model.parameters()], patched))
    (plain, _), (grads, patched) = runs
    assert patched == [False] + [True] * len(model.blocks)
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))


def test_checkpoint_ratio_recomputes_that_share_of_the_layers_and_trains_as_one_process_does():
    """ratio 0.5 of GPT's 2 blocks: the second recomputed, the first keeps its activations (the bytes the
    forward saves for backward between none and full checkpointing's); the gradients those of the model
    without checkpoint. A share that picks no layer is refused where it is applied."""
    grads, saved = [], []
    for strategy in ([], [("checkpoint", {"ratio": 0.5})], ["checkpoint"], [("checkpoint", {"ratio": 0.4})]):
        model, result, _ = gpt_accelerate(strategy)
        calls: dict = {}
        for i, block in enumerate(model.blocks):
            block.attn.register_forward_hook(lambda *args, i=i: calls.__setitem__(i, calls.get(i, 0) + 1))
        batch = result.prepare_input(next(iter(result.dataloader)))
        packed = []  # what the forward keeps outside the checkpointed modules (theirs: their inputs only)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            loss = result.loss_func(batch, result.model(**batch))
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        saved.append(sum(packed))
        if strategy and strategy[0] != "checkpoint":
            assert calls == {0: 1, 1: 2}, strategy
    assert saved[0] > saved[1] > saved[2], saved
    assert abs(saved[1] - (saved[0] + saved[2]) / 2) < 0.05 * saved[0], saved  # one block of two: half between
    assert saved[3] == saved[1]
    # spread evenly, rounded up: a pipeline stage of 3 layers at 0.25 recomputes one (rounded down: none)
    layers = list(range(12))
    assert [evenly_chosen(layers[:n], r) for n, r in ((3, 0.25), (12, 0.25), (4, 0.5), (2, 0.4))] == [
        [2], [3, 7, 11], [1, 3], [1]]
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))


class _AttentionCore(nn.Module):
    """A parameter-free attention core, what selective recomputation (Megatron's core_attention) names."""

    calls = 0

    def forward(self, h):
        type(self).calls += 1
        return torch.softmax(h @ h.transpose(-1, -2), dim=-1) @ h


class _CoreBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.core = nn.Linear(4, 4), _AttentionCore()

    def forward(self, h):
        return h + self.core(self.proj(h))


def _one_backward(build, data: TensorDataset, strategy: list, before=lambda model: None) -> tuple:
    """One forward and backward of ``build()`` (seed 0) under ``strategy`` on all of ``data`` (an MSE loss
    on its second column): the loss and the gradients; ``before(model)`` runs just before the forward."""
    torch.manual_seed(0)
    model = build()
    status, result, _ = auto_accelerate(
        model, torch.optim.SGD, data, lambda batch, out: nn.functional.mse_loss(out, batch[1]),
        optim_args={"lr": 0.1}, dataloader_args={"batch_size": len(data)}, load_strategy=strategy,
        prepare_input=lambda batch, device: batch, model_input_format=None)
    batch = result.prepare_input(next(iter(result.dataloader)))
    before(model)
    loss = result.loss_func(batch, result.model(batch[0]))
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def test_a_parameter_free_module_named_is_recomputed():
    """Each block's parameter-free core recomputed in backward (its forward runs twice), the gradients
    those of no checkpoint."""
    data = TensorDataset(torch.randn(8, 3, 4), torch.randn(8, 3, 4))
    grads = []
    for strategy in ([], [("checkpoint", ("_AttentionCore",))]):
        _, gradients = _one_backward(lambda: nn.Sequential(_CoreBlock(), _CoreBlock()), data, strategy,
                                     before=lambda model: setattr(_AttentionCore, "calls", 0))
        grads.append((gradients, _AttentionCore.calls))
    (plain, plain_calls), (checkpointed, calls) = grads
    assert (plain_calls, calls) == (2, 4)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


class _UnnamedLayers(nn.Module):
    """Layers written as bare containers: no class of the user's repeats."""

    def __init__(self, width: int = 8, depth: int = 3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, width), *[nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width),
                                                                      nn.GELU()) for _ in range(depth)])
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.net(x))


def test_auto_finds_the_layers_of_every_family_and_of_unnamed_containers():
    """The zoo's families (HF, PyTorch's TransformerEncoder, torchtitan, timm, nanoGPT, MoE, ...): "auto" is
    the family's layer class, read from the module tree; a model of bare nn.Sequential layers: their names;
    a one-layer model: the layer its ModuleList holds; no layer: a MethodConfigError listing the types."""
    for name, zoo in ZOO.items():
        found = resolve_auto_targets(zoo.build(), ("auto",), "checkpoint")
        assert [t.__name__ for t in found] == [zoo.block], name
    assert resolve_auto_targets(_UnnamedLayers(), ("auto",), "checkpoint") == ("net.1", "net.2", "net.3")
    one_layer = build_gpt(0, dataclasses.replace(SMALL_GPT, n_layer=1))  # nothing repeats: the list names its layer
    assert resolve_auto_targets(one_layer, ("auto",), "checkpoint") == ("blocks.0",)
    with pytest.raises(MethodConfigError, match="'auto' found no repeated layers in Linear.*'Linear'"):
        resolve_auto_targets(nn.Linear(2, 2), ("auto",), "checkpoint")
    assert resolve_auto_targets(nn.Linear(2, 2), ("Linear",), "checkpoint") == ("Linear",)


def test_checkpoint_auto_on_unnamed_layers_trains_as_one_process_does():
    """Each bare-Sequential layer recomputed (its forward runs twice), the loss and the gradients those
    of the model without checkpoint."""
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    runs = []
    for strategy in ([], ["checkpoint"]):
        calls: list = []

        def count_inside_a_layer(model, calls=calls):  # a layer's inside runs again when it is recomputed
            model.net[2][1].register_forward_hook(lambda *args: calls.append(1))

        loss, grads = _one_backward(_UnnamedLayers, data, strategy, before=count_inside_a_layer)
        runs.append((loss, grads, len(calls)))
    (plain_loss, plain_grads, plain_calls), (loss, grads, calls) = runs
    assert (plain_calls, calls) == (1, 2)
    assert loss == plain_loss and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))


def test_a_class_named_by_its_import_path_matches_by_its_defining_module():
    """Users write classes as they import them (``torch.nn.TransformerEncoderLayer``, defined in
    ``torch.nn.modules.transformer``); checkpoint found only the bare class name ("no submodule matches")."""
    layer = nn.TransformerEncoderLayer(8, 2)
    assert matching_modules(nn.Sequential(layer), ("torch.nn.TransformerEncoderLayer",)) == [layer]
    assert matching_modules(nn.Sequential(layer), ("torch.nn.modules.transformer.TransformerEncoderLayer",)) == [layer]
    others = ("torch.optim.TransformerEncoderLayer", "torch.nn.TransformerDecoderLayer",
              "torch.n.TransformerEncoderLayer")
    for other in others:
        assert matching_modules(nn.Sequential(layer), (other,)) == [], other


def test_checkpoint_trains_an_hf_model_without_its_cache_and_generates_with_it():
    """Recomputing a block would append to the KV cache twice, so checkpoint trains without it (an explicit
    use_cache=True in training too, with a warning, as transformers' own gradient checkpointing does); the
    config keeps use_cache=True, so evaluation and ``generate`` still decode with the cache (setting the
    config to False for good made every later generate recompute the whole prefix per token)."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test extra")
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 64, (2, 16))
    status, result, _ = auto_accelerate(model, load_strategy=[("checkpoint", ("LlamaDecoderLayer",))])
    assert status and model.config.use_cache
    calls = []
    model.model.layers[0].self_attn.register_forward_hook(lambda *args: calls.append(1))
    output = result.model(input_ids=tokens, labels=tokens)
    assert output.past_key_values is None
    output.loss.backward()
    assert len(calls) == 2  # recomputed in backward
    reference(input_ids=tokens, labels=tokens).loss.backward()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.warns(UserWarning, match="use_cache=True under checkpoint.*second time"):
        assert result.model(input_ids=tokens, use_cache=True).past_key_values is None
    model.eval()
    with torch.no_grad():
        assert model(input_ids=tokens).past_key_values is not None
        generated = model.generate(tokens[:1, :4], max_new_tokens=3, do_sample=False)
        expected = reference.eval().generate(tokens[:1, :4], max_new_tokens=3, do_sample=False)
    assert torch.equal(generated, expected)


def test_user_registered_method_is_applied():
    class ScaleLoss(Optimization):
        name = "scale_loss_for_test"

        def normalize(self, config):
            return float(1.0 if config is None else config)

        def transform(self, ctx, config):
            def wrap(ctx):
                inner = ctx.loss_func
                ctx.loss_func = lambda batch, out: inner(batch, out) * config

            ctx.add_wrapper("amp", self.name, wrap)

    opt_lib.register_optimization(ScaleLoss)
    try:
        _, result, strategy = gpt_accelerate([("scale_loss_for_test", 0.0)])
        batch = result.prepare_input(next(iter(result.dataloader)))
        assert result.loss_func(batch, result.model(**batch)).item() == 0.0
        assert strategy.names() == ["scale_loss_for_test"]
    finally:
        opt_lib.unregister_optimization("scale_loss_for_test")


def test_distributed_only_methods_are_dropped_with_a_log_line(caplog):
    with caplog.at_level(logging.WARNING, logger="atorch"):
        _, _, strategy = gpt_accelerate(["parallel_mode", ("amp_native", "bf16")])
    assert strategy.names() == ["amp_native"]
    assert "dropping distributed-only method(s) ['parallel_mode']" in caplog.text


def test_dry_run_reports_step_time_and_peak_memory():
    model, result, _ = gpt_accelerate(["amp_native"], ignore_dryrun_on_load_strategy=False)
    report = result.args.dryrun
    assert report.ok and report.step_time_s > 0
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert report.peak_memory_bytes > param_bytes  # params + grads + activations at least
    assert torch.equal(model.wte.weight, build_gpt(0, SMALL_GPT).wte.weight)  # the dry run used a copy


def test_results_saved_strategy_scheduler_and_param_groups(tmp_path):
    path = tmp_path / "strategy.json"
    model, result, strategy = gpt_accelerate(
        [("amp_native", "bf16")], save_strategy_to_file=str(path),
        lr_scheduler_cls=torch.optim.lr_scheduler.StepLR, lr_scheduler_args={"step_size": 1, "gamma": 0.5},
        optim_param_func=lambda m: [{"params": m.blocks.parameters()}, {"params": m.lm_head.parameters(), "lr": 0.01}],
    )
    assert Strategy.load(path) == strategy
    assert result._fields == ("model", "optim", "dataloader", "loss_func", "prepare_input", "lr_scheduler", "args")
    assert [g["lr"] for g in result.optim.param_groups] == [0.1, 0.01]
    result.lr_scheduler.step()
    assert [g["lr"] for g in result.optim.param_groups] == [0.05, 0.005]
    assert result.args.requires_set_gradient_accumulation_boundary is False


def test_unpack_sequence_and_falling_loss():
    run = train_gpt([], steps=12, optim_func=torch.optim.AdamW, optim_args={"lr": 3e-3})
    assert run["losses"][-1] < run["losses"][0] - 0.1


@pytest.mark.parametrize("strategy", [
    [("amp_native", {"dtype": torch.bfloat16})],
    [("checkpoint", ("GPTBlock",))],
    [("amp_native", {"dtype": torch.bfloat16}), ("checkpoint", ("GPTBlock",)), "native_dynamo"],
], ids=["amp", "checkpoint", "amp_checkpoint_compiled"])
def test_a_deep_copy_of_the_returned_model_computes_with_its_own_weights(strategy):
    """An EMA or teacher copy (``copy.deepcopy``) of a model whose forward a method wrapped must run the
    copy's weights: a closure over the original's forward would silently run the original's (it did,
    for checkpoint, amp_native and fp8, until the patches became ``PatchedForward`` objects)."""
    _, result, _ = auto_accelerate(build_gpt(), load_strategy=strategy)
    model = result.model
    copied = copy.deepcopy(model)
    tokens = torch.randint(0, SMALL_GPT.vocab_size, (2, 8))
    with torch.no_grad():
        for parameter in copied.parameters():
            parameter.mul_(0.5)
        assert not torch.allclose(copied(tokens), model(tokens))
        for parameter in model.parameters():  # now the same weights: the same output
            parameter.mul_(0.5)
        assert torch.allclose(copied(tokens), model(tokens))
    with pytest.raises(TypeError, match="cannot be pickled whole; save its state_dict"):
        pickle.dumps(model)
