"""save_checkpoint / load_checkpoint / export_model on real gloo ranks.

Resume: each case trains N steps, saves, trains M more (the reference); a new launch builds the
same strategy, loads, trains M steps: the losses and the final weights equal the reference's
(relative difference < 1e-6 in fp32; in practice 0).
Cross-strategy: a checkpoint saved under one strategy (or world size) loads under another: right
after loading, the full weights and optimizer state equal the source's at save time (rel < 1e-6),
and training continues with the uninterrupted run's losses and final weights (rel < 1e-6: only
the reduction order differs; measured up to ~1e-7). Cases cover DeepSpeed ZeRO-1/2 (use_ds_zero)
and tensor parallelism over GPT-2's fused q|k|v projection. Launches are shared: one per world
size and phase.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import atorch
from atorch.checkpoint.export import load_exported
from atorch.checkpoint.optimizer_state import OptimizerView, optimizer_state_tensors
from atorch.checkpoint.tensors import in_saved_order, model_tensors, param_names, saved_orders
from atorch.errors import CheckpointError, ShardedStateError
from atorch.models import SyntheticTokenDataset, gpt_loss
from atorch.testing import run_distributed
from atorch.testing.hf_models import ZOO
from atorch.testing.sequential import PairDataset, pair_loss, tiny_sequential
from atorch.testing.training import build_gpt, global_mean, relative_difference, train_gpt, weight_difference
from atorch.utils.modules import full_state_dict

pytestmark = pytest.mark.multirank

N, M, BATCH = 2, 2, 8
EXACT = 1e-6     # same strategy and world size: resuming must not change a bit (fp32)
PARITY = 1e-6    # another strategy continues: fp32 rounding of a different reduction order (measured <= ~1e-7)
TP2 = ("parallel_mode", ([("tensor", 2)], None))
PP2 = ("parallel_mode", ([("pipeline", 2)], None))
MIXED = ("parallel_mode", ([("tensor", 2), ("pipeline", 2)], None))
PIPE = ("pipeline_parallel", {"num_micro_batch": 4})
DS_ZERO1 = ("zero1", {"use_ds_zero": True})
DS_ZERO2 = ("zero2", {"use_ds_zero": True})
DS_3D = ("ds_3d_parallel", {"num_micro_batch": 4})

# name: (strategy, optimizer, shuffle[, zoo model]); SGD with momentum where another strategy resumes
# (AdamW's m/sqrt(v) amplifies rounding differences), AdamW (state with a scalar 'step') elsewhere;
# the repo GPT unless a zoo model is named (gpt2: a fused q|k|v projection, reordered under tensor_parallel)
SAVED_ON_2 = {
    "ddp": ([], "adamw", True),
    "zero1": (["zero1"], "adamw", True),
    "zero2": (["zero2"], "adamw", True),
    "fsdp": (["fsdp"], "sgd", False),
    "tp": ([TP2, "tensor_parallel"], "adamw", True),
    "pp": ([PP2, PIPE], "sgd", False),
    "ds_zero1": ([DS_ZERO1], "adamw", True),
    "ds_zero2": ([DS_ZERO2], "sgd", False),
    "ds_3d": ([PP2, DS_3D], "adamw", True),  # DeepSpeed's pipeline engine over the GPT cut at its blocks
    "gpt2_tp": ([TP2, "tensor_parallel"], "sgd", False, "gpt2"),
    "mixtral_tp": ([TP2, "tensor_parallel"], "sgd", False, "mixtral"),  # expert banks split by expert
    "titan_moe_tp": ([TP2, "tensor_parallel"], "sgd", False, "titan_moe"),  # torchtitan's grouped banks, by expert
}
SAVED_ON_4 = {"mixed": ([MIXED, ("mixed_parallel", {"pipeline": {"num_micro_batch": 4}})], "adamw", True)}
# name: (source case, strategy it loads under, world size)
CROSS = {
    "ddp_from_fsdp": ("fsdp", [], 1),
    "tp_from_fsdp": ("fsdp", [TP2, "tensor_parallel"], 2),
    "zero1_from_fsdp": ("fsdp", ["zero1"], 4),
    "fsdp_from_pp": ("pp", ["fsdp"], 2),
    "ddp_from_ds_zero2": ("ds_zero2", [], 1),
    "ds_zero1_from_fsdp": ("fsdp", [DS_ZERO1], 2),
    "ds_3d_from_pp": ("pp", [PP2, DS_3D], 2),
    "pp_from_ds_3d": ("ds_3d", [PP2, PIPE], 2),
    "ddp_from_gpt2_tp": ("gpt2_tp", [], 1),
    "fsdp_from_gpt2_tp": ("gpt2_tp", ["fsdp"], 2),
    "ddp_from_mixtral_tp": ("mixtral_tp", [], 1),
    "ddp_from_titan_moe_tp": ("titan_moe_tp", [], 1),
}


def _build(strategy, optimizer: str, shuffle: bool, zoo: str = "gpt"):
    """The repo GPT (or a zoo model, built as train_gpt builds it) under ``strategy``."""
    if zoo == "gpt":
        model, loss_func, input_format = build_gpt(0), gpt_loss, "unpack_dict"
        dataset = SyntheticTokenDataset(num_samples=BATCH * (N + M), seq_len=16, vocab_size=64)
    else:
        torch.manual_seed(0)
        model, loss_func, input_format = ZOO[zoo].build(), ZOO[zoo].loss_func, ZOO[zoo].input_format
        dataset = ZOO[zoo].make_dataset(BATCH * (N + M), 0)
    optim_func, optim_args = ((torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}) if optimizer == "adamw"
                              else (torch.optim.SGD, {"lr": 0.2, "momentum": 0.9}))
    status, result, _ = atorch.auto_accelerate(
        model, optim_func, dataset, loss_func, optim_args=optim_args, model_input_format=input_format,
        dataloader_args={"batch_size": BATCH, "shuffle": shuffle}, load_strategy=strategy,
        lr_scheduler_cls=torch.optim.lr_scheduler.StepLR, lr_scheduler_args={"step_size": 1, "gamma": 0.8})
    assert status
    return result


def _steps(result, batches, count: int) -> list[float]:
    losses = []
    for _ in range(count):
        batch = result.prepare_input(next(batches))
        loss = result.loss_func(batch, result.model(**batch) if isinstance(batch, dict) else result.model(batch))
        result.optim.backward(loss) if result.args.use_optim_backward else loss.backward()
        result.optim.step()
        result.optim.zero_grad()
        if result.lr_scheduler is not None:  # one built by auto_accelerate (a user's own is stepped by the user)
            result.lr_scheduler.step()
        torch.rand(3)  # RNG use between steps: a resumed run must continue the same stream
        losses.append(global_mean(loss.detach().float()))
    return losses


def full_optimizer_state(result) -> dict[str, torch.Tensor]:
    """{'<param name>/<key>': full fp32 CPU tensor} over every rank (collective)."""
    model = model_tensors(result.model)
    local = optimizer_state_tensors(OptimizerView(result.optim), param_names(model))
    local = in_saved_order(local, model, saved_orders(result.model))  # the user's layout, as saved
    mine = {k.removeprefix("optim/"): (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().cpu().clone()
            for k, v in local.items()}
    parts = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    out = {}
    for part in parts:
        out.update(part)
    return out


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_cases(cases: dict, root: str) -> dict:
    """On every rank: N steps, save, M steps; rank 0 returns losses, final weights, and the full
    weights and optimizer state at save time."""
    out = {}
    for name, (strategy, optimizer, shuffle, *zoo) in cases.items():
        result = _build(strategy, optimizer, shuffle, *zoo)
        batches = iter(result.dataloader)
        _steps(result, batches, N)
        atorch.save_checkpoint(os.path.join(root, name), result, step=N, extra={"case": name})
        guard = _state_dict_guard(result)
        at_save = (full_state_dict(result.model), full_optimizer_state(result))
        losses = _steps(result, batches, M)
        weights = full_state_dict(result.model)
        out[name] = {"losses": losses, "weights": weights, "saved_weights": at_save[0], "saved_optim": at_save[1],
                     "lr": result.optim.param_groups[0]["lr"], "guard": guard}
        if name == "fsdp":  # a plain model's export, for load_state_dict(strict=True) on one process
            atorch.export_model(result, os.path.join(root, "export-gpt-fsdp"))
        if not _is_rank0():
            out[name] = {"losses": losses}
    return out


def _state_dict_guard(result) -> str | None:
    """The error result.optim.state_dict() raises (None when it returns)."""
    try:
        result.optim.state_dict()
    except ShardedStateError as error:
        return str(error)
    return None


EXPORTS = {"llama-fsdp": ("llama", ["fsdp"]), "llama-tp": ("llama", [TP2, "tensor_parallel"]),
           "gpt2-tp": ("gpt2", [TP2, "tensor_parallel"]), "mixtral-tp": ("mixtral", [TP2, "tensor_parallel"])}


def save_and_export(cases: dict, root: str) -> dict:
    """The 2-rank save launch: the resume cases, then HF models trained and exported."""
    out = save_cases(cases, root)
    for name, (zoo, strategy) in EXPORTS.items():
        run = train_gpt(strategy, steps=2, hf_model=zoo, optim_func=torch.optim.AdamW, optim_args={"lr": 1e-2})
        atorch.export_model(run["result"], os.path.join(root, f"export-{name}"))
        out[f"export-{name}"] = run["weights"] if _is_rank0() else None
    out["ds_3d_refusal"] = _ds_3d_refusal(root)
    return out


def _ds_3d_refusal(root: str) -> str:
    """What save_checkpoint says under ds_3d_parallel over an nn.Sequential (DeepSpeed's own partition of
    its layers by index), which it refuses."""
    status, result, _ = atorch.auto_accelerate(
        tiny_sequential(), torch.optim.SGD, PairDataset(16), pair_loss, optim_args={"lr": 0.1},
        dataloader_args={"batch_size": 8}, load_strategy=[PP2, ("ds_3d_parallel", {"num_micro_batch": 4})])
    assert status
    try:
        atorch.save_checkpoint(os.path.join(root, "ds3d"), result)
    except CheckpointError as error:
        return f"{type(error).__name__}: {error} [{error.key}] exists={os.path.exists(os.path.join(root, 'ds3d'))}"
    return "saved"


def load_cases(cases: dict, root: str) -> dict:
    """On every rank: build, load, M steps; rank 0 returns what it loaded and the M steps."""
    out = {}
    for name, (source, strategy, optimizer, shuffle, *zoo) in cases.items():
        result = _build(strategy, optimizer, shuffle, *zoo)
        info = atorch.load_checkpoint(os.path.join(root, source), result)
        loaded = (full_state_dict(result.model), full_optimizer_state(result))
        losses = _steps(result, iter(result.dataloader), M)
        weights = full_state_dict(result.model)
        out[name] = {"losses": losses, "weights": weights, "loaded_weights": loaded[0], "loaded_optim": loaded[1],
                     "step": info["step"], "extra": info["extra"], "lr": result.optim.param_groups[0]["lr"]}
        if not _is_rank0():
            out[name] = {"losses": losses}
    return out


def _resume_cases(saved: dict) -> dict:
    return {name: (name, strategy, *rest) for name, (strategy, *rest) in saved.items()}


def _cross_cases(world: int) -> dict:
    every = {**SAVED_ON_2, **SAVED_ON_4}
    return {name: (source, strategy, *every[source][1:])
            for name, (source, strategy, size) in CROSS.items() if size == world}


def run_phase(world: int, phase, cases: dict, root: str) -> dict:
    return run_distributed(phase, world, cases, root, timeout_s=900)[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("checkpoints"))
    references = run_phase(2, save_and_export, SAVED_ON_2, root)
    references.update(run_phase(4, save_cases, SAVED_ON_4, root))
    return root, references


@pytest.fixture(scope="module")
def loaded(saved):
    root, _ = saved
    out = run_phase(1, load_cases, _cross_cases(1), root)
    out.update(run_phase(2, load_cases, {**_resume_cases(SAVED_ON_2), **_cross_cases(2)}, root))
    out.update(run_phase(4, load_cases, {**_resume_cases(SAVED_ON_4), **_cross_cases(4)}, root))
    return out


def _state_difference(state: dict, reference: dict) -> float:
    assert state.keys() == reference.keys(), sorted(set(state) ^ set(reference))
    return weight_difference(state, reference)


@pytest.mark.parametrize("name", [*SAVED_ON_2, *SAVED_ON_4])
def test_resume_equals_the_uninterrupted_run(saved, loaded, name):
    _, references = saved
    reference, run = references[name], loaded[name]
    assert run["step"] == N and run["extra"] == {"case": name}
    loss_diff = relative_difference(run["losses"], reference["losses"])
    weight_diff = weight_difference(run["weights"], reference["weights"])
    print(f"{name}: losses {run['losses']} vs {reference['losses']}: rel {loss_diff:.1e}; "
          f"weights rel {weight_diff:.1e}")
    assert loss_diff < EXACT and weight_diff < EXACT
    assert _state_difference(run["loaded_optim"], reference["saved_optim"]) < EXACT
    assert run["lr"] == pytest.approx(reference["lr"], rel=1e-12)


@pytest.mark.parametrize("name", list(CROSS))
def test_checkpoint_loads_under_another_strategy_and_world_size(saved, loaded, name):
    _, references = saved
    source = references[CROSS[name][0]]
    run = loaded[name]
    weights = _state_difference(run["loaded_weights"], source["saved_weights"])
    optim = _state_difference(run["loaded_optim"], source["saved_optim"])
    loss_diff = relative_difference(run["losses"], source["losses"])
    final = weight_difference(run["weights"], source["weights"])
    print(f"{name}: loaded weights rel {weights:.1e}, optimizer state rel {optim:.1e}; continued losses rel "
          f"{loss_diff:.1e}, final weights rel {final:.1e}")
    assert weights < EXACT and optim < EXACT
    assert loss_diff < PARITY and final < PARITY
    assert run["lr"] == pytest.approx(source["lr"], rel=1e-12)  # the scheduler's position came back


SHARDED = {"zero1", "zero2", "fsdp", "tp", "pp", "mixed", "gpt2_tp", "mixtral_tp", "titan_moe_tp", "ds_zero1",
           "ds_zero2", "ds_3d"}


@pytest.mark.parametrize("name", [*SAVED_ON_2, *SAVED_ON_4])
def test_optimizer_state_dict_is_refused_where_the_state_is_split(saved, name):
    guard = saved[1][name]["guard"]
    if name in SHARDED:
        assert guard and "atorch.save_checkpoint" in guard, guard
    else:
        assert guard is None


def test_ds_3d_parallel_over_an_nn_sequential_is_refused_with_a_clear_error(saved):
    refusal = saved[1]["ds_3d_refusal"]
    assert refusal.startswith("CheckpointError") and "ds_3d_parallel" in refusal and "exists=False" in refusal, refusal


@pytest.mark.parametrize("name", list(EXPORTS))
def test_an_hf_model_exports_for_from_pretrained(saved, name):
    transformers = pytest.importorskip("transformers")
    root, references = saved
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(root, f"export-{name}"))
    weights = {k: v.float() for k, v in model.state_dict().items()}
    trained = references[f"export-{name}"]
    fresh = ZOO[EXPORTS[name][0]].build().state_dict()
    assert weights.keys() == trained.keys() == fresh.keys()
    assert weight_difference(weights, trained) == 0.0


def test_a_plain_model_exports_for_load_state_dict(saved):
    root, references = saved
    state = load_exported(os.path.join(root, "export-gpt-fsdp"))
    model = build_gpt(1)
    model.load_state_dict(state, strict=True)
    weights = {k: v.float() for k, v in model.state_dict().items()}
    assert weight_difference(weights, references["fsdp"]["weights"]) == 0.0


# --- atomic saves ------------------------------------------------------------------------------------
SAVED_ONCE_SCRIPT = r"""
import os, signal, sys, torch, atorch
from atorch.checkpoint import api
from tests.checkpoint.test_checkpoints import _build, _steps
result = _build([], "sgd", False)
batches = iter(result.dataloader)
_steps(result, batches, 1)
atorch.save_checkpoint(sys.argv[1], result, step=1)
_steps(result, batches, 1)
"""  # the start of a script that then saves again at step 2 (sys.argv[2] says how that save ends)
KILL_SCRIPT = SAVED_ONCE_SCRIPT + r"""
if sys.argv[2] == "before_rename":  # the shards of the second save are written, nothing renamed
    api.replace_dir = lambda tmp, target: os.kill(os.getpid(), signal.SIGKILL)
