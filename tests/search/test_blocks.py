"""The repeated block that the search, checkpointing, FSDP units, pipeline cuts, native_dynamo's regional
compilation and the planner's layer count all start from (``atorch.utils.modules.repeated_blocks``):
derived from the module tree alone, never from a class name, it is the transformer layer of every zoo
family; a stack of layers (T5's encoder and decoder, CLIP's two encoders) comes after its layers, and a
list of experts inside a layer does not demote the layer. The pipeline's blocks (``block_stack``) are a list's
layers of every class where the largest class shares its list with others (Jamba, Zamba)."""
from __future__ import annotations

import pytest
from torch import nn

from atorch.auto.opt_lib.native_dynamo import compiled_blocks
from atorch.auto.search.analyser import analyse_model
from atorch.auto.search.candidates import Candidate
from atorch.testing.hf_models import ZOO, zoo_model
from atorch.utils.modules import block_stack, repeated_blocks


@pytest.mark.parametrize("name", sorted(ZOO))
def test_the_first_repeated_block_is_the_layer_of_every_zoo_family(name):
    zoo = ZOO[name]
    counts, _ = repeated_blocks(zoo.build())
    assert next(iter(counts)) == zoo.block
    assert analyse_model(zoo.build()).main_block == zoo.block
    assert {type(m).__name__ for m in compiled_blocks(zoo.build())} == {zoo.block}  # native_dynamo's "blocks"


class Mixer(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.q, self.o = nn.Linear(width, width), nn.Linear(width, width)


class Layer(nn.Module):
    """A layer made of sub-blocks (an attention-like mixer and an MLP)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.norm, self.mix = nn.LayerNorm(width), Mixer(width)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.Linear(width, width))


class Tower(nn.Module):
    """A stack of layers and its own embedding: larger than a layer, repeated twice."""

    def __init__(self, depth: int):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.layers = nn.ModuleList(Layer() for _ in range(depth))


class Expert(nn.Module):
    """An expert: its projections alone."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)


class ExpertLayer(nn.Module):
    """A layer holding its experts' list directly: a layer, not a stack (its list is one part of it)."""

    def __init__(self):
        super().__init__()
        self.attn = Layer()
        self.experts = nn.ModuleList(Expert() for _ in range(4))


def test_a_stack_of_layers_comes_after_its_layers_and_a_layer_of_experts_stays_first():
    towers = nn.ModuleDict({"text": Tower(3), "image": Tower(2)})
    counts, _ = repeated_blocks(nn.Sequential(towers))
    assert list(counts)[:1] == ["Layer"] and list(counts)[-1] == "Tower"
    experts = nn.ModuleList(ExpertLayer() for _ in range(3))
    counts, _ = repeated_blocks(nn.Sequential(experts))
    assert next(iter(counts)) == "ExpertLayer"


class RecurrentLayer(nn.Module):
    """A layer of another class (a Mamba-like mixer and a norm), smaller than ``Layer``."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.norm, self.mix = nn.LayerNorm(width), nn.Sequential(nn.Linear(width, width))


class HybridLayer(nn.Module):
    """A layer holding a ``Layer`` and a recurrent layer of its own (Zamba's hybrid layer)."""

    def __init__(self):
        super().__init__()
        self.inner, self.recurrent = Layer(), RecurrentLayer()


class Stack(nn.Module):
    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.embed, self.layers, self.norm = nn.Embedding(16, 8), nn.ModuleList(layers), nn.LayerNorm(8)


def test_a_list_of_layers_of_several_classes_is_the_stack_of_blocks():
    """The pipeline cuts at ``block_stack``'s layers: the largest repeated class's instances, or, where those
    share one list with layers of other classes (Jamba's Mamba and attention layers alternating, Zamba's
    hybrid layers holding a Mamba layer of their own), every layer of that list, in order; a list holding a
    bare Linear beside the layers is not a stack, and one class alone stays as it is."""
    mixed = Stack([RecurrentLayer(), Layer(), RecurrentLayer(), Layer()])
    assert [n for n, _ in block_stack(mixed)] == [f"layers.{i}" for i in range(4)]
    nested = Stack([Layer(), HybridLayer(), Layer(), Layer()])
    assert [n for n, _ in block_stack(nested)] == [f"layers.{i}" for i in range(4)]
    with_leaf = Stack([Layer(), nn.Linear(8, 8), Layer()])
    assert [n for n, _ in block_stack(with_leaf)] == ["layers.0", "layers.2"]
    plain = Stack([Layer() for _ in range(3)])
    assert [n for n, _ in block_stack(plain)] == ["layers.0", "layers.1", "layers.2"]
    towers = nn.ModuleDict({"text": Tower(3), "image": Tower(2)})  # two lists of one class: the layers as found
    assert len(block_stack(nn.Sequential(towers))) == 5


def test_the_search_checkpoints_and_shards_every_class_of_a_mixed_stack():
    """Jamba's layers are of two classes: the search's candidates checkpoint and shard both (the attention
    layers alone would leave every Mamba layer's activations kept and its parameters in the root unit,
    gathered for the whole step)."""
    profile = analyse_model(zoo_model("jamba").build())
    assert profile.layer_classes == ("JambaMambaDecoderLayer", "JambaAttentionDecoderLayer")
    candidate = Candidate("fsdp", "fp32", True, block=profile.block_classes)
    items = {item.name: item.config for item in candidate.strategy(2)}
    assert tuple(items["checkpoint"]) == profile.layer_classes
    assert tuple(items["fsdp"]["atorch_wrap_cls"]) == profile.layer_classes
    llama = analyse_model(zoo_model("llama").build())
    assert llama.layer_classes == () and llama.block_classes == ("LlamaDecoderLayer",)
