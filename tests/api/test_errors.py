"""Bad inputs raise typed errors that name the problem (single process; the multi-rank refusals are
in test_multirank.py). None hangs, none is silently ignored."""
import pytest
import torch

from atorch.auto.accelerate import auto_accelerate
from atorch.errors import (
    DryRunError,
    IncompatibleMethodsError,
    InputError,
    MethodConfigError,
    ParallelModeError,
    StrategyError,
    UnknownMethodError,
)
from atorch.models import GPTBlock, SyntheticTokenDataset, gpt_loss
from atorch.testing.training import SMALL_GPT, build_gpt


def accelerate(strategy, **overrides):
    kwargs = dict(
        optim_func=torch.optim.SGD, dataset=SyntheticTokenDataset(16, 16, 64), loss_func=gpt_loss,
        optim_args={"lr": 0.1}, dataloader_args={"batch_size": 4}, model_input_format="unpack_dict",
        load_strategy=strategy,
    )
    kwargs.update(overrides)
    return auto_accelerate(build_gpt(0, SMALL_GPT), **kwargs)


def test_unknown_method_names_the_nearest_valid_one():
    with pytest.raises(UnknownMethodError, match="'amp_nativ'.*Did you mean 'amp_native'.*Valid methods:"):
        accelerate(["amp_nativ"])
    with pytest.raises(UnknownMethodError, match="'paralle_mode'.*'parallel_mode'"):
        accelerate(["paralle_mode"])


@pytest.mark.parametrize("strategy, match", [
    ([("amp_native", {"dtype": torch.float32})], "dtype=torch.float32 is not valid: expected one of \\[torch.float16"),
    ([("amp_native", {"dtpye": torch.bfloat16})],
     "unknown key 'dtpye' \\(did you mean 'dtype'\\?\\); valid keys: dtype, "),
    ([("amp_native", {"dtype": "bf16", "init_scale": 8.0})], "apply to fp16 only"),
    ([("amp_native", 3)], "config must be a dict"),
    ([("half", "fp8")], "dtype='fp8' is not valid"),
    ([("checkpoint", {"wrap_class": (GPTBlock,), "reentrant": True})],
     "unknown key 'reentrant' \\(did you mean 'no_reentrant'"),
    ([("checkpoint", (42,))], "wrap_class\\[0\\]=42 is not valid: expected str or nn.Module class"),
    ([("checkpoint", ("NoSuchBlock",))], "no submodule matches.*GPTBlock"),
])
def test_malformed_configs(strategy, match):
    with pytest.raises(MethodConfigError, match=match):
        accelerate(strategy)


@pytest.mark.parametrize("strategy", [
    [("amp_native", {"dtype": torch.float16}), ("half", "bf16")],
    [("amp_native", "bf16"), "half"],
])
def test_fp16_and_bf16_both_requested(strategy):
    with pytest.raises(IncompatibleMethodsError, match="fp16 and bf16 are both requested"):
        accelerate(strategy)


@pytest.mark.parametrize("strategy", [["half", "amp_native"], [("amp_native", "fp16"), ("half", "fp16")]])
def test_fp16_loss_scaling_over_fp16_parameters_is_refused_up_front(strategy):
    """amp_native fp16's GradScaler unscales fp32 gradients only: over a model half cast to fp16 it raised
    "Attempting to unscale FP16 gradients" at the first optim.step(), inside the user's loop."""
    with pytest.raises(IncompatibleMethodsError, match="amp_native and half cannot be combined here: amp_native "
                       "needs fp32 parameters.*GradScaler.*half stores them in float16"):
        accelerate(strategy)


def test_duplicate_methods():
    with pytest.raises(IncompatibleMethodsError, match="more than once"):
        accelerate(["half", ("half", "fp16")])


def test_parallel_sizes_that_do_not_divide_the_world_size():
    # validated up front, even in one process, when the strategy is normalized for a world size
    from atorch.distributed.mesh import normalize_parallel_config

    with pytest.raises(ParallelModeError, match="tensor=3.*does not divide the world size 4"):
        normalize_parallel_config(([("tensor", 3), ("data", 1)], None), 4)


@pytest.mark.parametrize("overrides, match", [
    ({"loss_func": None}, "loss_func is not callable"),
    ({"dataset": [1, 2, 3], "loss_func": None}, "loss_func is not callable"),
    ({"dataset": 42}, "dataset must be a torch Dataset"),
    ({"model_input_format": "unpack_tuple"}, "model_input_format='unpack_tuple' is not valid"),
    ({"dataloader_args": {"batch_size": 0}}, "batch_size"),
    ({"optim_func": "adam"}, "optim_func must be callable"),
    ({"lr_scheduler_cls": torch.optim.lr_scheduler.StepLR, "optim_func": None}, "lr_scheduler_cls needs optim_func"),
    ({"verbos": True}, "unknown keyword argument\\(s\\) \\['verbos'\\]"),
])
def test_bad_arguments(overrides, match):
    with pytest.raises(InputError, match=match):
        accelerate([], **overrides)


def test_loss_func_that_cannot_run_fails_the_dry_run_with_its_reason():
    with pytest.raises(DryRunError, match="loss_func must return a scalar tensor.*shape"):
        accelerate([], loss_func=lambda batch, logits: logits, ignore_dryrun_on_load_strategy=False)


def test_bad_load_strategy_type():
    with pytest.raises(StrategyError, match="load_strategy must be"):
        accelerate(12)


def test_loss_value_refuses_an_empty_list_with_a_typed_error():
    from atorch.utils.batch import loss_value

    with pytest.raises(InputError, match="empty list"):
        loss_value([])


def test_verbose_logs_each_line_once_when_the_root_logger_is_configured():
    from atorch.auto.accelerate import _enable_verbose_logging, logger

    saved = (list(logger.handlers), logger.propagate, logger.level)
    logger.handlers.clear()
    try:
        _enable_verbose_logging()
        assert logger.handlers and logger.propagate is False  # atorch's handler alone prints its lines
    finally:  # other tests capture the "atorch" logger through the root logger
        logger.handlers[:] = saved[0]
        logger.propagate, logger.level = saved[1], saved[2]
