"""tensor_parallel's plan from a model's structure (its recorded forward), not its names: the roles
found on models written as other codebases write them, the run-time shape remedies, the
MultiheadAttention stand-in, and (on 2 gloo ranks) a plan the check refuses at auto_accelerate time
plus the plan reported in ``result.args.extras``."""
from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from atorch.auto.opt_lib.sequence_parallel import plan_sequence_parallel
from atorch.auto.opt_lib.tensor_parallel import find_tp_plan
from atorch.auto.opt_lib.tp_mha import SeparateProjectionAttention, split_mha
from atorch.auto.opt_lib.tp_plan import split_share
from atorch.auto.opt_lib.tp_shapes import (
    local_merged_heads_input,
    local_part_index,
    local_side_input,
    local_split_size,
    local_view_shape,
    localize_attributes,
    part_bounds,
    restore_attributes,
)
from atorch.errors import AtorchError, MethodConfigError
from atorch.testing import run_distributed
from atorch.testing.hf_models import ZOO, zoo_model
from atorch.testing.training import relative_difference, train_plainly, train_returned
from atorch.utils.batch import call_with_batch
from atorch.utils.dataflow import record_dataflow

pytest.importorskip("transformers", reason="transformers is a test extra")


def _plan(name: str, tp: int = 2):
    zoo = zoo_model(name)
    torch.manual_seed(0)
    model = zoo.build()
    split_mha(model)
    batch = torch.utils.data.default_collate([zoo.make_dataset(2, 0)[0]])
    return find_tp_plan(model, tp, record_dataflow(model, lambda m: call_with_batch(m, batch, zoo.input_format)))


def _roles(plan) -> dict:
    return {**plan.styles, **{n: "vocab" for n in plan.vocab}, **{n: "head" for n in plan.head_bias}}


