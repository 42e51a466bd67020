"""The bad-input matrix: every bad argument of ``auto_accelerate`` (its training inputs, its mode
arguments, its kargs, the strategy's configs) raises a typed ``AtorchError`` whose message names the
argument or key and what is valid (or the fix). None is accepted silently, none escapes as a raw
exception. Single-process cases run here; the cases that need several ranks run in ONE 2-rank gloo
launch. The summary line says ``N bad inputs: N typed, 0 raw, 0 silent``.

Each case is (id, a callable that should raise, the expected AtorchError subclass, substrings its
message must contain).
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any, Callable

import pytest
import torch
from torch.utils.data import Dataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler

from atorch.auto.accelerate import auto_accelerate
from atorch.errors import (
    AtorchError,
    DryRunError,
    IncompatibleMethodsError,
    InputError,
    MethodConfigError,
    ParallelModeError,
    StrategyError,
    StrategyFileError,
    UnknownMethodError,
)
from atorch.models import GPTBlock, GPTConfig, SyntheticTokenDataset, gpt_loss
from atorch.testing import run_distributed
from atorch.testing.training import SMALL_GPT, build_gpt


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[], Any]
    error: type
    says: tuple[str, ...]


_MODEL = object()  # "build the default tiny GPT"


def data(samples: int = 16) -> SyntheticTokenDataset:
    return SyntheticTokenDataset(samples, SMALL_GPT.block_size, SMALL_GPT.vocab_size)


def accelerate(model: Any = _MODEL, **overrides: Any):
    """auto_accelerate on the tiny GPT, semi-automatic (an empty strategy) unless overridden."""
    kwargs = dict(optim_func=torch.optim.SGD, dataset=data(), loss_func=gpt_loss, optim_args={"lr": 0.1},
                  dataloader_args={"batch_size": 4}, model_input_format="unpack_dict", load_strategy=[])
    kwargs.update(overrides)
    return auto_accelerate(build_gpt(0, SMALL_GPT) if model is _MODEL else model, **kwargs)


def step(**overrides: Any):
    """auto_accelerate, then the first step of the user's loop (up to the loss)."""
    _, result, _ = accelerate(**overrides)
    batch = result.prepare_input(next(iter(result.dataloader)))
    return result.loss_func(batch, result.model(**batch))


def call(function: Callable, *args: Any, **kwargs: Any) -> Callable[[], Any]:
    return lambda: function(*args, **kwargs)


def search(**overrides: Any) -> Callable[[], Any]:
    """Fully automatic mode (these must fail in the argument checks, before any search)."""
    return call(accelerate, load_strategy=None, **overrides)


def strategy(methods: Any, **overrides: Any) -> Callable[[], Any]:
    return call(accelerate, load_strategy=methods, **overrides)


class NoLenDataset(Dataset):
    """Map-style (a torch Dataset without __iter__) but with no __len__."""

    def __getitem__(self, index: int) -> dict:
        return data()[index]


def sgd_with_lr(params, lr):
    return torch.optim.SGD(params, lr=lr)


def no_positional(*, lr):
    return None


def empty_pickle() -> Callable[[], Any]:
    def run():
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "strategy.pkl")
            open(path, "wb").close()
            return accelerate(load_strategy=path)
    return run


TRUE_OR_FALSE = "give True or False"
STEP_LR = torch.optim.lr_scheduler.StepLR
PP2 = ("parallel_mode", ([("pipeline", 2)], None))

