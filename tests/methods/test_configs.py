"""Typed method configs: the shared validator's errors (unknown key with the nearest one, wrong type,
out of range, missing), the forms each method accepts, round trips of every built-in method's
config through JSON and pickle strategy files, and the generated config docs."""
from __future__ import annotations

import dataclasses
import enum
import subprocess
import sys
from pathlib import Path
from typing import Literal, Optional

import pytest
import torch
from torch import nn

from atorch.auto import opt_lib
from atorch.auto.opt_lib import BUILTIN_METHODS
from atorch.auto.opt_lib.activation_checkpoint import CheckpointConfig
from atorch.auto.opt_lib.amp import AmpNativeConfig
from atorch.auto.opt_lib.base import Optimization
from atorch.auto.opt_lib.fsdp import FSDPConfig
from atorch.auto.opt_lib.half import HalfConfig
from atorch.auto.opt_lib.module_replace import ModuleReplaceConfig
from atorch.auto.opt_lib.pipeline_parallel import PipelineParallelConfig
from atorch.auto.strategy import Strategy
from atorch.distributed.mesh import ParallelModeConfig
from atorch.errors import MethodConfigError
from atorch.models.gpt import GPTBlock
from atorch.utils.config import MethodConfig, option, validate_config

ROOT = Path(__file__).resolve().parents[2]

# a config differing from the defaults in as many fields as one strategy allows, for every built-in method
NON_DEFAULT = {
    "parallel_mode": ([("tensor", 1), ("data", 1)], [0]),
    "amp_native": {"dtype": "bf16", "skip_if_nonfinite": True},
    "half": torch.bfloat16,
    "checkpoint": {"wrap_class": (GPTBlock, "MLP", "blocks.*.attn"), "no_reentrant": False},
    "zero1": {"use_ds_zero": True},
    "zero2": {"not_use_fsdp": True},
    "fsdp": {"atorch_wrap_cls": [GPTBlock], "atorch_ignored_cls": "LayerNorm", "cpu_offload": True,
             "sharding_strategy": "SHARD_GRAD_OP", "backward_prefetch": "BACKWARD_PRE", "use_orig_params": True},
    "module_replace": ["repo_attention", "fused_layernorm"],
    "fp8": {"include": "blocks", "exclude": ["lm_head"], "fp8_format": "E4M3", "margin": 1, "reduce_amax": False},
    "native_dynamo": {"backend": "eager", "mode": "max-autotune", "dynamic": False},
    "tensor_parallel": {"plan": {"blocks.*.attn.c_attn": "colwise", "blocks.*.attn.c_proj": "rowwise"}},
    "sequence_parallel": True,
    "pipeline_parallel": {"schedule": "Interleaved1F1B", "num_micro_batch": 4, "pivots": ["blocks.2"],
                          "stages_per_rank": 2},
    "mixed_parallel": {"pipeline": {"schedule": "GPipe", "num_micro_batch": 8},
                       "tensor": {"plan": {"blocks.*.mlp.fc": "colwise"}}},
    "ds_3d_parallel": {"num_micro_batch": 4, "partition_method": "uniform"},
    "micro_batch": {"num_micro_batch": 4},
}


def normalize(name, config=None):
    return opt_lib.get_optimization(name).normalize(config)


def assert_config_error(name, config, message):
    with pytest.raises(MethodConfigError) as info:
        normalize(name, config)
    assert message in str(info.value)


def test_every_builtin_method_declares_a_frozen_dataclass_config_with_documented_fields():
    assert set(NON_DEFAULT) == {m.name for m in BUILTIN_METHODS}
    for method in BUILTIN_METHODS:
        cls = method.config_class
        assert issubclass(cls, MethodConfig) and dataclasses.is_dataclass(cls), method.name
        assert cls.__dataclass_params__.frozen, method.name
        assert all(row.doc for row in cls.field_docs()), method.name
    for dead in ("candidates", "is_tunable", "default_config"):
        assert not any(hasattr(m, dead) for m in (Optimization, *BUILTIN_METHODS)), dead


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_configs_round_trip_through_json_and_pickle(name, tmp_path):
    config = normalize(name, NON_DEFAULT[name])
    assert isinstance(config, opt_lib.get_optimization(name).config_class)
    assert normalize(name, config) == config  # normalizing is idempotent
    if name != "sequence_parallel":  # it has no fields
        assert config.to_dict(), f"{name}: the test config should differ from the defaults"
    strategy = Strategy([(name, config)])
    for loaded in (Strategy.from_json(strategy.to_json()), Strategy.from_bytes(strategy.to_bytes())):
        assert loaded == strategy
        assert normalize(name, loaded.get(name)) == config
    # plain data in the file: the restricted unpickler needs no global for the config class
    assert type(config).__name__.encode() not in strategy.to_bytes()
    for suffix in (".json", ".pkl"):
        strategy.save(tmp_path / f"s{suffix}")
        assert normalize(name, Strategy.load(tmp_path / f"s{suffix}").get(name)) == config