EXPECTED = {  # a few modules per family and the role the structure gives them
    "torch_encoder": {"encoder.layers.0.self_attn.q_proj": "colwise", "encoder.layers.0.self_attn.out_proj": "rowwise",
                      "encoder.layers.0.linear1": "colwise", "encoder.layers.0.linear2": "rowwise"},
    "titan_llama": {"layers.0.attention.wq": "colwise", "layers.0.attention.wk": "colwise",
                    "layers.0.attention.wo": "rowwise", "layers.0.feed_forward.w1": "colwise",
                    "layers.0.feed_forward.w3": "colwise", "layers.0.feed_forward.w2": "rowwise"},
    "timm_vit": {"blocks.0.attn.qkv": "colwise", "blocks.0.attn.proj": "rowwise", "blocks.0.mlp.fc1": "colwise",
                 "blocks.0.mlp.fc2": "rowwise"},
    "nanogpt": {"transformer.h.0.attn.c_attn": "colwise", "transformer.h.0.attn.c_proj": "rowwise"},
    "mlp_updown": {"blocks.0.up": "colwise", "blocks.0.down": "rowwise"},
    "qwen3": {"model.layers.0.self_attn.q_proj": "colwise", "model.layers.0.self_attn.k_proj": "colwise",
              "model.layers.0.self_attn.o_proj": "rowwise", "model.layers.0.mlp.down_proj": "rowwise"},
    "neox": {"gpt_neox.layers.0.attention.query_key_value": "colwise", "gpt_neox.layers.0.attention.dense": "rowwise",
             "gpt_neox.layers.0.mlp.dense_h_to_4h": "colwise", "gpt_neox.layers.0.mlp.dense_4h_to_h": "rowwise"},
    "t5": {"encoder.block.0.layer.0.SelfAttention.q": "colwise", "encoder.block.0.layer.0.SelfAttention.o": "rowwise",
           "encoder.block.0.layer.0.SelfAttention.relative_attention_bias": "head",
           "encoder.block.0.layer.1.DenseReluDense.wi": "colwise"},
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_roles_come_from_the_structure(name):
    plan = _plan(name)
    roles = _roles(plan)
    assert plan.found_by == "structure"
    for module, role in EXPECTED[name].items():
        assert roles.get(module) == role, f"{name}: {module} is {roles.get(module)}, expected {role}"


def test_a_norm_over_each_head_runs_on_the_local_heads_and_does_not_stop_the_split():
    """Qwen3 normalises each head's query and key (RMSNorm over head_dim): a per-head reduction, so the
    attention is still split; the norms are named with the dimension their heads are on."""
    plan = _plan("qwen3")
    assert plan.head_norms == {f"model.layers.{i}.self_attn.{n}_norm": -2 for i in range(4) for n in "qk"}
    assert not any("norm" in name for name in plan.styles) and "model.layers.0.self_attn.q_norm" not in plan.replicated


def test_a_norm_with_a_weight_per_head_is_split_on_its_heads_dimension():
    """Cohere's q / k LayerNorms also normalise each head's features, but with a weight per head and
    feature ([heads, head size], read off the norm's input [..., heads, head size]): not a norm shared by
    the heads, its weight's rows split with the heads they scale (dimension 0)."""
    plan = _plan("cohere")
    assert plan.head_params == {f"model.layers.{i}.self_attn.{n}_norm": {"weight": 0} for i in range(4) for n in "qk"}
    assert not plan.head_norms and not [n for n in plan.replicated if "self_attn" in n], plan.replicated
    assert _plan("qwen3").head_params == {}  # its norms' one head-sized weight is shared: head_norms


def test_a_module_list_of_one_norm_a_head_runs_on_the_gathered_heads():
    """StableLM 2's q / k norms hold an nn.ModuleList of one LayerNorm per head and zip it with the heads
    split one by one (input [batch, heads, tokens, head size]): read off the list's length, a heads count
    (4 query heads, 2 key / value heads), as a module run on every head (heads on dimension -3), its
    norms not taken for norms shared by the heads; the structure alone, whatever the modules are called."""
    plan = _plan("stablelm")
    assert plan.head_module_lists == {f"model.layers.{i}.self_attn.{n}_layernorm": -3 for i in range(4) for n in "qk"}
    assert not plan.head_norms and not plan.head_params
    assert _plan("qwen3").head_module_lists == {} and _plan("cohere").head_module_lists == {}


def test_a_norm_between_the_split_and_the_row_wise_projection_is_split_with_the_features():
    """BitNet normalises the attention's whole output before o_proj and the MLP's product before down_proj
    (RMSNorms of their widths, 32 and 64): each norm's reduction runs over the split features, so the
    attention and the MLP are still split, the norms with them (``feature_norms``); OLMo 2's norms before
    the attention stay found the same way."""
    plan = _plan("bitnet")
    layer = "model.layers.{}"
    for i in range(4):
        assert plan.styles[f"{layer.format(i)}.self_attn.o_proj"] == "rowwise"
        assert plan.styles[f"{layer.format(i)}.mlp.down_proj"] == "rowwise"
        assert plan.styles[f"{layer.format(i)}.mlp.gate_proj"] == "colwise"
    assert plan.feature_norms == {**{f"model.layers.{i}.self_attn.attn_sub_norm": 32 for i in range(4)},
                                  **{f"model.layers.{i}.mlp.ffn_sub_norm": 64 for i in range(4)}}
    assert _plan("olmo2").feature_norms == {f"model.layers.{i}.self_attn.{n}_norm": w
                                            for i in range(4) for n, w in (("q", 32), ("k", 16))}
    assert _plan("llama").feature_norms == {}


class PReLUMLP(nn.Module):
    """Residual MLPs whose activation is a one-parameter PReLU: a learned scalar applied to every feature."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(up=nn.Linear(16, 64), act=nn.PReLU(), down=nn.Linear(64, 16)))
                                    for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = x + block["down"](block["act"](block["up"](x)))
        return x


def test_an_activation_with_a_learned_scalar_does_not_stop_the_split():
    """A PReLU (one learned slope) and Apertus's xIELU (two learned scalars, compared with a threshold,
    expm1 of a minimum with a constant) are elementwise: the MLP around them splits and they are kept whole
    as feature gains (their gradients are summed over the tensor group when applied)."""
    model = PReLUMLP()
    plan = find_tp_plan(model, 2, record_dataflow(model, lambda m: m(torch.randn(2, 3, 16))))
    assert plan.styles == {f"blocks.{i}.{n}": s for i in range(2) for n, s in (("up", "colwise"), ("down", "rowwise"))}
    assert plan.feature_gains == ["blocks.0.act", "blocks.1.act"] and not plan.feature_norms
    assert _plan("apertus").feature_gains == [f"model.layers.{i}.mlp.act_fn" for i in range(4)]
    assert _plan("llama").feature_gains == []


def test_a_side_input_built_for_every_head_is_cut_to_the_rank_s_heads():
    """MPT adds a bias built for all 4 heads ([4, 1, keys]) to the scores of a rank's 2 heads ([b, 2, q, k]):
    the full operand is cut to this rank's contiguous heads, whichever side it is on; operands that
    broadcast already, or differ by other than the tensor size, are left alone."""
    scores, bias = torch.zeros(3, 2, 5, 5), torch.arange(4.0).view(4, 1, 1).expand(4, 1, 5)
    for rank in (0, 1):
        local, cut = local_side_input(scores, bias, {4, 32}, 2, rank)
        assert local is scores and cut[:, 0, 0].tolist() == [2.0 * rank, 2.0 * rank + 1]
        cut, local = local_side_input(bias, scores, {4, 32}, 2, rank)
        assert local is scores and cut[:, 0, 0].tolist() == [2.0 * rank, 2.0 * rank + 1]
    assert local_side_input(scores, torch.zeros(2, 1, 5), {4}, 2, 0) is None  # broadcasts as it is
    assert local_side_input(scores, torch.zeros(6, 1, 5), {6}, 2, 0) is None  # 6 is not 2 x 2
    assert local_side_input(scores, bias, {32}, 2, 0) is None  # 4 is no full size of the region
    assert local_side_input(scores, 1.0, {4}, 2, 0) is None
    assert local_side_input(scores, nn.Parameter(bias.clone()), {4}, 2, 0) is None  # a parameter: never cut


def test_scores_made_by_baddbmm_onto_a_bias_are_an_attention():
    """BLOOM computes its scores as ``alibi.baddbmm(batch1=q, batch2=k)`` with the batch and the heads merged in
    one dimension: read as a matmul of its two keyword factors (the bias added is not an operand), its fused
    query_key_value (laid out head by head) splits column-wise and dense row-wise, as Megatron splits them;
    before, only the MLP split (67 % of the parameters)."""
    plan = _plan("bloom")
    attention = "transformer.h.0.self_attention"
    assert plan.styles[f"{attention}.query_key_value"] == "colwise"
    assert plan.styles[f"{attention}.dense"] == "rowwise"
    assert f"{attention}.query_key_value" not in plan.fused  # head by head: split as it is
    assert plan.region_heads[attention] == {4} and plan.region_head_dims[attention] == {8}
    assert split_share(zoo_model("bloom").build(), plan) > 0.98


def test_a_bias_built_for_every_head_with_the_batch_merged_is_cut_to_the_rank_s_heads():
    """BLOOM's ALiBi bias is [batch * heads, 1, keys], batch-major, and is added to the scores of a rank's
    heads ([batch * heads / tp, q, k]): each batch row keeps this rank's heads, in order; a size that times a
    head size makes no full width (a width, not a head count), a bias that already fits, or a parameter is
    left alone."""
    batch, heads, keys = 3, 4, 5
    bias = torch.arange(float(batch * heads)).view(batch * heads, 1, 1).expand(batch * heads, 1, keys)
    q = torch.zeros(batch * heads // 2, 5, 8)
    for rank in (0, 1):
        cut = local_merged_heads_input(bias, q, {4, 32, 96}, frozenset({8}), 2, rank)
        expected = [b * heads + h for b in range(batch) for h in (2 * rank, 2 * rank + 1)]
        assert cut.shape == (6, 1, keys) and cut[:, 0, 0].tolist() == expected
    assert local_merged_heads_input(bias, q, {4, 96}, frozenset({8}), 2, 0) is None  # 4 x 8 is no full width
    assert local_merged_heads_input(bias[:6], q, {4, 32}, frozenset({8}), 2, 0) is None  # fits already
    assert local_merged_heads_input(nn.Parameter(bias.clone()), q, {4, 32}, frozenset({8}), 2, 0) is None


def test_a_projection_fused_head_by_head_is_split_as_it_is():
    """GPT-NeoX's query_key_value is laid out [h0: q k v | h1: q k v | ...]: a contiguous column split already
    gives each rank whole heads, so it is not reordered as GPT-2's [q | k | v] c_attn is."""
    neox, gpt2 = _plan("neox"), _plan("gpt2")
    assert "gpt_neox.layers.0.attention.query_key_value" not in neox.fused
    assert neox.styles["gpt_neox.layers.0.attention.query_key_value"] == "colwise"
    assert gpt2.fused["transformer.h.0.attn.c_attn"] == [32, 32, 32]


def _falcon_7b_like():
    transformers = pytest.importorskip("transformers")
    config = transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.FalconForCausalLM._from_config(config)