SINGLE: list[Case] = [
    # --- model, model_input_format ---
    Case("model_not_module", call(accelerate, model="gpt"), InputError, ("model must be a torch.nn.Module", "str")),
    Case("model_class", call(accelerate, model=torch.nn.Linear), InputError,
         ("model must be a torch.nn.Module", "type")),
    Case("input_format_unknown", call(accelerate, model_input_format="unpack_tuple"), InputError,
         ("model_input_format='unpack_tuple'", "'unpack_dict'", "'unpack_sequence'")),
    Case("input_format_int", call(accelerate, model_input_format=1), InputError,
         ("model_input_format=1", "'unpack_dict'")),
    # a valid format the model's forward does not take: the search's first measurements fail alike under
    # every setting, and it says so instead of reporting every candidate failed
    Case("input_format_the_model_does_not_take", search(model_input_format="unpack_sequence",
                                                        excluded=["native_dynamo"]), InputError,
         ("every setting with the same error", "model_input_format='unpack_sequence'", "'unpack_dict'")),
    # --- optim_func, optim_args, optim_param_func ---
    Case("optim_func_str", call(accelerate, optim_func="adam"), InputError,
         ("optim_func must be callable", "optimizer class")),
    Case("optim_func_returns_none", call(accelerate, optim_func=lambda params, lr: None), InputError,
         ("optim_func must return a torch.optim.Optimizer", "NoneType")),
    Case("optim_func_returns_list", call(accelerate, optim_func=lambda params, lr: list(params)), InputError,
         ("optim_func must return a torch.optim.Optimizer", "list")),
    Case("optim_func_no_positional", call(accelerate, optim_func=no_positional), InputError,
         ("optim_func", "takes no positional argument")),
    Case("optim_args_not_dict", call(accelerate, optim_args=0.1), InputError, ("optim_args must be a dict", "float")),
    Case("optim_args_pairs", call(accelerate, optim_args=[("lr", 0.1)]), InputError,
         ("optim_args must be a dict", "list")),
    Case("optim_args_unknown_key", call(accelerate, optim_args={"learning_rate": 0.1}), InputError,
         ("optim_args", "'learning_rate'", "did you mean 'lr'", "valid keys", "momentum")),
    Case("optim_args_other_optimizer_key", call(accelerate, optim_args={"lr": 0.1, "betas": (0.9, 0.99)}), InputError,
         ("optim_args", "'betas'", "valid keys", "lr, momentum")),
    Case("optim_args_unknown_for_function", call(accelerate, optim_func=sgd_with_lr, optim_args={"lr": 0.1, "wd": 0.1}),
         InputError, ("optim_args", "'wd'", "valid keys", "lr", "sgd_with_lr")),
    Case("optim_args_missing_required", call(accelerate, optim_func=sgd_with_lr, optim_args={}), InputError,
         ("optim_args misses ['lr']", "sgd_with_lr")),
    Case("optim_args_non_str_key", call(accelerate, optim_args={0: 0.1}), InputError, ("optim_args keys", "[0]")),
    Case("optim_args_without_optim_func", call(accelerate, optim_func=None), InputError,
         ("optim_args", "without optim_func")),
    Case("optim_args_refused_by_optimizer", call(accelerate, optim_args={"lr": -1.0}), InputError,
         ("optim_func", "optim_args", "Invalid learning rate")),
    Case("optim_param_func_str", call(accelerate, optim_param_func="groups"), InputError,
         ("optim_param_func must be callable", "str")),
    Case("optim_param_func_returns_none", call(accelerate, optim_param_func=lambda model: None), InputError,
         ("optim_param_func(model) must return an iterable of parameters", "param-group", "NoneType")),
    Case("optim_param_func_returns_int", call(accelerate, optim_param_func=lambda model: 5), InputError,
         ("optim_param_func(model)", "int")),
    Case("optim_param_func_returns_module", call(accelerate, optim_param_func=lambda model: model), InputError,
         ("optim_param_func(model)", "GPT")),
    Case("optim_param_func_returns_empty", call(accelerate, optim_param_func=lambda model: []), InputError,
         ("optim_param_func(model)", "no parameters")),
    Case("optim_param_func_group_without_params", call(accelerate, optim_param_func=lambda model: [{"lr": 0.1}]),
         InputError, ("optim_param_func(model)", "'params'", "['lr']")),
    Case("optim_param_func_names", call(accelerate, optim_param_func=lambda model: ["weight"]), InputError,
         ("optim_param_func(model)", "item 0 is a str")),
    # --- dataset, loss_func, prepare_input ---
    Case("dataset_int", call(accelerate, dataset=42), InputError,
         ("dataset must be a torch Dataset", "IterableDataset", "int")),
    Case("dataset_without_len", call(accelerate, dataset=NoLenDataset()), InputError,
         ("dataset NoLenDataset", "no __len__", "IterableDataset")),
    Case("dataset_empty", call(accelerate, dataset=data(0)), InputError,
         ("dataset SyntheticTokenDataset is empty", "len 0")),
    Case("loss_func_none", call(accelerate, loss_func=None), InputError, ("loss_func is not callable",)),
    Case("loss_func_str", call(accelerate, loss_func="cross_entropy"), InputError, ("loss_func is not callable",)),
    Case("loss_non_scalar", call(step, loss_func=lambda batch, logits: logits), InputError,
         ("loss_func must return a scalar tensor", "list/tuple starting with one", "shape (4, 16, 64)")),
    Case("loss_float", call(step, loss_func=lambda batch, logits: 1.0), InputError,
         ("loss_func must return a scalar tensor", "float")),
    Case("loss_none", call(step, loss_func=lambda batch, logits: None), InputError,
         ("loss_func must return a scalar tensor", "NoneType")),
    Case("loss_tuple_non_scalar", call(step, loss_func=lambda batch, logits: (logits, 1)), InputError,
         ("loss_func must return a scalar tensor", "shape")),
    Case("loss_empty_list", call(step, loss_func=lambda batch, logits: []), InputError,
         ("loss_func must return a scalar tensor", "empty list")),
    Case("prepare_input_str", call(accelerate, prepare_input="to_device"), InputError,
         ("prepare_input must be callable",)),
    # --- dataloader_args, distributed_sampler_cls ---
    Case("dataloader_args_list", call(accelerate, dataloader_args=[("batch_size", 4)]), InputError,
         ("dataloader_args must be a dict", "list")),
    Case("dataloader_args_str", call(accelerate, dataloader_args="batch_size=4"), InputError,
         ("dataloader_args must be a dict", "str")),
    Case("dataloader_args_unknown_key", call(accelerate, dataloader_args={"batch_size": 4, "shuffel": True}),
         InputError,
         ("dataloader_args", "'shuffel'", "did you mean 'shuffle'", "valid keys", "drop_last")),
    Case("dataloader_args_batchsize", call(accelerate, dataloader_args={"batchsize": 4}), InputError,
         ("dataloader_args", "'batchsize'", "did you mean 'batch_size'")),
    Case("dataloader_args_dataset", call(accelerate, dataloader_args={"batch_size": 4, "dataset": data()}), InputError,
         ("dataloader_args['dataset']", "dataset argument")),
    Case("dataloader_args_batch_sampler",
         call(accelerate, dataloader_args={"batch_size": 4, "batch_sampler": [[0, 1]]}),
         InputError, ("dataloader_args['batch_sampler']", "batch_size", "distributed_sampler_cls")),
    Case("batch_size_zero", call(accelerate, dataloader_args={"batch_size": 0}), InputError,
         ("dataloader_args['batch_size'] must be a positive int", "0")),
    Case("batch_size_str", call(accelerate, dataloader_args={"batch_size": "4"}), InputError,
         ("dataloader_args['batch_size'] must be a positive int", "'4'")),
    Case("batch_size_bool", call(accelerate, dataloader_args={"batch_size": True}), InputError,
         ("dataloader_args['batch_size'] must be a positive int", "True")),
    Case("batch_size_float", call(accelerate, dataloader_args={"batch_size": 4.0}), InputError,
         ("dataloader_args['batch_size'] must be a positive int", "4.0")),
    Case("global_batch_above_dataset_drop_last",
         call(accelerate, dataloader_args={"batch_size": 64, "drop_last": True}),
         InputError, ("dataloader_args['batch_size']=64", "data-parallel size of 1", "16 samples", "0 batches",
                      "drop_last=False")),
    Case("num_workers_negative", call(accelerate, dataloader_args={"batch_size": 4, "num_workers": -1}), InputError,
         ("dataloader_args", "DataLoader", "num_workers")),
    Case("prefetch_without_workers", call(accelerate, dataloader_args={"batch_size": 4, "prefetch_factor": 2}),
         InputError, ("dataloader_args", "DataLoader", "prefetch_factor")),
    Case("sampler_cls_str", call(accelerate, distributed_sampler_cls="DistributedSampler"), InputError,
         ("distributed_sampler_cls must be a sampler class", "DistributedSampler's signature")),
    Case("sampler_cls_instance",
         call(accelerate, distributed_sampler_cls=DistributedSampler(data(), num_replicas=1, rank=0)),
         InputError, ("distributed_sampler_cls must be a sampler class (not an instance)",)),
    # --- lr_scheduler_cls, lr_scheduler_args ---
    Case("scheduler_without_optim_func", call(accelerate, optim_func=None, optim_args=None, lr_scheduler_cls=STEP_LR,
                                              lr_scheduler_args={"step_size": 1}), InputError,
         ("lr_scheduler_cls needs optim_func",)),
    Case("scheduler_cls_str", call(accelerate, lr_scheduler_cls="StepLR"), InputError,
         ("lr_scheduler_cls must be a scheduler class", "StepLR")),
    Case("scheduler_args_not_dict", call(accelerate, lr_scheduler_cls=STEP_LR, lr_scheduler_args=5), InputError,
         ("lr_scheduler_args must be a dict", "int")),
    Case("scheduler_args_unknown_key", call(accelerate, lr_scheduler_cls=STEP_LR, lr_scheduler_args={"step": 2}),
         InputError, ("lr_scheduler_args", "'step'", "did you mean 'step_size'", "valid keys", "gamma")),
    Case("scheduler_args_missing", call(accelerate, lr_scheduler_cls=STEP_LR), InputError,
         ("lr_scheduler_args misses ['step_size']", "StepLR")),
    Case("scheduler_args_without_cls", call(accelerate, lr_scheduler_args={"step_size": 2}), InputError,
         ("lr_scheduler_args", "without lr_scheduler_cls")),
    Case("scheduler_refuses_args", call(accelerate, lr_scheduler_cls=torch.optim.lr_scheduler.LambdaLR,
                                        lr_scheduler_args={"lr_lambda": 5}), InputError,
         ("lr_scheduler_cls(optimizer, **lr_scheduler_args)", "lr_lambda", "not callable")),
    # --- excluded, included, load_strategy, finetune_strategy, save_strategy_to_file, ignore_dryrun ---
    Case("excluded_str", call(accelerate, excluded="fsdp"), InputError,
         ("excluded must be a list of method names", "str")),
    Case("excluded_int", call(accelerate, excluded=5), InputError, ("excluded must be a list of method names", "int")),
    Case("excluded_class", call(accelerate, excluded=[GPTBlock]), InputError,
         ("excluded must be a list of method names (str)", "GPTBlock")),
    Case("excluded_unknown_method", call(accelerate, excluded=["fsdpp"]), UnknownMethodError,
         ("'fsdpp'", "Did you mean 'fsdp'", "Valid methods")),
    Case("excluded_and_loaded", strategy(["half"], excluded=["half"]), InputError,
         ("'half'", "load_strategy", "excluded")),
    Case("included_str", search(included="amp_native"), InputError, ("included must be a list of method names", "str")),
    Case("included_entry", search(included=[5]), InputError, ("included must be a list of method names", "entry 5")),
    Case("included_unknown_method", search(included=["amp_nativ"]), UnknownMethodError,
         ("'amp_nativ'", "Did you mean 'amp_native'")),
    Case("included_and_excluded", search(included=["zero1"], excluded=["zero1"]), InputError,
         ("'zero1'", "both included and excluded")),
    Case("included_with_load_strategy", strategy(["half"], included=["checkpoint"]), InputError,
         ("included", "search only", "finetune_strategy=True")),
    Case("load_strategy_int", strategy(12), StrategyError,
         ("load_strategy must be a Strategy, bytes, a file path or a list of methods", "int")),
    Case("load_strategy_dict", strategy({"half": None}), StrategyError, ("load_strategy must be", "dict")),
    Case("load_strategy_entry", strategy([5]), StrategyError, ("strategy entry 5", "method name", "(name, config")),
    Case("load_strategy_unknown_method", strategy(["amp_nativ"]), UnknownMethodError,
         ("'amp_nativ'", "Did you mean 'amp_native'", "Valid methods")),
    Case("load_strategy_duplicate", strategy(["half", ("half", "fp16")]), IncompatibleMethodsError,
         ("['half']", "more than once")),
    Case("load_strategy_missing_file", strategy("/nonexistent/strategy.json"), StrategyFileError,
         ("strategy file not found", "/nonexistent/strategy.json")),
    Case("load_strategy_garbage_bytes", strategy(b"not a strategy"), StrategyFileError, ("not a strategy pickle",)),
    Case("load_strategy_empty_pickle", empty_pickle(), StrategyFileError, ("strategy.pkl", "empty file", "0 bytes")),
    Case("finetune_not_bool", strategy(["half"], finetune_strategy="yes"), InputError,
         ("finetune_strategy='yes'", TRUE_OR_FALSE)),
    Case("finetune_without_load_strategy", search(finetune_strategy=True), InputError,
         ("finetune_strategy=True needs load_strategy",)),
    Case("ignore_dryrun_not_bool", strategy(["half"], ignore_dryrun_on_load_strategy="no"), InputError,
         ("ignore_dryrun_on_load_strategy='no'", TRUE_OR_FALSE)),
    Case("save_to_int", strategy([], save_strategy_to_file=5), InputError,
         ("save_strategy_to_file must be a file path", "5")),
    Case("save_to_empty_path", strategy([], save_strategy_to_file=""), InputError,
         ("save_strategy_to_file must be a file path", "''")),
    # --- kargs ---
    Case("karg_misspelt", strategy([], verbos=True), InputError,
         ("unknown keyword argument(s) ['verbos']", "did you mean 'verbose'", "supported kargs")),
    Case("karg_misspelt_time_limit", search(timelimit=60), InputError, ("'timelimit'", "did you mean 'time_limit'")),
    Case("find_unused_not_bool", strategy([], find_unused_parameters="yes"), InputError,
         ("find_unused_parameters='yes'", TRUE_OR_FALSE)),
    Case("time_limit_str", search(time_limit="60"), InputError, ("time_limit='60' is not valid", "positive number")),
    Case("time_limit_negative", search(time_limit=-5), InputError, ("time_limit=-5 is not valid", "positive number")),
    Case("memory_limit_negative", search(memory_limit="-1GiB"), InputError,
         ("memory_limit='-1GiB' is not valid", "above 0 bytes", "GiB")),
    Case("memory_limit_unit", search(memory_limit="6 gigs"), InputError,
         ("memory_limit='6 gigs'", "unknown unit", "MiB")),
    Case("memory_limit_zero", search(memory_limit=0), InputError, ("memory_limit=0 is not valid",)),
    Case("search_topk_str", search(search_topk="four"), InputError,
         ("search_topk='four' is not valid", "positive int")),
    Case("search_topk_zero", search(search_topk=0), InputError, ("search_topk=0 is not valid", "positive int")),
    Case("dryrun_steps_zero", strategy([], ignore_dryrun_on_load_strategy=False, dryrun_steps=0), InputError,
         ("dryrun_steps=0 is not valid", "positive int")),
    Case("dryrun_steps_float", search(dryrun_steps=2.5), InputError, ("dryrun_steps=2.5 is not valid", "positive int")),
    Case("report_dir_int", search(report_dir=3), InputError, ("report_dir=3 is not valid", "directory path")),
    Case("verbose_str", strategy([], verbose="yes"), InputError, ("verbose='yes' is not valid", TRUE_OR_FALSE)),
    Case("use_profile_cache_int", search(use_profile_cache=1), InputError,
         ("use_profile_cache=1 is not valid", TRUE_OR_FALSE)),
    Case("search_exhaustive_str", search(search_exhaustive="no"), InputError,
         ("search_exhaustive='no' is not valid", TRUE_OR_FALSE)),
    Case("collective_timeout_zero", strategy([], ignore_dryrun_on_load_strategy=False, dryrun_collective_timeout=0),
         InputError, ("dryrun_collective_timeout=0 is not valid", "positive number")),
    Case("time_limit_negative_with_load_strategy", strategy(["half"], time_limit=-5), InputError,
         ("time_limit=-5 is not valid", "positive number")),
    Case("memory_limit_negative_with_load_strategy", strategy(["half"], memory_limit="-1GiB"), InputError,
         ("memory_limit='-1GiB' is not valid", "above 0 bytes")),
    Case("time_limit_with_load_strategy", strategy(["half"], time_limit=60), InputError,
         ("['time_limit']", "search only", "finetune_strategy=True")),
    Case("search_topk_with_load_strategy", strategy(["half"], search_topk=2), InputError,
         ("['search_topk']", "search only")),
    Case("memory_limit_without_dry_run", strategy(["half"], memory_limit="1GiB"), InputError,
         ("['memory_limit']", "ignore_dryrun_on_load_strategy=True skips", "ignore_dryrun_on_load_strategy=False")),
    Case("dryrun_steps_without_dry_run", strategy([], dryrun_steps=2), InputError,
         ("['dryrun_steps']", "ignore_dryrun_on_load_strategy=False")),
    Case("memory_limit_exceeded_by_dry_run", strategy([], ignore_dryrun_on_load_strategy=False, memory_limit=1,
                                                      dryrun_steps=1), DryRunError,
         ("memory_limit=1", "peaked at", "MiB per rank")),
    # --- strategy configs (every config is validated, also those of methods dropped in one process) ---
    Case("amp_init_scale_str", strategy([("amp_native", {"dtype": "fp16", "init_scale": "big"})]), MethodConfigError,
         ("amp_native", "init_scale='big' is not valid", "expected a number")),
    Case("amp_dtype_fp32", strategy([("amp_native", {"dtype": torch.float32})]), MethodConfigError,
         ("amp_native", "dtype=torch.float32 is not valid", "torch.float16")),
    Case("amp_misspelt_key", strategy([("amp_native", {"dtpye": "bf16"})]), MethodConfigError,
         ("'dtpye'", "did you mean 'dtype'", "valid keys")),
    Case("amp_config_int", strategy([("amp_native", 3)]), MethodConfigError, ("amp_native", "config must be a dict")),
    Case("half_fp8", strategy([("half", "fp8")]), MethodConfigError, ("half", "dtype='fp8' is not valid", "bf16")),
    Case("checkpoint_int_target", strategy([("checkpoint", (42,))]), MethodConfigError,
         ("wrap_class[0]=42 is not valid", "str or nn.Module class")),
    Case("checkpoint_no_match", strategy([("checkpoint", ("NoSuchBlock",))]), MethodConfigError,
         ("no submodule matches", "GPTBlock")),
    Case("precisions_clash", strategy([("amp_native", {"dtype": torch.float16}), ("half", "bf16")]),
         IncompatibleMethodsError, ("fp16 and bf16 are both requested",)),
    Case("dropped_parallel_mode_bad_dim", strategy([("parallel_mode", ([("tensr", 2)], None))]), ParallelModeError,
         ("unknown dimension 'tensr'", "valid names", "'tensor'")),
    Case("dropped_parallel_mode_str", strategy([("parallel_mode", "data")]), ParallelModeError,
         ("parallel_mode config must be ([(name, size), ...], rank_order_or_None)",)),
    Case("dropped_parallel_mode_size_zero", strategy([("parallel_mode", ([("tensor", 0)], None))]), ParallelModeError,
         ("size of 'tensor' must be a positive int",)),
    Case("dropped_parallel_mode_twice", strategy([("parallel_mode", ([("data", 1), ("data", 1)], None))]),
         ParallelModeError, ("dimension 'data' is given twice",)),
    Case("dropped_zero1_key", strategy([("zero1", {"use_ds": True})]), MethodConfigError,
         ("zero1", "'use_ds'", "did you mean 'use_ds_zero'")),
    Case("dropped_zero2_both", strategy([("zero2", {"use_ds_zero": True, "not_use_fsdp": True})]), MethodConfigError,
         ("zero2", "use_ds_zero and not_use_fsdp", "set one")),
    Case("dropped_fsdp_choice", strategy([("fsdp", {"sharding_strategy": "FULL"})]), MethodConfigError,
         ("fsdp", "sharding_strategy='FULL'", "FULL_SHARD")),
    Case("dropped_fsdp_two_wrap_rules", strategy([("fsdp", {"atorch_wrap_cls": ("GPTBlock",),
                                                             "atorch_size_based_min_num_params": 100})]),
         MethodConfigError, ("fsdp", "either atorch_wrap_cls or atorch_size_based_min_num_params")),
    Case("dropped_tensor_plan", strategy([("tensor_parallel", {"plan": {"blocks.*.mlp.up_proj": "diagonal"}})]),
         MethodConfigError, ("tensor_parallel", "'diagonal'", "'colwise', 'rowwise'")),
    Case("dropped_sequence_key", strategy(["tensor_parallel", ("sequence_parallel", {"on": True})]), MethodConfigError,
         ("sequence_parallel", "'on'", "takes no config")),
    Case("dropped_pipeline_stages_str", strategy([("pipeline_parallel", {"stages_per_rank": "2"})]), MethodConfigError,
         ("pipeline_parallel", "stages_per_rank='2' is not valid", "an int")),
    Case("dropped_pipeline_schedule", strategy([("pipeline_parallel", {"schedule": "ZB"})]), MethodConfigError,
         ("pipeline_parallel", "schedule='ZB'", "'1F1B'")),
    Case("dropped_pipeline_interleave", strategy([("pipeline_parallel", {"stages_per_rank": 2})]), MethodConfigError,
         ("pipeline_parallel", "stages_per_rank above 1", "'Interleaved1F1B'")),
    Case("dropped_pipeline_micro_zero", strategy([("pipeline_parallel", {"num_micro_batch": 0})]), MethodConfigError,
         ("pipeline_parallel", "num_micro_batch=0", ">= 1")),
    Case("dropped_mixed_key", strategy([("mixed_parallel", {"pipline": {}})]), MethodConfigError,
         ("mixed_parallel", "'pipline'", "did you mean 'pipeline'")),
    Case("dropped_mixed_nested", strategy([("mixed_parallel", {"tensor": {"plan": 5}})]), MethodConfigError,
         ("mixed_parallel", "tensor.plan[0]=5")),
    Case("dropped_ds_3d_key", strategy([("ds_3d_parallel", {"bogus": 1})]), MethodConfigError,
         ("ds_3d_parallel", "'bogus'", "valid keys", "num_micro_batch")),
    Case("dropped_ds_3d_partition", strategy([("ds_3d_parallel", {"partition_method": "layers"})]),
         MethodConfigError, ("ds_3d_parallel", "'layers'", "'parameters'", "'uniform'", "'type:<regex>'")),
    Case("dropped_two_shardings", strategy(["zero1", "fsdp"]), IncompatibleMethodsError,
         ("zero1 and fsdp", "choose one sharding level")),
    Case("dropped_sequence_alone", strategy(["sequence_parallel"]), IncompatibleMethodsError,
         ("sequence_parallel needs one of", "tensor_parallel", "mixed_parallel")),
    Case("dropped_tensor_and_mixed", strategy(["tensor_parallel", "mixed_parallel"]), IncompatibleMethodsError,
         ("tensor_parallel and mixed_parallel",)),
    Case("dropped_pipeline_and_fsdp", strategy(["pipeline_parallel", "fsdp"]), IncompatibleMethodsError,
         ("pipeline_parallel and fsdp", "use zero1 or DDP beside a pipeline")),
    Case("dropped_mixed_and_zero2", strategy(["mixed_parallel", "zero2"]), IncompatibleMethodsError,
         ("mixed_parallel and zero2", "do not reduce the gradients")),
]


