"""Compute methods: the attention / norm kernels against their references, module_replace on HF
transformers attention (small configs, no downloads) and the repo model, fp8's selection and its
documented fallback, and native_dynamo (torch.compile) training parity on CPU."""
from __future__ import annotations

import copy
import importlib
import logging
from collections import Counter
from unittest import mock

import pytest
import torch
from torch import nn
from torch.utils.data import default_collate

from atorch.auto.accelerate import auto_accelerate
from atorch.auto.opt_lib import fp8 as fp8_module
from atorch.auto.opt_lib.fp8 import select_fp8_linears
from atorch.auto.opt_lib.module_replace import register_replace_pair, replace_modules
from atorch.auto.opt_lib.module_replace_optimization import register_replace_pair as seed_path_register
from atorch.auto.opt_lib.native_dynamo import COMPILED_BLOCK_ATTR, NativeDynamoConfig, compile_model, compiled_blocks
from atorch.errors import MethodConfigError, UnsupportedAttentionError
from atorch.kernels import FusedLayerNorm, attention, reference_attention, reference_layer_norm
from atorch.testing.hf_models import ZOO
from atorch.testing.training import build_gpt, relative_difference, train_gpt, weight_difference

transformers = pytest.importorskip("transformers", reason="transformers is a test extra")
attention_kernels = importlib.import_module("atorch.kernels.attention")  # the module, not the function
TOL = 1e-5


# --- kernels -----------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["plain", "causal", "bool_mask", "float_mask", "gqa", "cross_lengths"])
def test_attention_dispatch_matches_reference(case):
    torch.manual_seed(0)
    b, h, s, d = 2, 4, 7, 16
    q = torch.randn(b, h, s, d)
    kv_heads, kv_len = (2 if case == "gqa" else h), (9 if case == "cross_lengths" else s)
    k, v = torch.randn(b, kv_heads, kv_len, d), torch.randn(b, kv_heads, kv_len, d)
    mask = None
    if case == "bool_mask":
        mask = torch.rand(b, 1, s, kv_len) > 0.3
        mask[..., 0] = True  # no fully masked row
    elif case == "float_mask":
        mask = torch.randn(b, 1, s, kv_len)
    causal = case in ("causal", "gqa")
    got = attention(q, k, v, mask, is_causal=causal)
    want = reference_attention(q, k, v, mask, is_causal=causal)
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


def test_fused_layer_norm_matches_reference_and_keeps_keys():
    torch.manual_seed(0)
    norm = nn.LayerNorm(32)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    fused = copy.deepcopy(norm)
    fused.__class__ = FusedLayerNorm
    x = torch.randn(3, 5, 32)
    torch.testing.assert_close(fused(x), reference_layer_norm(x, norm.weight, norm.bias, norm.eps), rtol=TOL, atol=TOL)
    torch.testing.assert_close(fused(x), norm(x), rtol=0, atol=0)
    assert fused.state_dict().keys() == norm.state_dict().keys()


# --- module_replace on HF models and the repo model ----------------------------------------------
def _gpt2(attn="sdpa"):
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel._from_config(config, attn_implementation=attn)


def _llama(attn="sdpa"):
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn)


def _bert(attn="sdpa"):
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                     vocab_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertModel._from_config(config, attn_implementation=attn)


def _clip(attn="sdpa"):
    config = transformers.CLIPTextConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                         num_attention_heads=4, vocab_size=64, max_position_embeddings=32,
                                         attention_dropout=0.0)
    return transformers.CLIPTextModel._from_config(config, attn_implementation=attn)


HF_MODELS = {
    "gpt2": (_gpt2, "GPT2Attention"), "gpt2_eager": (lambda: _gpt2("eager"), "GPT2Attention"),
    "llama": (_llama, "LlamaAttention"), "bert": (_bert, "BertSelfAttention"),
    "bert_eager": (lambda: _bert("eager"), "BertSelfAttention"), "clip": (_clip, "CLIPAttention"),
    "qwen2": (ZOO["qwen2"].build, "Qwen2Attention"), "mistral": (ZOO["mistral"].build, "MistralAttention"),
}


def _output_tensor(output) -> torch.Tensor:
    return output.logits if getattr(output, "logits", None) is not None else output.last_hidden_state


def _forward_backward(model: nn.Module, ids: torch.Tensor, mask) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    out = _output_tensor(model(input_ids=ids, attention_mask=mask))
    keep = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
    out[keep].pow(2).mean().backward()  # padded positions carry no signal in either model
    return out.detach()[keep], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("with_mask", [False, True], ids=["no_mask", "padding_mask"])