else:  # between the renames: the old checkpoint moved aside, the new one not yet in place
    real = os.rename
    calls = []
    def rename(a, b):
        calls.append(a)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        real(a, b)
    os.rename = rename
atorch.save_checkpoint(sys.argv[1], result, step=2)
"""


@pytest.mark.parametrize("moment", ["before_rename", "between_renames"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path, moment):
    path = str(tmp_path / "ckpt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", KILL_SCRIPT, path, moment], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert any(".tmp-" in n or ".old-" in n for n in os.listdir(tmp_path))  # the interrupted save's leftovers
    result = _build([], "sgd", False)
    info = atorch.load_checkpoint(path, result)
    assert info["step"] == 1


# --- single-process checks ---------------------------------------------------------------------------
def test_unsafe_or_incomplete_checkpoints_are_refused(tmp_path):
    result = _build([], "sgd", False)
    path = str(tmp_path / "c")
    atorch.save_checkpoint(path, result, step=0)
    with pytest.raises(CheckpointError, match="extra is not JSON-serialisable"):
        atorch.save_checkpoint(path, result, extra={"f": object()})
    meta = json.loads((tmp_path / "c" / "atorch_checkpoint.json").read_text())
    assert set(meta["model"]) == set(build_gpt(0).state_dict())  # the user's own names
    (tmp_path / "c" / ".metadata").write_bytes(b"cos\nsystem\n(S'echo hacked'\ntR.")  # a pickle calling os.system
    with pytest.raises(CheckpointError, match="os.system"):
        atorch.load_checkpoint(path, result)
    os.remove(tmp_path / "c" / "atorch_checkpoint.json")
    with pytest.raises(CheckpointError, match="did not complete"):
        atorch.load_checkpoint(path, result)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        atorch.load_checkpoint(str(tmp_path / "missing"), result)


def test_grad_scaler_and_a_user_scheduler_come_back(tmp_path):
    """amp_native fp16's grad scaler is saved; a scheduler the user built is passed as lr_scheduler=."""
    def build():
        model = build_gpt(0)
        dataset = SyntheticTokenDataset(num_samples=16, seq_len=16, vocab_size=64)
        _, result, _ = atorch.auto_accelerate(
            model, torch.optim.SGD, dataset, gpt_loss, optim_args={"lr": 0.1, "momentum": 0.9},
            model_input_format="unpack_dict", dataloader_args={"batch_size": 8},
            load_strategy=[("amp_native", {"dtype": torch.float16, "init_scale": 1024.0})])
        return result, torch.optim.lr_scheduler.LambdaLR(result.optim.torch_optimizer, lambda step: 0.5 ** step)

    result, scheduler = build()
    _steps(result, iter(result.dataloader), 2)
    scheduler.step()
    result.optim.scaler.update(new_scale=256.0)
    atorch.save_checkpoint(str(tmp_path / "c"), result, step=2, lr_scheduler=scheduler)
    fresh, fresh_scheduler = build()
    atorch.load_checkpoint(str(tmp_path / "c"), fresh, lr_scheduler=fresh_scheduler)
    assert fresh.optim.scaler.get_scale() == 256.0
    assert fresh_scheduler.last_epoch == scheduler.last_epoch == 1
    assert fresh.optim.param_groups[0]["lr"] == result.optim.param_groups[0]["lr"] == 0.05