# --- cases that need several ranks: one 2-rank launch runs them all ---
def _one_block_model():
    return build_gpt(0, GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))


MULTI_RANK: list[Case] = [
    Case("tensor_parallel_without_tensor_dim", strategy(["tensor_parallel"]), MethodConfigError,
         ("tensor_parallel", "'tensor' dimension", "[('data', 2)]", "add ('tensor', N) to parallel_mode")),
    Case("sequence_parallel_without_tensor_dim", strategy(["parallel_mode", "tensor_parallel", "sequence_parallel"]),
         MethodConfigError, ("tensor_parallel", "'tensor' dimension", "add ('tensor', N)", "sequence_parallel too")),
    Case("pipeline_parallel_without_pipeline_dim", strategy(["pipeline_parallel"]), MethodConfigError,
         ("pipeline_parallel", "'pipeline' dimension", "add ('pipeline', N) to parallel_mode")),
    Case("mixed_parallel_without_dims", strategy(["mixed_parallel"]), MethodConfigError,
         ("mixed_parallel", "'tensor' and 'pipeline'", "add ('tensor', N), ('pipeline', N)")),
    Case("mixed_parallel_without_pipeline_dim",
         strategy([("parallel_mode", ([("tensor", 2)], None)), "mixed_parallel"]),
         MethodConfigError, ("mixed_parallel", "[('tensor', 2)]", "add ('pipeline', N)")),
    Case("pipeline_one_block_two_stages",
         lambda: accelerate(_one_block_model(), load_strategy=[PP2, "pipeline_parallel"]),
         MethodConfigError, ("pipeline_parallel", "at least one repeated block per stage", "2 stage(s)", "found none",
                             "pipeline' size of parallel_mode", "pivots")),
    Case("pipeline_fewer_blocks_than_stages",
         strategy([PP2, ("pipeline_parallel", {"schedule": "Interleaved1F1B"})]), MethodConfigError,
         ("pipeline_parallel", "4 stage(s) (2 pipeline ranks x 2 per rank)", "found 2 (GPTBlock)")),
    Case("parallel_sizes_do_not_divide", strategy([("parallel_mode", ([("tensor", 3)], None))]), ParallelModeError,
         ("tensor=3", "does not divide the world size 2")),
    Case("parallel_rank_order", strategy([("parallel_mode", ([("data", 2)], [0, 0]))]), ParallelModeError,
         ("rank order must be a permutation of range(2)", "[0, 0]")),
    Case("batch_does_not_divide_over_ranks", strategy(["parallel_mode"], dataloader_args={"batch_size": 3}), InputError,
         ("dataloader_args['batch_size']=3", "GLOBAL batch", "2 data-parallel ranks")),
    Case("sampler_with_several_ranks",
         strategy([], dataloader_args={"batch_size": 4, "sampler": RandomSampler(data())}),
         InputError, ("dataloader_args 'sampler'", "distributed_sampler_cls")),
    Case("global_batch_above_dataset_two_ranks",
         strategy([], dataloader_args={"batch_size": 64, "drop_last": True}), InputError,
         ("dataloader_args['batch_size']=64", "32 per rank", "data-parallel size of 2", "16 samples",
          "drop_last=False")),
    Case("sampler_cls_wrong_signature", strategy([], distributed_sampler_cls=RandomSampler), InputError,
         ("distributed_sampler_cls RandomSampler", "DistributedSampler's arguments", "num_replicas")),
    Case("loss_non_scalar_two_ranks", call(step, loss_func=lambda batch, logits: logits), InputError,
         ("loss_func must return a scalar tensor", "shape")),
]