@pytest.mark.parametrize("name", list(HF_MODELS))
def test_module_replace_on_hf_attention_matches_original(name, with_mask):
    build, attention_class = HF_MODELS[name]
    torch.manual_seed(0)
    original = build()
    replaced = replace_modules(copy.deepcopy(original), ("hf_attention",), torch.float32, torch.device("cpu"))
    layers = sum(type(m).__name__ == attention_class for m in original.modules())
    swapped = [m for m in replaced.modules() if type(m).__name__ == f"Atorch{attention_class}"]
    assert layers >= 2 and len(swapped) == layers, [type(m).__name__ for m in replaced.modules()]
    assert replaced.state_dict().keys() == original.state_dict().keys()
    ids = torch.randint(0, 64, (2, 12))
    mask = None
    if with_mask:
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, 8:] = 0  # right padding on the second sequence
    want_out, want_grads = _forward_backward(original, ids, mask)
    with mock.patch.object(attention_kernels, "attention", wraps=attention_kernels.attention) as spy:
        got_out, got_grads = _forward_backward(replaced, ids, mask)
    assert spy.call_count == layers, "atorch's attention dispatch was not used"
    if not with_mask:  # no mask is materialised for plain causal / full attention: flash kernels can run
        assert all(call.args[3] is None for call in spy.call_args_list), [type(c.args[3]) for c in spy.call_args_list]
    torch.testing.assert_close(got_out, want_out, rtol=TOL, atol=TOL)
    assert got_grads.keys() == want_grads.keys()
    for key in want_grads:
        torch.testing.assert_close(got_grads[key], want_grads[key], rtol=TOL, atol=TOL, msg=key)


def test_module_replace_on_the_repo_model_trains_like_the_original():
    plain = train_gpt([])
    replaced = train_gpt(["module_replace"])
    model = replaced["result"].model
    assert sum(type(m).__name__ == "AtorchCausalSelfAttention" for m in model.modules()) == 2
    assert relative_difference(replaced["losses"], plain["losses"]) < TOL
    assert weight_difference(replaced["weights"], plain["weights"]) < TOL


# every transformer family of the zoo; the value: the attention class left as is, with the log's reason
ZOO_TRANSFORMERS = [name for name, zoo in ZOO.items() if zoo.transformer and zoo.hf]  # hf_attention pairs HF attention
OWN_ATTENTION = {"t5": "T5Attention computes attention itself"}
# attention modules that hold no transformers config (BLOOM's baddbmm with ALiBi): nothing marks them as
# transformers' attention, so nothing is replaced and the log says so
NO_INTERFACE = ("bloom",)


@pytest.mark.parametrize("name", ZOO_TRANSFORMERS)
def test_module_replace_finds_the_attention_of_every_zoo_transformer_and_trains_like_it(name, caplog):
    """Found from the model, not from class names: every family whose attention goes through
    transformers' attention interface is replaced and runs atorch's attention; T5 is named as left as
    is. Three SGD steps match the unreplaced model's losses and weights, under the same names."""
    with caplog.at_level(logging.INFO, logger="atorch"), \
            mock.patch.object(attention_kernels, "attention", wraps=attention_kernels.attention) as spy:
        run = train_gpt(["module_replace"], hf_model=name, steps=3, lr=0.05)
    reference = train_gpt([], hf_model=name, steps=3, lr=0.05)
    replaced = Counter(type(m).__name__.removeprefix("Atorch") for m in run["result"].model.modules()
                       if getattr(m, "atorch_replaced", False))
    if name in OWN_ATTENTION:
        assert not replaced and spy.call_count == 0
        assert OWN_ATTENTION[name] in caplog.text and "left as is" in caplog.text, caplog.text
    elif name in NO_INTERFACE:
        assert not replaced and spy.call_count == 0 and "replaced nothing" in caplog.text, caplog.text
    else:
        assert sum(replaced.values()) > 0 and spy.call_count > 0, (replaced, caplog.text)
        assert f"'hf_attention': {dict(replaced)}" in caplog.text, caplog.text  # the log names the classes
    assert run["weights"].keys() == reference["weights"].keys()
    assert relative_difference(run["losses"], reference["losses"]) < TOL
    assert weight_difference(run["weights"], reference["weights"]) < TOL


@pytest.mark.parametrize("name", [n for n in ZOO_TRANSFORMERS if n not in OWN_ATTENTION])
def test_module_replace_matches_eager_attention_on_every_zoo_transformer(name):
    """Parity against transformers' eager attention (the spelled-out softmax), loss and gradients."""
    zoo = ZOO[name]
    torch.manual_seed(0)
    original = zoo.build()
    original.set_attn_implementation("eager")
    replaced = replace_modules(copy.deepcopy(original), ("hf_attention",), torch.float32, torch.device("cpu"))
    assert replaced.state_dict().keys() == original.state_dict().keys()
    batch = default_collate([zoo.make_dataset(4, 0)[i] for i in range(4)])
    grads = []
    for model in (original, replaced):
        loss = zoo.loss_func(batch, model(**batch))
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (want_loss, want_grads), (got_loss, got_grads) = grads
    assert relative_difference(got_loss, want_loss) < TOL
    assert weight_difference(got_grads, want_grads) < TOL  # over all gradients: a key bias's is ~0 in both