@pytest.mark.parametrize("name, config, expected", [
    ("amp_native", None, AmpNativeConfig()),
    ("amp_native", torch.bfloat16, AmpNativeConfig(dtype=torch.bfloat16)),
    ("amp_native", "bf16", AmpNativeConfig(dtype=torch.bfloat16)),
    ("amp_native", {"dtype": "half", "init_scale": 1024}, AmpNativeConfig(dtype=torch.float16, init_scale=1024.0)),
    ("half", None, HalfConfig(dtype=torch.float16)),
    ("half", "bf16", HalfConfig(dtype=torch.bfloat16)),
    ("checkpoint", (GPTBlock,), CheckpointConfig(wrap_class=(GPTBlock,))),
    ("checkpoint", "GPTBlock", CheckpointConfig(wrap_class=("GPTBlock",))),
    ("checkpoint", {"wrap_class": ["GPTBlock"], "no_reentrant": False},
     CheckpointConfig(("GPTBlock",), no_reentrant=False)),
    # none named: the model's layers, found from its structure when the strategy is applied
    ("checkpoint", None, CheckpointConfig(wrap_class=("auto",))),
    ("checkpoint", "auto", CheckpointConfig(wrap_class=("auto",))),
    ("checkpoint", {"no_reentrant": False}, CheckpointConfig(("auto",), no_reentrant=False)),
    ("checkpoint", {"ratio": 0.5}, CheckpointConfig(("auto",), ratio=0.5)),
    ("parallel_mode", ([("data", 2)], None), ParallelModeConfig(dims=(("data", 1),))),  # fitted to one process
    ("parallel_mode", None, ParallelModeConfig(dims=(("data", 1),))),
    ("module_replace", None, ModuleReplaceConfig()),
    ("module_replace", "repo_attention", ModuleReplaceConfig(pairs=("repo_attention",))),
    ("pipeline_parallel", {"pivots": ("blocks.1",)}, PipelineParallelConfig(pivots=("blocks.1",))),
    ("fsdp", {"atorch_wrap_cls": ("GPTBlock",)}, FSDPConfig(atorch_wrap_cls=("GPTBlock",))),
])
def test_accepted_forms(name, config, expected):
    assert normalize(name, config) == expected


def test_a_callable_dynamo_backend_is_kept():
    def backend(graph, inputs):
        return graph

    assert normalize("native_dynamo", {"backend": backend}).backend is backend


def test_fsdp1_enums_are_taken_by_name():
    class ShardingStrategy(enum.Enum):  # what FSDP1 users pass
        SHARD_GRAD_OP = 2

    assert normalize("fsdp", {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}).sharding_strategy == "SHARD_GRAD_OP"


@pytest.mark.parametrize("name, config, message", [
    ("amp_native", {"dtpye": "bf16"}, "amp_native: unknown key 'dtpye' (did you mean 'dtype'?); valid keys: dtype, "
                                      "skip_if_nonfinite, init_scale, growth_factor, backoff_factor, growth_interval"),
    ("fsdp", {"atorch_wrap_class": ("GPTBlock",)}, "unknown key 'atorch_wrap_class' (did you mean 'atorch_wrap_cls'?)"),
    ("pipeline_parallel", {"num_microbatch": 2}, "unknown key 'num_microbatch' (did you mean 'num_micro_batch'?)"),
    ("mixed_parallel", {"pipeline": {"shedule": "GPipe"}},
     "unknown key 'pipeline.shedule' (did you mean 'pipeline.schedule'?)"),
    ("native_dynamo", {"full_graph": True}, "unknown key 'full_graph' (did you mean 'fullgraph'?)"),
    ("zero2", {"use_ds_zero": True, "cpu_ofload": True}, "unknown key 'cpu_ofload' (did you mean 'cpu_offload'?)"),
    ("sequence_parallel", {"on": True}, "valid keys: none (this method takes no config)"),
])
def test_unknown_keys_name_the_nearest_valid_key(name, config, message):
    assert_config_error(name, config, message)