def test_multi_query_in_one_fused_projection_is_read_where_cut_and_left_whole():
    """Falcon-7B's fused [q | k | v] holds 4 query heads and one key / value head: its parts are read where
    they are cut from the projection's output (not three equal thirds); the one key head cannot be divided
    nor split apart from the query heads in one weight, so the attention stays whole (it refused the whole
    model before) and the MLP splits."""
    model = _falcon_7b_like()
    batch = {"input_ids": torch.randint(0, 64, (1, 16))}
    flow = record_dataflow(model, lambda m: m(**batch))
    plan = find_tp_plan(model, 2, flow)
    attention = "transformer.h.{}.self_attention."
    for i in range(2):
        for name in ("query_key_value", "dense"):
            assert "multi-query attention in one fused projection" in plan.why_whole[attention.format(i) + name]
        assert plan.styles[f"transformer.h.{i}.mlp.dense_h_to_4h"] == "colwise"
        assert plan.styles[f"transformer.h.{i}.mlp.dense_4h_to_h"] == "rowwise"
    assert not [n for n in plan.styles if ".self_attention." in n] and plan.fused == {}


def test_without_a_sample_fused_multi_query_is_not_taken_for_equal_thirds():
    """By names alone (no sample batch), Falcon-7B's and StarCoder's fused [q | k | v] (one key / value
    head) were taken for three equal thirds (48 features: 16 each, 2 heads of 8), a wrong reordering no
    check would catch; the module's head count and size say they are not, so the attention stays whole."""
    falcon = _falcon_7b_like()
    with pytest.raises(MethodConfigError, match=r"query_key_value: fused, but its parts are not three equal thirds"):
        find_tp_plan(falcon, 2)  # and its MLP has no names the list knows: nothing is left to split
    starcoder = find_tp_plan(zoo_model("starcoder").build(), 2)
    assert starcoder.found_by == "names" and starcoder.fused == {}, starcoder.fused
    assert "not three equal thirds" in starcoder.why_whole["transformer.h.0.attn.c_attn"]
    assert starcoder.styles["transformer.h.0.mlp.c_fc"] == "colwise"
    assert find_tp_plan(zoo_model("gpt2").build(), 2).fused["transformer.h.0.attn.c_attn"] == [32, 32, 32]


@pytest.mark.parametrize("traced", [True, False])
def test_one_key_value_head_in_its_own_projections_stays_whole_beside_split_queries(traced):
    """Gemma with one key / value head (Gemma 2B's layout), found from the recorded forward or by names:
    q_proj column-wise, o_proj row-wise, k_proj / v_proj whole and listed in shared_kv (their output's
    gradient is summed over the tensor group; trained in test_model_parallel)."""
    model = zoo_model("gemma_mqa").build()
    flow = record_dataflow(model, lambda m: m(input_ids=torch.randint(0, 64, (1, 16)))) if traced else None
    plan = find_tp_plan(model, 2, flow)
    attention = "model.layers.{}.self_attn."
    assert plan.shared_kv == [attention.format(i) + n for i in range(4) for n in ("k_proj", "v_proj")]
    for i in range(4):
        assert plan.styles[attention.format(i) + "q_proj"] == "colwise"
        assert plan.styles[attention.format(i) + "o_proj"] == "rowwise"
        assert attention.format(i) + "k_proj" not in plan.styles
        assert "multi-query" in plan.why_whole[attention.format(i) + "v_proj"]
    assert plan.report()["shared_kv"] == plan.shared_kv


def test_a_weight_read_through_its_transpose_is_a_linear_of_its_module():
    """FalconLinear computes ``input @ self.weight.T``: the matmul is that module's Linear, not a product
    of two activations (which would look like attention)."""
    class TransposedLinear(nn.Linear):
        def forward(self, x):
            return x @ self.weight.T + self.bias

    model = nn.Sequential(TransposedLinear(8, 16), nn.GELU(), TransposedLinear(16, 8))
    flow = record_dataflow(model, lambda m: m(torch.randn(2, 8)))
    assert [(op.kind, op.module) for op in flow.ops if op.kind != "other"] == [("linear", "0"), ("linear", "2")]
    assert find_tp_plan(model, 2, flow).styles == {"0": "colwise", "2": "rowwise"}


def _sequence_plan(name: str):
    zoo = zoo_model(name)
    torch.manual_seed(0)
    model = zoo.build()
    batch = torch.utils.data.default_collate([zoo.make_dataset(2, 0)[0]])
    flow = record_dataflow(model, lambda m: call_with_batch(m, batch, zoo.input_format))
    return plan_sequence_parallel(model, find_tp_plan(model, 2, flow).styles, flow)


@pytest.mark.parametrize("name, whole", [("mixtral", "model.layers.0.mlp"),
                                         ("starcoder", "transformer.h.0.attn")])
def test_a_layer_with_nothing_split_runs_whole_on_the_gathered_sequence(name, whole):
    """Under sequence_parallel a layer on the residual stream holding parameters with nothing split inside
    (Mixtral's MoE layer, its experts left whole; StarCoder's multi-query attention in one fused projection,
    left whole) gathers the sequence,
    runs as in one process and is cut back: it may mix tokens, so it never runs on a shard."""
    plan = _sequence_plan(name)
    assert whole in plan.whole and whole in plan.reshard and whole in plan.plain_gathers
    assert not any(n.startswith(whole + ".") for n in plan.norms)  # its Linears do not run on the shard


def test_a_convolution_on_the_stream_runs_whole_and_norms_stay_on_the_shard():
    class ConvBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(16)
            self.mix = nn.Conv1d(16, 16, 3, padding=1)  # mixes neighbouring tokens
            self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            x = x + self.mix(self.norm(x).transpose(1, 2)).transpose(1, 2)
            return x + self.down(torch.relu(self.up(x)))

    model = nn.Sequential(*[ConvBlock() for _ in range(2)])
    flow = record_dataflow(model, lambda m: m(torch.randn(2, 8, 16)))
    plan = plan_sequence_parallel(model, find_tp_plan(model, 2, flow).styles, flow)
    assert plan.whole == {"0.mix", "1.mix"} and {"0.norm", "1.norm"} <= set(plan.norms)


def test_fused_projections_are_split_by_part():
    assert _plan("timm_vit").fused["blocks.0.attn.qkv"] == [32, 32, 32]
    assert _plan("nanogpt").fused["transformer.h.0.attn.c_attn"] == [32, 32, 32]
    fused = _plan("perceiver_block").fused
    assert [parts for name, parts in fused.items() if name.endswith("to_kv")][0] == [32, 32]