def outcome(case: Case) -> dict:
    """What calling the case did: 'typed' (an AtorchError), 'raw' (any other exception) or 'silent'."""
    try:
        case.call()
    except AtorchError as error:
        return {"kind": "typed", "types": [c.__name__ for c in type(error).__mro__], "message": str(error)}
    except Exception as error:  # reported, so the test shows what leaked
        return {"kind": "raw", "types": [c.__name__ for c in type(error).__mro__], "message": f"{error!r}"}
    return {"kind": "silent", "types": [], "message": "accepted"}


def problems(case: Case, got: dict) -> list[str]:
    if got["kind"] != "typed":
        return [f"{got['kind']}: {got['types'][:1]} {got['message'][:300]}"]
    found = []
    if case.error.__name__ not in got["types"]:
        found.append(f"expected {case.error.__name__}, got {got['types'][0]}")
    missing = [s for s in case.says if s not in got["message"]]
    if missing:
        found.append(f"message lacks {missing}: {got['message']}")
    return found


_SEEN: dict[str, dict] = {}


def _single(case: Case) -> dict:
    if case.id not in _SEEN:
        _SEEN[case.id] = outcome(case)
    return _SEEN[case.id]


def test_the_matrix_has_at_least_70_cases_with_unique_ids():
    ids = [c.id for c in SINGLE + MULTI_RANK]
    assert len(ids) >= 70 and len(set(ids)) == len(ids)


