"""Training that survives a killed rank under ``torchrun --max-restarts 1``: used by
tests/distributed/test_elastic_restart.py.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 elastic_restart.py OUT STRATEGY KILL_STEP [hold]

Trains a tiny GPT for ``STEPS`` steps under STRATEGY (ddp, zero1, zero2, fsdp; fsdp_meta: fsdp on the GPT
built on the meta device, its seed-0 weights loaded with ``atorch.load_pretrained`` in the first step),
saving a checkpoint every ``EVERY`` steps to OUT/ckpt and resuming from it when it exists. In the first attempt
(TORCHELASTIC_RESTART_COUNT 0) rank 1 kills itself with SIGKILL after step KILL_STEP (-1: never), so torchrun
restarts both ranks, which resume from the last checkpoint. Each rank appends ``{"attempt", "step", "loss"}``
lines to OUT/losses-<rank>.jsonl; at the end, rank 0 writes the final weights to OUT/weights.pt.

With ``hold``, rank 0 waits after step KILL_STEP (once) instead of going on into the next step's all-reduce:
it cannot fail on its dead peer, so on two one-rank "nodes" its agent restarts it for the membership change
without counting a restart, while rank 1's agent counts one. Without the hold, which agent counts depends on
whether rank 0's all-reduce fails before its agent sees rank 1's agent rejoin (a race).
"""
import json
import os
import signal
import sys
import time

import torch
from safetensors.torch import save_file

import atorch
from atorch.auto import auto_accelerate
from atorch.models import GPT, GPTConfig, SyntheticTokenDataset, gpt_loss
from atorch.utils.modules import full_state_dict

STEPS, EVERY = 10, 4
HOLD_S = 120  # longer than an agent takes to see the membership change; the agent ends the wait
STRATEGIES = {"ddp": [], "zero1": ["zero1"], "zero2": ["zero2"], "fsdp": ["fsdp"], "fsdp_meta": ["fsdp"]}


def meta_model(cfg: GPTConfig, out: str) -> GPT:
    """The GPT built on the meta device; its pretrained weights (the seed-0 build the other strategies
    start from) written once by rank 0 as ``OUT/pretrained/model.safetensors``, read by load_pretrained."""
    pretrained = os.path.join(out, "pretrained")
    if atorch.rank() == 0 and not os.path.isdir(pretrained):
        weights = {k: v.clone().contiguous() for k, v in GPT(cfg).state_dict().items()}  # seed 0, as main seeds
        os.makedirs(pretrained + ".tmp", exist_ok=True)
        save_file(weights, os.path.join(pretrained + ".tmp", "model.safetensors"))
        os.replace(pretrained + ".tmp", pretrained)
    torch.distributed.barrier()
    with torch.device("meta"):
        return GPT(cfg)


def main(out: str, strategy: str, kill_step: int, hold: bool = False) -> None:
    atorch.init_distributed()
    rank, attempt = atorch.rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg) if not strategy.endswith("_meta") else meta_model(cfg, out)
    status, result, _ = auto_accelerate(
        model, torch.optim.AdamW, SyntheticTokenDataset(256, 16, 64), gpt_loss, optim_args={"lr": 1e-3},
        dataloader_args={"batch_size": 8, "shuffle": True}, model_input_format="unpack_dict",
        load_strategy=STRATEGIES[strategy])
    ckpt = os.path.join(out, "ckpt")
    step = atorch.load_checkpoint(ckpt, result)["step"] if os.path.isdir(ckpt) else 0
    if step == 0 and strategy.endswith("_meta"):
        atorch.load_pretrained(os.path.join(out, "pretrained"), result)
    batches = iter(result.dataloader)
    with open(os.path.join(out, f"losses-{rank}.jsonl"), "a") as log:
        while step < STEPS:
            batch = result.prepare_input(next(batches))
            loss = result.loss_func(batch, result.model(**batch))
            result.optim.backward(loss) if result.args.use_optim_backward else loss.backward()
            result.optim.step()
            result.optim.zero_grad()
            step += 1
            log.write(json.dumps({"attempt": attempt, "step": step, "loss": loss.item()}) + "\n")
            log.flush()
            if step % EVERY == 0:
                atorch.save_checkpoint(ckpt, result, step=step)
            if step == kill_step and rank == 1 and attempt == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            held = os.path.join(out, "held-0")
            if hold and step == kill_step and rank == 0 and not os.path.exists(held):
                open(held, "w").close()
                time.sleep(HOLD_S)
    weights = full_state_dict(result.model)
    if rank == 0:
        torch.save(weights, os.path.join(out, "weights.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), hold=sys.argv[4:] == ["hold"])