def test_the_moe_router_stays_whole_and_every_expert_is_split():
    plan = _plan("moe")
    routers = [n for n, _ in ZOO["moe"].build().named_modules() if n.endswith("router")]
    assert routers and not set(routers) & set(plan.styles)
    assert any(why for n, why in plan.why_whole.items() if n in routers)
    experts = [n for n in plan.styles if ".experts." in n]
    assert len(experts) >= 4 * 4 * 2, experts  # 4 blocks x 4 experts x (up + down) at least


def test_stacked_expert_banks_are_found_by_interface_and_shapes():
    """transformers' Mixtral banks (3-D gate_up / down stacked on 4 experts) are split by expert, every one of
    them; its router (2-D) and the MoE block around the bank (no parameters of its own) are not banks; a bank
    whose experts do not divide by the tensor size stays whole, saying so; the repo MoE's Linear experts are
    no bank (they split as MLP pairs)."""
    from atorch.auto.opt_lib.tp_experts import find_expert_banks, is_expert_bank

    plan = _plan("mixtral")
    assert plan.experts == [f"model.layers.{i}.mlp.experts" for i in range(4)], plan.experts
    model = ZOO["mixtral"].build()
    router, block = model.get_submodule("model.layers.0.mlp.gate"), model.get_submodule("model.layers.0.mlp")
    assert not is_expert_bank(router) and not is_expert_bank(block)
    banks, why = find_expert_banks(model, 3)
    assert banks == [] and "4 experts do not divide by the tensor size 3" in why["model.layers.0.mlp.experts"], why
    assert find_expert_banks(ZOO["moe"].build(), 2) == ([], {})