@pytest.mark.parametrize("case", SINGLE, ids=lambda c: c.id)
def test_single_process_bad_input(case):
    got = _single(case)
    assert not problems(case, got), problems(case, got)


def multi_rank_launch() -> list[dict]:
    return [outcome(case) for case in MULTI_RANK]


@pytest.fixture(scope="module")
def multi_rank_outcomes():
    per_rank = run_distributed(multi_rank_launch, 2, timeout_s=300)
    return {case.id: [outs[i] for outs in per_rank] for i, case in enumerate(MULTI_RANK)}


@pytest.mark.multirank
@pytest.mark.parametrize("case", MULTI_RANK, ids=lambda c: c.id)
def test_two_rank_bad_input(case, multi_rank_outcomes):
    for rank, got in enumerate(multi_rank_outcomes[case.id]):
        assert not problems(case, got), (rank, problems(case, got))


@pytest.mark.multirank
def test_summary_every_bad_input_is_typed(multi_rank_outcomes):
    kinds = [_single(case)["kind"] for case in SINGLE]
    kinds += [min((got["kind"] for got in multi_rank_outcomes[case.id]), key=("raw", "silent", "typed").index)
              for case in MULTI_RANK]
    typed, raw, silent = (kinds.count(k) for k in ("typed", "raw", "silent"))
    wrong = [c.id for c in SINGLE if problems(c, _single(c))]
    wrong += [c.id for c in MULTI_RANK if any(problems(c, got) for got in multi_rank_outcomes[c.id])]
    print(f"{len(kinds)} bad inputs: {typed} typed, {raw} raw, {silent} silent"
          + (f"; {len(wrong)} with a wrong type or message: {wrong}" if wrong else ""))
    assert typed == len(kinds) and raw == 0 and silent == 0 and not wrong