@pytest.mark.parametrize("name, config, message", [
    ("amp_native", {"skip_if_nonfinite": 1}, "skip_if_nonfinite=1 is not valid: expected a bool (True or False)"),
    ("amp_native", {"dtype": torch.float32}, "dtype=torch.float32 is not valid: expected one of "
                                             "[torch.float16 ('fp16'), torch.bfloat16 ('bf16')]"),
    ("half", "fp8", "dtype='fp8' is not valid: expected one of [torch.float16 ('fp16'), torch.bfloat16 ('bf16')]"),
    ("fsdp", {"cpu_offload": "yes"}, "cpu_offload='yes' is not valid: expected a bool"),
    ("fsdp", {"atorch_size_based_min_num_params": 1e6}, "atorch_size_based_min_num_params=1000000.0 is not valid: "
                                                        "expected an int or None"),
    ("fsdp", {"atorch_ignored_cls": [nn.LayerNorm, 3]},
     "atorch_ignored_cls[1]=3 is not valid: expected str or nn.Module class"),
    ("ds_3d_parallel", {"num_micro_batch": True}, "num_micro_batch=True is not valid: expected an int"),
    ("pipeline_parallel", {"schedule": "ZeroBubble"}, "schedule='ZeroBubble' is not valid: expected one of ['1F1B', "),
    ("native_dynamo", {"mode": "fastest"}, "mode='fastest' is not valid: expected one of ['default', "),
    ("tensor_parallel", {"plan": {"blocks.*": "diagonal"}}, "plan[0][1]='diagonal' is not valid: expected one of "
                                                            "['colwise', 'rowwise']"),
    ("parallel_mode", {"dims": [("tensor", "2")]}, "dims[0][1]='2' is not valid: expected an int"),
    ("native_dynamo", {"backend": 3}, "backend=3 is not valid: expected str or callable"),
    ("zero1", "deepspeed", "config must be a dict with keys among ['use_ds_zero'], got 'deepspeed'"),
    ("mixed_parallel", {"tensor": "auto"}, "tensor must be a dict with keys among ['plan'], got 'auto'"),
])
def test_wrong_types_name_the_key_the_value_and_what_is_valid(name, config, message):
    assert_config_error(name, config, message)


@pytest.mark.parametrize("name, config, message", [
    ("fsdp", {"atorch_size_based_min_num_params": 0},
     "atorch_size_based_min_num_params=0 is out of range: expected >= 1"),
    ("pipeline_parallel", {"num_micro_batch": -2}, "num_micro_batch=-2 is out of range: expected >= 1"),
    ("ds_3d_parallel", {"num_micro_batch": 0}, "num_micro_batch=0 is out of range: expected >= 1"),
    ("amp_native", {"backoff_factor": 1.5}, "backoff_factor=1.5 is out of range: expected >= 0.0 and <= 1.0"),
    ("fp8", {"amax_history_len": 0}, "amax_history_len=0 is out of range: expected >= 1"),
    ("checkpoint", {"ratio": 1.5}, "ratio=1.5 is out of range: expected >= 0.0 and <= 1.0"),
])
def test_out_of_range_values(name, config, message):
    assert_config_error(name, config, message)


@pytest.mark.parametrize("name, config, message", [
    ("checkpoint", (), "wrap_class is empty"),
    ("checkpoint", {"ratio": 0}, "ratio=0 recomputes nothing"),
    ("fsdp", {"atorch_wrap_cls": "GPTBlock", "atorch_size_based_min_num_params": 10}, "either"),
    ("amp_native", {"dtype": "bf16", "growth_interval": 10}, "grad-scaler keys ['growth_interval'] apply to fp16 only"),
    ("pipeline_parallel", {"schedule": "GPipe", "stages_per_rank": 2}, "goes with schedule 'Interleaved1F1B'"),
    ("mixed_parallel", {"pipeline": {"schedule": "Interleaved1F1B", "stages_per_rank": 1}}, "Interleaved1F1B"),
    ("zero2", {"sharding_strategy": "FULL_SHARD"}, "use the fsdp method for ZeRO-3"),
    ("module_replace", ["flash_attn_v9"], "unknown replace pair(s) ['flash_attn_v9']"),
])
def test_missing_keys_and_rules_across_keys(name, config, message):
    assert_config_error(name, config, message)