class _FusedGateMLP(nn.Module):
    """A gated MLP whose one input Linear computes [gate | up], cut in two (Phi-3's, GLM's, ModernBERT's)."""

    def __init__(self, width: int = 16, hidden: int = 24, cut: str = "chunk"):
        super().__init__()
        self.norm, self.up, self.down, self.cut, self.hidden = nn.LayerNorm(width), nn.Linear(width, 2 * hidden), \
            nn.Linear(hidden, width), cut, hidden

    def forward(self, x):
        both = self.up(self.norm(x))
        gate, up = both.chunk(2, dim=-1) if self.cut == "chunk" else (both[..., :self.hidden], both[..., self.hidden:])
        return x + self.down(torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("cut", ["chunk", "slices"])
def test_a_fused_gate_and_up_projection_is_split_part_by_part(cut):
    """Its output cut along the features into [gate | up] (by chunk, or by two slices): a contiguous split
    would give one rank every gate column and the other every up column, so its parts are recorded and
    re-ordered per rank like a fused [q | k | v]; ModernBERT's Wi as well."""
    model = _FusedGateMLP(cut=cut)
    flow = record_dataflow(model, lambda m: m(torch.randn(2, 5, 16)))
    plan = find_tp_plan(model, 2, flow)
    assert plan.styles == {"up": "colwise", "down": "rowwise"} and plan.fused == {"up": [24, 24]}, plan.fused
    modernbert = zoo_model("modernbert").build()
    flow = record_dataflow(modernbert, lambda m: m(input_ids=torch.randint(0, 64, (1, 16))))
    assert find_tp_plan(modernbert, 2, flow).fused["model.layers.0.mlp.Wi"] == [64, 64]


def test_banks_with_biases_are_banks_and_meet_the_no_expert_slot_as_no_class():
    """gpt-oss's bank holds 3-D weights beside 2-D biases, all led by its 4 experts: a routed bank; its
    router (2-D weight, 1-D bias) is none. Its eager kernel one-hot encodes the choices over its own expert
    count, so on a rank holding 2 experts the "no expert" slot (2) is run as no class: the bank's output
    from its own experts only, equal to the whole bank's with the other experts' weights zeroed."""
    from atorch.auto.opt_lib.tp_experts import _SentinelIsNoClass, bank_interface

    model = zoo_model("gpt_oss").build()
    bank, router = (model.get_submodule(f"model.layers.0.mlp.{n}") for n in ("experts", "router"))
    assert bank_interface(bank) == "routed" and bank_interface(router) is None
    torch.manual_seed(0)
    for param in bank.parameters():
        torch.nn.init.normal_(param, std=0.5)
    tokens, index, weights = torch.randn(6, 32), torch.tensor([[0, 3], [1, 2], [3, 0], [2, 1], [0, 1], [3, 2]]), \
        torch.rand(6, 2)
    first_two = copy.deepcopy(bank)
    with torch.no_grad():
        for param in first_two.parameters():
            param[2:] = 0  # experts 2 and 3 contribute nothing (their biases too)
    local = copy.deepcopy(bank)
    with torch.no_grad():
        for name, param in list(local.named_parameters()):
            setattr(local, name, torch.nn.Parameter(param[:2].clone()))
    local.num_experts, local._is_expert_parallel = 2, True  # as the split bank runs (tp_experts._local_experts)
    local_index = torch.where(index < 2, index, torch.full_like(index, 2))
    for kernel in ("eager", "grouped_mm"):  # the model's own loop, and transformers' grouped kernel
        local.config._experts_implementation = first_two.config._experts_implementation = kernel
        with _SentinelIsNoClass(2):
            got = local(tokens, local_index, weights)
        expected = first_two(tokens, index, weights)
        assert torch.allclose(got, expected, atol=1e-5), (kernel, (got - expected).abs().max())


def test_torchtitan_grouped_banks_are_found_by_their_two_input_interface():
    """torchtitan's GroupedExperts (w1 / w2 / w3 stacked on 4 experts, called with the grouped tokens
    and the per-expert counts) is a bank of the grouped kind, transformers' Mixtral bank of the routed
    kind; the router's gate, the shared expert and the MoE layer around the bank are none."""
    from atorch.auto.opt_lib.tp_experts import bank_interface

    plan = _plan("titan_moe")
    assert plan.experts == [f"layers.{i}.moe.experts" for i in range(4)], plan.experts
    model = ZOO["titan_moe"].build()
    assert bank_interface(model.get_submodule("layers.0.moe.experts")) == "grouped"
    for name in ("layers.0.moe", "layers.0.moe.router", "layers.0.moe.router.gate", "layers.0.moe.shared_expert"):
        assert bank_interface(model.get_submodule(name)) is None, name
    assert bank_interface(ZOO["mixtral"].build().get_submodule("model.layers.0.mlp.experts")) == "routed"


def test_nothing_to_split_is_refused_naming_the_module():
    with pytest.raises(MethodConfigError, match=r"SmallResNet .*fc: its output reaches"):
        _plan("cnn")


def test_heads_that_do_not_divide_are_refused_naming_the_projection():
    with pytest.raises(MethodConfigError, match=r"layers\.0\.attention\.w[qkv] computes \d+ heads .* tensor size 3"):
        _plan("titan_llama", tp=3)


def test_view_and_split_shapes_are_made_local():
    full = {32, 96, 4}  # widths and head count of a 4-head, 32-wide fused attention
    local_qkv = torch.empty(2, 5, 48)  # this rank's [q | k | v] share under tp 2
    assert local_view_shape(local_qkv, [2, 5, 3, 4, 8], full, 2) == [2, 5, 3, 2, 8]  # timm's reshape
    assert local_view_shape(torch.empty(2, 5, 2, 8), [2, 5, 32], full, 2) == [2, 5, 16]  # reshape(B, N, C)
    assert local_view_shape(torch.empty(2, 5, 2, 8), [2, -1, 32], full, 2) == [2, -1, 16]  # view(B, -1, inner)
    assert local_view_shape(torch.empty(2, 5, 16), [2, 5, -1, 8], full, 2) is None  # fits: untouched
    assert local_view_shape(torch.empty(2, 5, 2, 8), [2, 5, 2, -1, 2], full, 2) is None  # rotary pairs: untouched
    # DeBERTa's view(B, N, num_heads, -1) fits a rank's 16 features as 4 heads of 4: with the head size
    # known (8) it is made 2 heads of 8; without it, or where the count already gives the head size, left
    assert local_view_shape(torch.empty(2, 5, 16), [2, 5, 4, -1], full, 2, frozenset({8})) == [2, 5, 2, -1]
    assert local_view_shape(torch.empty(2, 5, 16), [2, 5, 4, -1], full, 2) is None
    assert local_view_shape(torch.empty(2, 5, 32), [2, 5, 4, -1], full, 2, frozenset({8})) is None  # whole
    assert local_split_size(local_qkv, 32, 2, full, 2) == 16  # nanoGPT's split(n_embd)
    assert local_split_size(torch.empty(2, 5, 96), 32, 2, full, 2) is None  # tiles already


def test_head_counts_are_made_local_inside_the_region_but_not_in_its_linears():
    """DeBERTa's region (the attention block) holds the self-attention module whose head count its code
    reads: attributes of modules inside the region are made local too, a Linear's own sizes are not, and
    everything is restored after."""
    region = nn.Module()
    region.num_heads = 4
    region.inner = nn.Module()
    region.inner.num_attention_heads, region.inner.head_size = 4, 8
    region.inner.query = nn.Linear(32, 4)
    changed = localize_attributes(region, {4}, 2)
    assert (region.num_heads, region.inner.num_attention_heads, region.inner.head_size) == (2, 2, 8)
    assert region.inner.query.out_features == 4
    restore_attributes(region, changed)
    assert (region.num_heads, region.inner.num_attention_heads) == (4, 4)


def test_slices_of_a_fused_output_cut_by_full_positions_are_cut_from_the_rank_layout():
    """Phi-3's ``qkv[..., :32]``, ``qkv[..., 32:48]``, ``qkv[..., 48:]`` on [q 32 | k 16 | v 16] under tp 2:
    the rank holds [q 16 | k 8 | v 8]; the slices fit its 32 features but would read the wrong parts."""
    bounds = part_bounds([[32, 16, 16]], 2)
    local = torch.empty(2, 5, 32)
    assert local_part_index(local, (Ellipsis, slice(None, 32)), bounds, 2) == (Ellipsis, slice(0, 16))
    assert local_part_index(local, (Ellipsis, slice(32, 48)), bounds, 2) == (Ellipsis, slice(16, 24))
    assert local_part_index(local, (Ellipsis, slice(48, None)), bounds, 2) == (Ellipsis, slice(24, None))
    assert local_part_index(local, (slice(None), slice(None), slice(32, 48)), bounds, 2) == (
        slice(None), slice(None), slice(16, 24))
    assert local_part_index(local, (Ellipsis, slice(16, 24)), bounds, 2) is None  # already the rank's own
    assert local_part_index(local, (Ellipsis, slice(0, 8)), bounds, 2) is None  # not a part
    assert local_part_index(torch.empty(2, 64, 32), (slice(None), slice(32, 48)), bounds, 2) is None  # tokens
    assert local_part_index(torch.empty(2, 5, 64), (Ellipsis, slice(32, 48)), bounds, 2) is None  # whole output
    assert part_bounds([[30, 15, 15]], 2) == {}  # parts that do not divide: nothing to rewrite


def test_an_in_place_write_into_a_slice_is_a_new_version_of_the_whole_tensor():
    """``out[..., :4].copy_(a)`` writes into ``out``: the write is read as made from ``a``, and the
    buffer's own factory (``a.new_empty``) carries no data from ``a``."""
    class Assembled(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

        def forward(self, x):
            a, b = self.a(x), self.b(x)
            out = a.new_empty(*a.shape[:-1], 8)
            out[..., :4].copy_(a)
            out[..., 4:].copy_(b)
            return out * 2

    flow = record_dataflow(Assembled(), lambda m: m(torch.randn(2, 8)))
    last = flow.ops[-1]
    assert last.name in ("mul", "__mul__"), last
    sources = {op.module for op in flow.backward_sources(last.inputs[0], lambda op: op.name in ("copy_",
                                                                                                "__getitem__"))}
    assert sources == {"a", "b", ""}, sources  # "" : the factory, made from nothing
    factory = next(op for op in flow.ops if op.name == "new_empty")
    assert factory.inputs == [], factory


def _family_plan(name: str):
    from atorch.testing.hf_models import zoo_model

    zoo = zoo_model(name)
    torch.manual_seed(0)
    model = zoo.build()
    batch = torch.utils.data.default_collate([zoo.make_dataset(2, 0)[0]])
    return model, find_tp_plan(model, 2, record_dataflow(model, lambda m: call_with_batch(m, batch,
                                                                                         zoo.input_format)))


def test_latent_attention_splits_its_up_projections_and_shares_the_rotary_key():
    """DeepSeek-V3's multi-head latent attention: q_b_proj and kv_b_proj ([key without rotary | value]
    inside each head, 12 features a head of 8-wide query heads) split by heads, o_proj row-wise; the
    down-projections stay whole, kv_a_proj_with_mqa among them though its rotary part reaches the keys
    (broadcast to every head, so it is shared like rotary cos / sin)."""
    _, plan = _family_plan("deepseek_v3")
    attention = "model.layers.1.self_attn."
    assert plan.styles[attention + "q_b_proj"] == "colwise" and plan.styles[attention + "kv_b_proj"] == "colwise"
    assert plan.styles[attention + "o_proj"] == "rowwise"
    assert attention + "kv_b_proj" not in plan.fused  # head by head: a contiguous split keeps whole heads
    assert {attention + "q_a_proj", attention + "kv_a_proj_with_mqa"} <= set(plan.replicated)
    # the rotary key [batch, 1 head, tokens, 4] broadcast to the heads: its gradient is summed over the ranks
    assert plan.shared_heads == {f"model.layers.{i}.self_attn": [(4, 1, 4)] for i in range(4)}, plan.shared_heads
    assert plan.experts == [f"model.layers.{i}.mlp.experts" for i in (1, 2, 3)]


def test_complex_rotary_embeddings_and_banks_called_with_every_experts_rows_are_split():
    """Llama 4: its rotary embedding runs through view_as_complex / view_as_real (whole heads pass), and
    its bank takes one input of every expert's rows (4 groups)."""
    model, plan = _family_plan("llama4")
    attention = "model.layers.0.self_attn."
    assert all(plan.styles[attention + n] == "colwise" for n in ("q_proj", "k_proj", "v_proj"))
    assert plan.styles[attention + "o_proj"] == "rowwise"
    assert plan.experts == [f"model.layers.{i}.feed_forward.experts" for i in range(4)]
    assert split_share(model, plan) > 0.99


@pytest.mark.parametrize("name", ["olmo2", "olmoe"])
def test_a_norm_over_a_whole_projection_is_split_with_it(name):
    """OLMo 2 and OLMoE normalise the whole query and key projections (RMSNorm over every head's
    features, 32 and 16 wide): the attention is split all the same, those norms with it (their weights
    sharded, their reduction summed over the ranks); the block's own norms stay whole."""
    _, plan = _family_plan(name)
    attention = "model.layers.0.self_attn."
    assert all(plan.styles[attention + n] == "colwise" for n in ("q_proj", "k_proj", "v_proj"))
    assert plan.feature_norms == {f"model.layers.{i}.self_attn.{n}_norm": w
                                  for i in range(4) for n, w in (("q", 32), ("k", 16))}, plan.feature_norms
    assert "model.layers.0.post_attention_layernorm" in plan.replicated


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_stand_in_matches_and_keeps_its_keys(batch_first):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=batch_first)
    stand_in = SeparateProjectionAttention(mha)
    x = torch.randn(3, 6, 32) if batch_first else torch.randn(6, 3, 32)
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[0, -2:] = True
    for kwargs in ({}, {"attn_mask": causal}, {"attn_mask": causal.isinf()}, {"key_padding_mask": padding},
                   {"attn_mask": causal, "need_weights": False}):
        want, want_weights = mha(x, x, x, **kwargs)
        got, got_weights = stand_in(x, x, x, **kwargs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        if want_weights is not None:
            torch.testing.assert_close(got_weights, want_weights, rtol=1e-5, atol=1e-6)
    assert set(stand_in.state_dict()) == set(mha.state_dict())
    torch.testing.assert_close(stand_in.state_dict()["in_proj_weight"], mha.in_proj_weight)
    stand_in.load_state_dict(mha.state_dict())


# --- on 2 ranks ------------------------------------------------------------------------------------------
class GainedMLP(nn.Module):
    """An MLP whose hidden activation is scaled by a full-width parameter: the structure shows an
    up / down pair, but a column split of the hidden layer cannot meet the whole gain vector."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)
        self.gain = nn.Parameter(torch.ones(64))

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)) * self.gain)


class ScalarGainMLP(nn.Module):
    """An MLP whose hidden activation is scaled by one learned scalar: split, the forward matches (the
    scalar multiplies each rank's columns alike), but each rank's gradient of the scalar sums only its own
    columns, so the whole copies of it would drift apart."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)
        self.gain = nn.Parameter(torch.full((1,), 1.5))

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)) * self.gain)


