"""save_checkpoint(..., async_save=True): training goes on while a thread writes the files.

The state saved is the state at the call (the tensors are copied first), whatever training does next;
the next save / load and wait_for_checkpoint() wait for it; a failure on one rank raises the same
CheckpointError on every rank at that wait and leaves the previous checkpoint loadable; a process that
exits, or is killed, with a save in flight leaves a complete checkpoint (exit waits) or the previous one.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch.distributed as dist

import atorch
from atorch.checkpoint import api
from atorch.checkpoint.optimizer_state import OptimizerView
from atorch.errors import CheckpointError
from atorch.testing import run_distributed
from atorch.testing.training import weight_difference
from atorch.utils.modules import full_state_dict
from tests.checkpoint.test_checkpoints import SAVED_ONCE_SCRIPT, _build, _steps, full_optimizer_state

pytestmark = pytest.mark.multirank

STRATEGIES = {"ddp": [], "zero1": ["zero1"], "fsdp": ["fsdp"]}


def async_then_train(root: str) -> dict:
    """Per strategy: 2 steps, an asynchronous save, 2 more steps while it writes, then a load (which
    waits for it) into a fresh model, and one into the trained model (its optimizer state is read in
    place): the loaded state must be the state at the save, not later."""
    out = {}
    for name, strategy in STRATEGIES.items():
        path = os.path.join(root, name)
        result = _build(strategy, "adamw", True)
        batches = iter(result.dataloader)
        _steps(result, batches, 2)
        saved = {"weights": full_state_dict(result.model), "optim": full_optimizer_state(result)}
        pending = atorch.save_checkpoint(path, result, step=2, async_save=True)
        _steps(result, batches, 2)  # changes the live tensors while the thread writes
        fresh = _build(strategy, "adamw", True)
        info = atorch.load_checkpoint(path, fresh)  # waits for the pending save first
        out[name] = {"step": info["step"], "done": pending.done(), **_difference(fresh, saved)}
        before = _state_ids(result)
        atorch.load_checkpoint(path, result)  # into the optimizer's own state tensors, in place
        out[f"{name} in place"] = {"step": 2, "done": _state_ids(result) == before, **_difference(result, saved)}
    return out


def _state_ids(result) -> set[int]:
    return {id(t) for state in OptimizerView(result.optim).local.state.values() for t in state.values()}


def _difference(result, saved: dict) -> dict:
    return {"weights": weight_difference(full_state_dict(result.model), saved["weights"]),
            "optim": max((state - saved["optim"][k]).abs().max().item()
                         for k, state in full_optimizer_state(result).items())}


def test_an_async_save_holds_the_state_at_the_call_and_the_next_load_waits_for_it(tmp_path):
    for rank, out in enumerate(run_distributed(async_then_train, 2, str(tmp_path), timeout_s=300)):
        for name, row in out.items():
            assert row == {"step": 2, "done": True, "weights": 0.0, "optim": 0.0}, (rank, name, row)


def failing_async_save(root: str) -> dict:
    """Rank 1 fails to write its RNG file in the background: every rank raises at the next wait,
    the checkpoint saved before stays in place, and the next save works."""
    path = os.path.join(root, "ckpt")
    result = _build(["fsdp"], "sgd", False)
    batches = iter(result.dataloader)
    _steps(result, batches, 1)
    atorch.save_checkpoint(path, result, step=1)
    real = api.write_json

    def write_json(file: str, value) -> None:
        if dist.get_rank() == 1 and "rank-1" in file:
            raise OSError("disk full (injected on rank 1)")
        real(file, value)

    api.write_json = write_json
    try:
        atorch.save_checkpoint(path, result, step=2, async_save=True)
        _steps(result, batches, 1)
        with pytest.raises(CheckpointError) as caught:
            atorch.wait_for_checkpoint()
    finally:
        api.write_json = real
    atorch.wait_for_checkpoint()  # raised once: nothing pending any more
    out = {"error": str(caught.value), "step": atorch.load_checkpoint(path, result)["step"]}
    atorch.save_checkpoint(path, result, step=3, async_save=True)
    out["after"] = atorch.load_checkpoint(path, result)["step"]
    return out


def test_a_failing_async_save_raises_on_every_rank_and_keeps_the_previous_checkpoint(tmp_path):
    for rank, out in enumerate(run_distributed(failing_async_save, 2, str(tmp_path), timeout_s=300)):
        assert "disk full (injected on rank 1)" in out["error"], (rank, out)
        assert out["step"] == 1 and out["after"] == 3, (rank, out)


EXIT_SCRIPT = SAVED_ONCE_SCRIPT + r"""
if sys.argv[2] == "kill":  # the second save's shards are written in the background, then the process dies
    api.replace_dir = lambda tmp, target: os.kill(os.getpid(), signal.SIGKILL)
atorch.save_checkpoint(sys.argv[1], result, step=2, async_save=True)
"""  # and the script ends at once, the save still in flight


@pytest.mark.parametrize("ending, step", [("exit", 2), ("kill", 1)])
def test_a_process_ending_with_an_async_save_in_flight_leaves_a_complete_checkpoint(tmp_path, ending, step):
    path = str(tmp_path / "ckpt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, path, ending], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == (0 if ending == "exit" else -signal.SIGKILL), done.stderr[-3000:]
    assert atorch.load_checkpoint(path, _build([], "sgd", False))["step"] == step