# --- a failure on one process ------------------------------------------------------------------------
RANK_LOCAL_FAULTS = {  # where rank 1 alone raises (a function api.py calls) -> the call that meets it
    "save: reading the model": ("model_tensors", "save"),
    "save: RNG state and metadata": ("rng_state", "save"),
    "load: optimizer, RNG and data position": ("read_rng", "load"),
}


def rank_local_faults(root: str) -> dict:
    """On each rank: save a good checkpoint, then make one function raise on rank 1 only while rank 0
    goes on into the collectives that follow; every rank must get the CheckpointError (none left
    waiting), the good checkpoint must stay loadable and the process group usable."""
    from atorch.checkpoint import api

    result = _build([], "sgd", False)
    path = os.path.join(root, "ckpt")
    atorch.save_checkpoint(path, result, step=1)
    out = {}
    for label, (function, call) in RANK_LOCAL_FAULTS.items():
        real = getattr(api, function)

        def broken(*args, _real=real, _label=label):
            if dist.get_rank() == 1:
                raise RuntimeError(f"injected on rank 1 ({_label})")
            return _real(*args)

        setattr(api, function, broken)
        try:
            if call == "save":
                atorch.save_checkpoint(path, result, step=2)
            else:
                atorch.load_checkpoint(path, result)
            out[label] = "no error"
        except CheckpointError as error:
            out[label] = str(error)
        finally:
            setattr(api, function, real)
    out["step after the faults"] = atorch.load_checkpoint(path, result)["step"]
    flag = torch.ones(1)
    dist.all_reduce(flag)
    out["all_reduce after the faults"] = float(flag)
    return out


def test_one_rank_failing_inside_a_checkpoint_call_fails_every_rank(tmp_path):
    """The launcher's timeout is the hang detector: a rank left waiting in a collective would exceed it."""
    per_rank = run_distributed(rank_local_faults, 2, str(tmp_path), timeout_s=240)
    for rank, out in enumerate(per_rank):
        for label in RANK_LOCAL_FAULTS:
            assert f"injected on rank 1 ({label})" in out[label], (rank, label, out[label])
        assert out["step after the faults"] == 1, (rank, out)
        assert out["all_reduce after the faults"] == 2.0, (rank, out)