class GroupedQKV(nn.Module):
    """Falcon-40B's fused layout: one projection holding, for each of 2 key / value groups, its 2 query
    heads, its key and its value ([.., groups, 4, head size]); attention with grouped keys."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 32), nn.Linear(16, 16)

    def forward(self, x):
        b, s, _ = x.shape
        t = self.qkv(x).view(b, s, -1, 4, 4)
        q = t[..., :2, :].reshape(b, s, -1, 4).transpose(1, 2)
        k, v = t[..., 2, :].transpose(1, 2), t[..., 3, :].transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return x + self.out(y.transpose(1, 2).reshape(b, s, -1))


def test_a_projection_fused_group_by_group_is_split_as_it_is():
    """Parts of unequal widths (4 query heads, 2 key and 2 value heads) are read where they are cut; laid
    out key / value group by group, a contiguous split gives each rank whole groups: no reordering."""
    model = GroupedQKV()
    flow = record_dataflow(model, lambda m: m(torch.randn(2, 8, 16)))
    plan = find_tp_plan(model, 2, flow)
    assert plan.styles == {"qkv": "colwise", "out": "rowwise"} and plan.fused == {}


def _vectors(n: int):
    return [torch.randn(16, generator=torch.Generator().manual_seed(i)) for i in range(n)]


def _sequences(n: int):
    return [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(n)]


def _quiet_fused_mlp() -> nn.Module:
    """A [gate | up] MLP whose output is small beside the residual stream (as at initialisation)."""
    torch.manual_seed(0)
    model = _FusedGateMLP()
    with torch.no_grad():
        model.down.weight.mul_(1e-4)
        model.down.bias.zero_()
    return model


class _QuietFusedStack(nn.Module):
    """Two quiet [gate | up] MLP blocks: repeated blocks, as sequence parallelism needs."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_quiet_fused_mlp() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


CUSTOM = {"gained": (GainedMLP, _vectors), "grouped": (GroupedQKV, _sequences),
          "scalar_gain": (ScalarGainMLP, _vectors), "quiet_fused": (_quiet_fused_mlp, _sequences),
          "quiet_fused_sp": (_QuietFusedStack, _sequences)}
# a plan given by the user, which knows nothing of the fused parts: split contiguously, wrong
GIVEN_PLANS = {"quiet_fused": {"up": "colwise", "down": "rowwise"},
               "quiet_fused_sp": {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}}
SEQUENCE_PARALLEL = {"quiet_fused_sp"}