@dataclasses.dataclass(frozen=True)
class _Toy(MethodConfig):
    ratio: float = option(0.5, doc="a float", minimum=0.0)
    count: int = option(1, doc="an int")
    names: tuple[str, ...] = option((), doc="names")
    module: Optional[type[nn.Module]] = option(None, doc="a module class")
    kind: Literal["a", "b"] = option("a", doc="a choice")


def test_validator_conversions_and_to_dict():
    toy = validate_config("toy", _Toy, {"ratio": 2, "names": "x", "module": nn.Linear, "kind": "b"})
    assert toy == _Toy(ratio=2.0, names=("x",), module=nn.Linear, kind="b") and isinstance(toy.ratio, float)
    assert validate_config("toy", _Toy, {"names": ["x", "y"]}).names == ("x", "y")
    assert validate_config("toy", _Toy, toy) == toy
    assert toy.to_dict() == {"ratio": 2.0, "names": ("x",), "module": nn.Linear, "kind": "b"}
    assert set(toy.to_dict(omit_defaults=False)) == {"ratio", "count", "names", "module", "kind"}
    assert str(_Toy(count=3)) == "_Toy(count=3)"
    with pytest.raises(MethodConfigError, match=r"toy: count=True is not valid: expected an int"):
        validate_config("toy", _Toy, {"count": True})
    with pytest.raises(MethodConfigError, match=r"module=<class 'int'> is not valid: expected nn.Module class or None"):
        validate_config("toy", _Toy, {"module": int})
    rows = {row.name: row for row in _Toy.field_docs()}
    assert rows["kind"].type == "'a' | 'b'" and rows["ratio"].default == "0.5"
    assert rows["module"].doc == "a module class"


def test_a_users_method_may_declare_a_config_class_or_take_any_config():
    class Custom(Optimization):
        name = "custom_for_test"

        def transform(self, ctx, config):
            pass

    marker = object()
    assert Custom().normalize(marker) is marker and Custom().normalize(None) is None

    class Typed(Custom):
        name = "typed_for_test"
        config_class = _Toy

    assert Typed().normalize({"count": 2}) == _Toy(count=2)
    with pytest.raises(MethodConfigError, match="typed_for_test: unknown key 'cont' \\(did you mean 'count'"):
        Typed().normalize({"cont": 2})

    class Untyped(Custom):
        config_class = dict

    with pytest.raises(TypeError, match="config_class must be"):
        opt_lib.register_optimization(Untyped)


def test_strategy_str_shows_the_non_default_fields():
    strategy = Strategy([("amp_native", normalize("amp_native", "bf16")), ("half", normalize("half")),
                         ("checkpoint", normalize("checkpoint", (GPTBlock,)))])
    text = str(strategy)
    assert "0. amp_native: dtype=torch.bfloat16\n" in text and "1. half: default" in text
    assert "2. checkpoint: wrap_class=(GPTBlock,)" in text


def test_generated_config_docs_cover_every_builtin_method(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_method_configs.py"), "--stdout"],
                         capture_output=True, text=True, check=True)
    for method in BUILTIN_METHODS:
        section = run.stdout.split(f"### {method.name}\n", 1)[1].split("###", 1)[0]
        fields = method.config_class.field_docs()
        assert ("| key | type | default | description |" in section) == bool(fields), method.name
        assert all(f"| `{row.name}` |" in section for row in fields), method.name
    page = tmp_path / "methods.md"
    page.write_text("# Methods\n<!-- config:amp_native -->\nold table\n<!-- /config:amp_native -->\nkept\n"
                    "<!-- config:fsdp -->\n<!-- /config:fsdp -->\n")
    subprocess.run([sys.executable, str(ROOT / "docs" / "gen_method_configs.py"), "--file", str(page)], check=True,
                   capture_output=True)
    text = page.read_text()
    assert "old table" not in text and "kept\n" in text
    assert text.startswith("# Methods\n<!-- config:amp_native -->\n| key")
    assert "| `skip_if_nonfinite` | bool | `False` |" in text and "| `atorch_wrap_cls` |" in text
    assert text.count("<!-- /config:") == 2
