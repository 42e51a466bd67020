"""Train a small GPT with auto_accelerate in semi-automatic mode (a named strategy).

Run with ``make demo`` (2 CPU processes under torchrun), or directly:
    torchrun --standalone --nproc_per_node 2 examples/auto_accelerate/train.py --steps 30
    python examples/auto_accelerate/train.py --strategy outputs/demo_strategy.json   # one process
    python examples/auto_accelerate/train.py --steps 30 --save-every 10                # checkpoints...
    python examples/auto_accelerate/train.py --steps 30 --resume                       # ...and resume
The training loop below is the seed contract's loop, unchanged for any strategy.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import atorch
from atorch.auto import auto_accelerate
from atorch.models import GPT, GPTConfig, SyntheticTokenDataset, gpt_loss

DEFAULT_STRATEGY = [
    "parallel_mode",                                  # data parallel over all ranks (DDP)
    ("amp_native", {"dtype": torch.bfloat16}),        # bf16 autocast
    ("checkpoint", ("GPTBlock",)),                    # recompute each transformer block in backward
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16, help="GLOBAL batch size (strong scaling)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--strategy", default=None,
                        help="a saved strategy file (.json or .pkl); default: bf16 DDP + checkpoint")
    parser.add_argument("--save-strategy", default=None, help="where to save the strategy that ran")
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--checkpoint-dir", default="outputs/checkpoint", help="where --save-every writes checkpoints")
    parser.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from --checkpoint-dir (any strategy or number of processes may have written it)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    atorch.init_distributed()  # torchrun's group; in a plain process a one-process group
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=128, block_size=64, n_layer=4, n_head=4, n_embd=64)
    model = GPT(config)
    dataset = SyntheticTokenDataset(num_samples=args.batch_size * args.steps, seq_len=config.block_size,
                                    vocab_size=config.vocab_size)

    status, result, strategy = auto_accelerate(
        model,
        optim_func=torch.optim.AdamW,
        dataset=dataset,
        loss_func=gpt_loss,
        optim_args={"lr": args.lr},
        dataloader_args={"batch_size": args.batch_size},
        model_input_format="unpack_dict",
        load_strategy=args.strategy or DEFAULT_STRATEGY,
        save_strategy_to_file=args.save_strategy,
        ignore_dryrun_on_load_strategy=False,  # show the dry-run report (step time, peak memory)
    )
    if rank == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        print(f"auto_accelerate status={status} on {world} process(es), "
              f"device {next(result.model.parameters()).device}")
        print(strategy)
        print(result.args.dryrun)

    model, optim, dataloader = result.model, result.optim, result.dataloader
    device = next(model.parameters()).device
    done = 0
    if args.resume:  # before iterating: the dataloader then skips the batches already trained on
        done = atorch.load_checkpoint(args.checkpoint_dir, result)["step"]
        if rank == 0:
            print(f"resumed from {args.checkpoint_dir} at step {done}")
    first = last = None
    start = time.perf_counter()
    for step, batch in enumerate(dataloader, start=done + 1):
        if step > args.steps:  # a checkpoint at the end of the epoch: the loader would start the next one
            break
        batch = result.prepare_input(batch, device)
        output = model(**batch)
        loss = result.loss_func(batch, output)
        optim.backward(loss) if result.args.use_optim_backward else loss.backward()
        optim.step()
        optim.zero_grad()
        value = loss.item()
        first = value if first is None else first
        last = value
        if rank == 0 and (step % args.log_every == 0 or step == 1):
            rate = (step - done) / (time.perf_counter() - start)
            print(f"step {step:4d}/{len(dataloader)}  loss {value:.4f}  ({rate:.1f} steps/s)", flush=True)
        if args.save_every and step % args.save_every == 0:
            atorch.save_checkpoint(args.checkpoint_dir, result, step=step)  # every process calls it
    if rank == 0 and first is None:
        print(f"nothing left to train: the checkpoint is at step {done} of {len(dataloader)}")
    elif rank == 0:
        print(f"loss fell from {first:.4f} to {last:.4f}" if last < first
              else f"loss did not fall: {first:.4f} -> {last:.4f}")
        if args.save_strategy:
            print(f"strategy saved to {args.save_strategy}; reuse it with --strategy {args.save_strategy}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