def test_hf_attention_refuses_score_terms_it_would_drop():
    """T5-style position bias (or a soft cap, sink logits) must not be ignored silently."""
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(UnsupportedAttentionError, match="position_bias"):
        attention_kernels.hf_attention_forward(nn.Identity(), q, q, q, None, position_bias=torch.zeros(1, 2, 3, 3))


class Doubler(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Linear(8, 8)

    def forward(self, x):
        return self.scale(x) * 2


class FastDoubler(Doubler):
    def forward(self, x):
        return torch.addmm(self.scale.bias, x.reshape(-1, 8), self.scale.weight.t()).reshape(x.shape).mul(2)


def test_user_registered_pair_is_applied_through_the_seed_import_path():
    seed_path_register("fast_doubler", supported_dtypes={torch.float32}, pair_cls=(Doubler, FastDoubler))
    try:
        model = nn.Sequential(Doubler(), nn.ReLU(), Doubler())
        reference = copy.deepcopy(model)
        status, result, _ = auto_accelerate(model, load_strategy=[("module_replace", ["fast_doubler"])])
        assert status and [type(m).__name__ for m in result.model] == ["FastDoubler", "ReLU", "FastDoubler"]
        x = torch.randn(3, 8)
        torch.testing.assert_close(result.model(x), reference(x), rtol=TOL, atol=TOL)
        # a pair whose dtypes exclude the training dtype is skipped
        bf16_only = nn.Sequential(Doubler())
        register_replace_pair("bf16_doubler", {torch.bfloat16}, (Doubler, FastDoubler))
        out = replace_modules(bf16_only, ("bf16_doubler",), torch.float32, torch.device("cpu"))
        assert type(out[0]) is Doubler
    finally:
        from atorch.auto.opt_lib import module_replace

        module_replace._PAIRS.pop("fast_doubler", None)
        module_replace._PAIRS.pop("bf16_doubler", None)


def test_module_replace_config_errors_name_the_pairs():
    with pytest.raises(MethodConfigError, match="registered: .*hf_attention"):
        auto_accelerate(build_gpt(), load_strategy=[("module_replace", ["flash_attn_v9"])])


# --- fp8 ---------------------------------------------------------------------------------------
def test_fp8_selection_honours_include_exclude_and_dims():
    model = nn.ModuleDict({
        "layers": nn.ModuleList([nn.Linear(32, 64), nn.Linear(64, 24)]),  # 24 is not a multiple of 16
        "lm_head": nn.Linear(32, 48),
    })
    chosen, skipped = select_fp8_linears(model)
    assert chosen == ["layers.0", "lm_head"] and "not a multiple of 16" in skipped["layers.1"]
    assert select_fp8_linears(model, include=("layers",))[0] == ["layers.0"]
    chosen, skipped = select_fp8_linears(model, exclude=("lm_head",))
    assert chosen == ["layers.0"] and "exclude" in skipped["lm_head"]


def test_fp8_without_hardware_is_ignored_with_a_warning(caplog):
    if fp8_module.fp8_unavailable_reason() is None:
        pytest.skip("this machine can run fp8; the GPU test covers it")
    model = build_gpt()
    before = {n: type(m) for n, m in model.named_modules()}
    with caplog.at_level(logging.WARNING, logger="atorch"):
        status, result, strategy = auto_accelerate(model,
                                                   load_strategy=[("fp8", {"include": ("blocks",)}), "amp_native"])
    assert status and "fp8" not in strategy.names()
    assert any("fp8 is ignored" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert {n: type(m) for n, m in result.model.named_modules()} == before


def test_fp8_config_errors():
    with pytest.raises(MethodConfigError, match="fp8_format"):
        auto_accelerate(build_gpt(), load_strategy=[("fp8", {"fp8_format": "E5M2"})])
    with pytest.raises(MethodConfigError, match="unknown key"):
        auto_accelerate(build_gpt(), load_strategy=[("fp8", {"recipe": "x"})])


@pytest.mark.gpu
@pytest.mark.skipif(fp8_module.fp8_unavailable_reason() is not None, reason=str(fp8_module.fp8_unavailable_reason()))
def test_fp8_trains_with_transformer_engine_on_gpu():
    from atorch.models import GPTConfig

    config = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=128)
    run = train_gpt([("fp8", {"exclude": ("lm_head",)}), ("amp_native", {"dtype": torch.bfloat16})], config=config,
                    global_batch=16, steps=5)
    reference = train_gpt([("amp_native", {"dtype": torch.bfloat16})], config=config, global_batch=16, steps=5)
    te_layers = [m for m in run["result"].model.modules() if type(m).__module__.startswith("transformer_engine")]
    assert te_layers, "no te.Linear in the model"
    assert relative_difference(run["losses"], reference["losses"]) < 5e-2


# --- native_dynamo -----------------------------------------------------------------------------
@pytest.mark.parametrize("scope", ["auto", "model"])
def test_native_dynamo_trains_like_eager(scope):
    """The default compiles each repeated block (the GPT's two GPTBlocks), ``model`` the whole model."""
    eager = train_gpt([])
    compiled = train_gpt([("native_dynamo", {"scope": scope})])
    model = compiled["result"].model
    blocks = [m for m in model.modules() if getattr(m, COMPILED_BLOCK_ATTR, False)]
    if scope == "model":
        assert type(model).__name__ == "OptimizedModule" and not blocks
    else:
        assert type(model).__name__ == "GPT" and [type(b).__name__ for b in blocks] == ["GPTBlock"] * 2
    assert relative_difference(compiled["losses"], eager["losses"]) < 1e-4
    assert weight_difference(compiled["weights"], eager["weights"]) < 1e-4


def test_a_deep_copy_of_a_block_compiled_model_runs_its_own_weights():
    """An EMA or teacher copy (copy.deepcopy) of the returned model must compute with the copy's
    weights: each compiled forward is a method bound to its block, so the copy binds its own."""
    model = build_gpt()
    compile_model(model, NativeDynamoConfig())
    copied = copy.deepcopy(model)
    blocks = [m for m in copied.modules() if getattr(m, COMPILED_BLOCK_ATTR, False)]
    assert blocks and all(b.forward.__self__ is b for b in blocks)
    with torch.no_grad():
        for p in copied.parameters():
            p.mul_(0.5)
    tokens = torch.randint(0, 64, (2, 8))
    assert not torch.allclose(copied(tokens), model(tokens))
    fresh = copy.deepcopy(copied)  # the same halved weights, its own compiled methods
    assert torch.allclose(fresh(tokens), copied(tokens))


def test_native_dynamo_compiles_the_block_inside_a_checkpoint_wrapper():
    """The checkpoint wrapper repeats as often as the block and holds the same parameters: the block
    itself is compiled (found from the module tree), and training still matches eager."""
    eager = train_gpt([])
    run = train_gpt([("checkpoint", ("GPTBlock",)), "native_dynamo"])
    compiled = [type(m).__name__ for m in run["result"].model.modules() if getattr(m, COMPILED_BLOCK_ATTR, False)]
    assert compiled == ["GPTBlock"] * 2
    assert relative_difference(run["losses"], eager["losses"]) < 1e-4
    assert weight_difference(run["weights"], eager["weights"]) < 1e-4


def test_an_hf_model_s_blocks_share_one_graph_in_training():
    """HF models default to ``use_cache=True``: with a KV cache each layer is called with its own cache
    entry, which made dynamo compile the shared block forward once per layer (8 graphs for 10 layers,
    then ``recompile_limit``: layers 9 and 10 ran eagerly). Training forwards now run without the cache
    (one graph, the same loss as eager); evaluation keeps the model's own setting, and a training call
    that asks for the cache is warned."""
    torch._dynamo.reset()
    config = transformers.LlamaConfig(num_hidden_layers=10, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=16)
    assert config.use_cache
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    eager = copy.deepcopy(model)
    graphs = []

    def counting_backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    compile_model(model, NativeDynamoConfig(backend=counting_backend))
    tokens = torch.randint(0, 64, (2, 16))
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    assert len(graphs) == 1, f"{len(graphs)} graphs for 10 blocks"
    assert torch.allclose(loss, eager(input_ids=tokens, labels=tokens).loss)
    model.eval()
    with torch.no_grad():
        assert model(input_ids=tokens).past_key_values is not None  # evaluation (generate) keeps its cache
    model.train()
    with pytest.warns(UserWarning, match="use_cache=True"):
        model(input_ids=tokens, use_cache=True)
    torch._dynamo.reset()


def test_native_dynamo_block_scope_needs_repeated_blocks():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert compiled_blocks(model) == []
    with pytest.raises(MethodConfigError, match="scope 'blocks'.*repeats"):
        compile_model(model, NativeDynamoConfig(scope="blocks"))
    with pytest.raises(MethodConfigError, match="scope"):
        auto_accelerate(build_gpt(), load_strategy=[("native_dynamo", {"scope": "layers"})])


def test_native_dynamo_config_errors():
    with pytest.raises(MethodConfigError, match="mode"):
        auto_accelerate(build_gpt(), load_strategy=[("native_dynamo", {"mode": "fastest"})])
    with pytest.raises(MethodConfigError, match="backend"):
        auto_accelerate(build_gpt(), load_strategy=[("native_dynamo", {"backend": "warp_drive"})])