def _tp_run(model_name: str) -> dict:
    from atorch.auto.accelerate import auto_accelerate

    torch.manual_seed(0)
    custom = model_name in CUSTOM
    model = CUSTOM[model_name][0]() if custom else ZOO[model_name].build()
    dataset = CUSTOM[model_name][1](16) if custom else ZOO[model_name].make_dataset(16, 0)
    loss = (lambda batch, out: out.pow(2).mean()) if custom else ZOO[model_name].loss_func
    try:
        status, result, _ = auto_accelerate(model, torch.optim.SGD, dataset, loss, optim_args={"lr": 0.01},
                                            dataloader_args={"batch_size": 4},
                                            load_strategy=[("parallel_mode", ([("tensor", 2)], None)),
                                                           ("tensor_parallel", {"plan": GIVEN_PLANS[model_name]})
                                                           if model_name in GIVEN_PLANS else "tensor_parallel",
                                                           *(["sequence_parallel"] if model_name in SEQUENCE_PARALLEL
                                                             else [])],
                                            ignore_dryrun_on_load_strategy=True)
    except MethodConfigError as error:
        return {"refused": str(error)}
    return {"extras": result.args.extras["tensor_parallel"]}


def _fault_once_split(rank: int):
    """A forward pre-hook that raises on ``rank`` the first time its block runs split (the plan's
    check), while the other rank goes on into the block's tensor-parallel collectives."""
    def hook(module, args):
        if dist.get_rank() == rank and isinstance(module.attention.wq.weight, DTensor) and not hook.fired:
            hook.fired = True
            raise RuntimeError(f"injected fault on rank {rank}")
    hook.fired = False
    return hook


def _rank_local_fault() -> dict:
    """One rank raises inside the plan's check while the other waits in a collective: every rank must
    end with a typed error, promptly, and the process group must still work."""
    from atorch.auto.accelerate import auto_accelerate

    torch.manual_seed(0)
    model = ZOO["titan_llama"].build()
    model.layers["1"].register_forward_pre_hook(_fault_once_split(1))
    started = time.monotonic()
    try:
        auto_accelerate(model, torch.optim.SGD, ZOO["titan_llama"].make_dataset(16, 0), ZOO["titan_llama"].loss_func,
                        optim_args={"lr": 0.01}, dataloader_args={"batch_size": 4},
                        load_strategy=[("parallel_mode", ([("tensor", 2)], None)), "tensor_parallel"],
                        ignore_dryrun_on_load_strategy=True)
        outcome = "no error"
    except AtorchError as error:
        outcome = f"{type(error).__name__}: {error}"
    seconds = time.monotonic() - started
    value = torch.ones(1)
    dist.all_reduce(value)
    return {"outcome": outcome, "seconds": seconds, "all_reduce": value.item()}


def _head_norm_grads() -> dict:
    """Qwen3 split over 2 ranks: the gradients of its per-head q / k norms (each rank sees its own heads)
    and of its other replicated norms against one process's, after one backward on the same batch."""
    from atorch.auto.accelerate import auto_accelerate

    zoo = ZOO["qwen3"]
    torch.manual_seed(0)
    model = zoo.build()
    reference = copy.deepcopy(model)
    dataset = zoo.make_dataset(16, 0)
    batch = torch.utils.data.default_collate([dataset[i] for i in range(4)])
    zoo.loss_func(batch, reference(**batch)).backward()
    expected = {n: p.grad for n, p in reference.named_parameters() if "norm" in n}
    _, result, _ = auto_accelerate(model, torch.optim.SGD, dataset, zoo.loss_func, optim_args={"lr": 0.01},
                                   dataloader_args={"batch_size": 4}, model_input_format=zoo.input_format,
                                   load_strategy=[("parallel_mode", ([("tensor", 2)], None)), "tensor_parallel"],
                                   ignore_dryrun_on_load_strategy=True)
    zoo.loss_func(batch, result.model(**batch)).backward()
    got = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
           for n, p in result.model.named_parameters()}
    diffs = {}
    for name, grad in expected.items():
        mine = next(g for n, g in got.items() if n.endswith(name))
        diffs[name] = ((mine - grad).abs().max() / grad.abs().max()).item()
    return {"diffs": diffs, "head_norms": result.args.extras["tensor_parallel"]["per_head_norms"]}


def _bf16_weights_losses(sequence: bool) -> dict:
    """A Llama the user cast to bf16 (``model.to(torch.bfloat16)``; HF returns its logits in fp32): 3 SGD
    steps under tensor 2 (and sequence parallelism) against one process on the same batches. The plan's
    check compared the bf16 layers' outputs at fp32's tolerance and refused every such model."""
    from atorch.auto.accelerate import auto_accelerate

    zoo = ZOO["llama"]
    torch.manual_seed(0)
    model = zoo.build().to(torch.bfloat16)
    reference = copy.deepcopy(model)
    dataset = zoo.make_dataset(12, 0)
    batches = [torch.utils.data.default_collate([dataset[i] for i in range(j, j + 4)]) for j in (0, 4, 8)]
    expected = train_plainly(reference, batches, zoo.loss_func, lr=0.05)
    try:
        _, result, _ = auto_accelerate(
            model, torch.optim.SGD, dataset, zoo.loss_func, optim_args={"lr": 0.05}, dataloader_args={"batch_size": 4},
            model_input_format=zoo.input_format, ignore_dryrun_on_load_strategy=True,
            load_strategy=[("parallel_mode", ([("tensor", 2)], None)), "tensor_parallel",
                           *(["sequence_parallel"] if sequence else [])])
    except MethodConfigError as error:
        return {"refused": str(error)}
    # the same batches: the returned loader's, in order (no data-parallel split under tensor 2 alone)
    return {"expected": expected, "got": train_returned(result, len(batches), zoo.input_format)}


def _both() -> dict:
    return {**{name: _tp_run(name) for name in ("gained", "grouped", "scalar_gain", "quiet_fused", "quiet_fused_sp",
                                                 "titan_llama")},
            "fault": _rank_local_fault(),
            "head_norms": _head_norm_grads(),
            "bf16_weights": {"tp": _bf16_weights_losses(False), "tp_sp": _bf16_weights_losses(True)}}


@pytest.mark.multirank
def test_on_two_ranks_a_wrong_plan_is_refused_up_front_and_a_good_one_is_reported():
    for per_rank in run_distributed(_both, 2):
        refused = per_rank["gained"].get("refused", "")
        assert "does not reproduce the unsplit model" in refused and "up" in refused, per_rank["gained"]
        # the forward matches, but the whole scalar's gradient differs per rank: refused, naming it
        scalar = per_rank["scalar_gain"].get("refused", "")
        assert "gain is kept whole on every tensor rank but gets a different gradient" in scalar, scalar
        # a wrong MLP whose output hides behind the residual stream (the model's output moves by 1e-4, inside
        # the output's tolerance): its row-wise Linear's output is compared too, and refused, naming it
        quiet = per_rank["quiet_fused"].get("refused", "")
        assert "down's output (call 0) differs by" in quiet and "a split part computes something else" in quiet, quiet
        # under sequence parallelism that output is split over the tokens: the ranks' fingerprints, summed
        quiet = per_rank["quiet_fused_sp"].get("refused", "")
        assert "blocks.0.down's output (call 0) differs by" in quiet, quiet
        grouped = per_rank["grouped"]["extras"]  # accepted: the split reproduced the unsplit model on 2 ranks
        assert grouped["colwise"] == ["qkv"] and grouped["fused"] == {}, grouped
        report = per_rank["titan_llama"]["extras"]
        assert report["found_by"] == "structure"
        assert "layers.0.attention.wq" in report["colwise"] and "layers.0.feed_forward.w2" in report["rowwise"]
        assert report["vocabulary"] and report["split_share"] > 0.9
        assert "norm" in report["replicated"] and report["why_whole"] == {}
        fault = per_rank["fault"]
        assert "injected fault on rank 1" in fault["outcome"], fault
        assert fault["seconds"] < 60 and fault["all_reduce"] == 2.0, fault
        norms = per_rank["head_norms"]
        assert "model.layers.0.self_attn.q_norm" in norms["head_norms"], norms
        # without summing over the ranks each q / k norm gradient would hold only this rank's heads' part
        assert max(norms["diffs"].values()) < 1e-5 and len(norms["diffs"]) == 4 * 4 + 1, norms["diffs"]
        # a model cast to bf16 is split and trains as one process does, within bf16's parity tolerance (2e-2)
        for layout, run in per_rank["bf16_weights"].items():
            assert "refused" not in run, (layout, run)
            assert relative_difference(run["got"], run["expected"]) < 2e-2, (layout, run)


class _WeightsAttention(nn.Module):
    """An attention returning its weights beside its output, as HF eager attention does."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights = torch.softmax(x @ x.transpose(-1, -2), dim=-1)
        return weights @ x, weights


class _CheckpointedAttentionModel(nn.Module):
    def __init__(self, return_weights: bool = False):
        super().__init__()
        self.proj, self.attn, self.return_weights = nn.Linear(4, 4), _WeightsAttention(), return_weights

    def forward(self, x: torch.Tensor) -> object:
        out, weights = torch.utils.checkpoint.checkpoint(self.attn, self.proj(x), use_reentrant=True)
        return (out, weights) if self.return_weights else out


def test_what_split_layers_return_is_recorded_within_the_model_s_forward_only():
    """The recorders behind tensor_parallel's output checks (``tp_outputs``: a split attention's weights in
    the model's output refused; ``sequence_parallel``: the shards handed between blocks gathered where the
    output holds them) keep tensors for one forward of the model. A reentrant checkpoint's recompute in
    backward (HF's gradient_checkpointing_enable, atorch's checkpoint with no_reentrant=False) runs the layers
    and their hooks again outside it: what they return then is not kept (it was, until the next forward,
    every layer's recomputed attention weights or hidden state)."""
    from atorch.auto.opt_lib.sequence_parallel import SequenceRegion, _HandedShards
    from atorch.auto.opt_lib.tp_outputs import refuse_head_outputs
    from atorch.errors import InputError

    model = _CheckpointedAttentionModel()
    refuse_head_outputs(model, ["attn"])
    recorder = next(hook.__self__ for hook in model._forward_hooks.values())
    model(torch.randn(2, 3, 4, requires_grad=True)).sum().backward()
    assert all(slot.outputs == () for slot in recorder.slots) and not recorder.active
    returning = _CheckpointedAttentionModel(return_weights=True)
    refuse_head_outputs(returning, ["attn"])
    with pytest.raises(InputError, match="attention weights of this rank's heads"):
        returning(torch.randn(2, 3, 4))

    handed, region = _HandedShards(device_mesh=None), SequenceRegion(blocks=["attn"])
    handed.begin(model, ())
    handed.record(region, model, (), torch.ones(2))
    assert handed.gather_in_output(model, (), torch.zeros(2)) is None and handed.shards == []
    handed.record(region, model, (), torch.ones(2))  # a recompute in backward, after the forward ended
    assert handed.shards == []


class _AttentionBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.attn = nn.Linear(4, 4), _WeightsAttention()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, weights = self.attn(self.proj(x))
        return x + out, weights


class _AttentionStack(nn.Module):
    """Four blocks whose attention returns its weights (HF eager attention); the model returns the last
    block's with ``return_weights`` (transformers' ``output_attentions=True``)."""

    def __init__(self, return_weights: bool = False):
        super().__init__()
        self.blocks, self.return_weights = nn.ModuleList(_AttentionBlock() for _ in range(4)), return_weights

    def forward(self, x: torch.Tensor) -> object:
        for block in self.blocks:
            x, weights = block(x)
        return (x, weights) if self.return_weights else x


def _compiled_graphs(model: nn.Module, scope: str, attentions: list[str]) -> int:
    """How many graphs native_dynamo's compile of ``model`` (dynamo only: the eager backend) builds for one
    forward and backward, with the attention recorders on ``attentions``."""
    from atorch.auto.opt_lib.native_dynamo import NativeDynamoConfig, compile_model
    from atorch.auto.opt_lib.tp_outputs import refuse_head_outputs

    torch._dynamo.reset()
    refuse_head_outputs(model, attentions)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = compile_model(model, NativeDynamoConfig(scope=scope, backend="eager"))
    out = compiled(torch.randn(2, 3, 4, requires_grad=True))
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    return torch._dynamo.utils.counters["stats"]["unique_graphs"] - before


def test_split_attention_weights_are_recorded_inside_compiled_code_without_a_graph_per_layer():
    """Under native_dynamo the attention recorders run inside the compiled code (they were skipped there:
    a compiled model split by tensor_parallel returned this rank's heads' attention weights, and under
    sequence parallelism this rank's tokens as every layer's hidden state, silently). Each attention writes
    its own slot: the blocks' shared graph reads no list they grow, so the recorders add no graph (a list
    of what was seen made dynamo guard on its length and compile a graph for each of the 4 layers)."""
    from atorch.errors import InputError

    attentions = [f"blocks.{i}.attn" for i in range(4)]
    plain = _compiled_graphs(_AttentionStack(), "blocks", [])
    assert _compiled_graphs(_AttentionStack(), "blocks", attentions) == plain, plain
    for scope in ("blocks", "model"):
        with pytest.raises(InputError, match="blocks.3.attn"):
            _compiled_graphs(_AttentionStack(return_weights=True), scope, attentions)
