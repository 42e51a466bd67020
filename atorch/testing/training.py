"""The seed's training loop on the repo's GPT model, shared by parity tests, benchmarks and examples."""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
import torch.distributed as dist

from atorch.auto.accelerate import auto_accelerate
from atorch.auto.gradients import clip_grad_norm_
from atorch.checkpoint.pretrained import load_pretrained
from atorch.distributed import mesh
from atorch.models import GPT, GPTConfig, SyntheticTokenDataset, gpt_loss
from atorch.testing.community_models import TorchEncoderMaskArgLM, shared_mask_batches
from atorch.testing.hf_models import zoo_model
from atorch.utils.batch import call_with_batch
from atorch.utils.memory import training_state_bytes
from atorch.utils.modules import full_state_dict

SMALL_GPT = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def build_gpt(seed: int = 0, config: Optional[GPTConfig] = None) -> GPT:
    torch.manual_seed(seed)
    return GPT(config or SMALL_GPT)


def train_gpt(
    load_strategy: Any,
    steps: int = 5,
    global_batch: int = 8,
    seed: int = 0,
    lr: float = 0.2,
    config: Optional[GPTConfig] = None,
    optim_func: Any = torch.optim.SGD,
    optim_args: Optional[dict] = None,
    accumulation: int = 1,
    accumulate_via: str = "boundary",
    loop_backward: bool = False,
    max_grad_norm: Optional[float] = None,
    measure_state: bool = False,
    clip_via: str = "optimizer",
    loop_scheduler: bool = False,
    compiled_input: bool = False,
    given_wrapper: Optional[str] = None,
    hf_model: Optional[str] = None,
    interleaved_chunks: int = 1,
    pretrained: Optional[str] = None,
    **auto_kwargs: Any,
) -> dict:
    """Run ``steps`` steps of the seed's loop; returns the global mean loss per step, the full final
    weights (fp32, unwrapped names) and the strategy that ran.

    The default optimizer is SGD with momentum: Adam's update m/sqrt(v) turns gradients that are
    mathematically zero (e.g. the key bias under softmax) into full-size steps of arbitrary sign, so a
    rounding-level difference would look like a parity failure.

    ``accumulation`` splits each global batch into that many micro-batches (the loss of each divided
    by it, the optimizer told of the boundary as the seed says), which is the same update as one
    step on the whole batch; ``accumulate_via`` says how the loop marks the window: "boundary"
    (``set_gradient_accumulation_boundary`` where ``result.args`` asks for it), "no_sync" (a DDP loop:
    ``with result.model.no_sync():`` around every micro-step but the last) or "unmarked" (neither).
    ``loop_backward`` calls ``loss.backward()`` whatever ``use_optim_backward`` says. ``max_grad_norm``
    clips by the global norm before each step.
    ``compiled_input`` hands auto_accelerate ``torch.compile(model)``; ``given_wrapper`` ("DistributedDataParallel"
    or "DataParallel") wraps the model in that torch wrapper before handing it over (after compiling it,
    where both are asked: nanoGPT's order).
    ``loop_scheduler`` builds the loop's own scheduler on ``result.optim`` (``LambdaLR``, the learning rate
    divided by 1, 2, 3, ... over the steps) and steps it after each optimizer step.
    ``measure_state`` records this rank's parameter / gradient / optimizer-state bytes after the last
    step, before its gradients are cleared.

    ``hf_model`` names a model of the zoo (``atorch.testing.hf_models.ZOO``: HF families and plain
    PyTorch models) trained on its own data and loss instead of the repo GPT. ``interleaved_chunks``
    (single process only) runs each global batch as that many forwards over rows ``r::chunks``, the
    rows rank ``r`` sees under data parallelism: the reference for models whose BatchNorm normalises
    per forward. ``pretrained`` (with ``hf_model``): the model is built on the meta device and its
    weights are read from that directory with ``atorch.load_pretrained`` after auto_accelerate."""
    config = config or SMALL_GPT
    loss_func, input_format = gpt_loss, "unpack_dict"
    if hf_model is not None:
        zoo = zoo_model(hf_model)
        torch.manual_seed(seed)
        with torch.device("meta") if pretrained else contextlib.nullcontext():
            model = zoo.build()
        loss_func, input_format = zoo.loss_func, zoo.input_format
        dataset = zoo.make_dataset(global_batch * steps, 0)
    else:
        model = build_gpt(seed, config)
        dataset = SyntheticTokenDataset(num_samples=global_batch * steps, seq_len=config.block_size,
                                        vocab_size=config.vocab_size)
    if compiled_input:
        model = torch.compile(model)
    if given_wrapper is not None:
        model = getattr(torch.nn.parallel, given_wrapper)(model)
    if global_batch % accumulation:
        raise ValueError(f"global_batch {global_batch} does not split into {accumulation} micro-batches")
    status, result, strategy = auto_accelerate(
        model, optim_func, dataset, loss_func, optim_args=optim_args or {"lr": lr, "momentum": 0.9},
        dataloader_args={"batch_size": global_batch // accumulation}, model_input_format=input_format,
        load_strategy=load_strategy, **auto_kwargs,
    )
    assert status, "auto_accelerate failed"
    if pretrained:
        load_pretrained(pretrained, result)
    losses, norms = [], []
    scheduler = torch.optim.lr_scheduler.LambdaLR(result.optim, lambda step: 1 / (step + 1)) if loop_scheduler else None
    batches = iter(result.dataloader)
    for _ in range(steps):
        step_loss = 0.0
        for micro in range(accumulation):
            last = micro == accumulation - 1
            if result.args.requires_set_gradient_accumulation_boundary and accumulate_via == "boundary":
                result.optim.set_gradient_accumulation_boundary(last)
            full_batch = result.prepare_input(next(batches))
            with result.model.no_sync() if accumulate_via == "no_sync" and not last else contextlib.nullcontext():
                for chunk in range(interleaved_chunks):
                    batch = full_batch if interleaved_chunks == 1 else every_nth_row(full_batch, chunk,
                                                                                     interleaved_chunks)
                    output = call_model(result.model, batch, input_format)
                    loss = result.loss_func(batch, output) / accumulation / interleaved_chunks
                    if result.args.use_optim_backward and not loop_backward:
                        result.optim.backward(loss)
                    else:
                        loss.backward()
                    step_loss += global_mean(loss.detach().float())
        if max_grad_norm is not None:
            if clip_via == "model":  # atorch.clip_grad_norm_ on the returned model
                norm = clip_grad_norm_(result.model, max_grad_norm)
            elif clip_via == "torch":  # a loop written for one process: torch's own function
                norm = torch.nn.utils.clip_grad_norm_(result.model.parameters(), max_grad_norm)
            elif clip_via == "torch_part":  # torch's function over a part: every parameter but the first
                norm = torch.nn.utils.clip_grad_norm_(list(result.model.parameters())[1:], max_grad_norm)
            else:
                norm = result.optim.clip_grad_norm_(max_grad_norm)
            norms.append(None if norm is None else float(norm))
        result.optim.step()
        if scheduler is not None:
            scheduler.step()
        if measure_state:
            state = training_state_bytes(result)
        result.optim.zero_grad()
        losses.append(step_loss)
    return {
        "losses": losses, "grad_norms": norms, "weights": full_state_dict(result.model),
        "strategy": strategy, "result": result, "state_bytes": state if measure_state else None,
    }


def call_model(model: Any, batch: Any, input_format: Optional[str]) -> Any:
    """The seed's call for each model_input_format."""
    return call_with_batch(model, batch, input_format)


def every_nth_row(batch: Any, start: int, step: int) -> Any:
    if isinstance(batch, dict):
        return {k: every_nth_row(v, start, step) for k, v in batch.items()}
    return batch[start::step] if isinstance(batch, torch.Tensor) else batch


def global_mean(value: torch.Tensor) -> float:
    group = mesh.parallel_group("data_parallel")
    if group is not None and dist.get_world_size(group) > 1:
        value = value.clone()
        dist.all_reduce(value, group=group)
        value /= dist.get_world_size(group)
    return float(value.item())


def relative_difference(a: torch.Tensor | list, b: torch.Tensor | list) -> float:
    """||a - b|| / ||b|| (the measure every parity tolerance in the tests refers to)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def weight_difference(weights: dict, reference: dict) -> float:
    """Relative difference of all weights taken together (||w - w_ref|| / ||w_ref|| over the
    concatenation): per-tensor ratios explode on tensors whose reference is ~0, such as the key bias,
    which gets no gradient under softmax."""
    if weights.keys() != reference.keys():
        raise AssertionError(f"weight names differ: {sorted(set(weights) ^ set(reference))}")
    flat = torch.cat([weights[k].flatten() for k in sorted(reference)])
    flat_reference = torch.cat([reference[k].flatten() for k in sorted(reference)])
    return relative_difference(flat, flat_reference)


def train_plainly(model: torch.nn.Module, batches: Any, loss_func: Any, lr: float = 0.1,
                  optimizer: Optional[torch.optim.Optimizer] = None) -> list[float]:
    """Plain PyTorch SGD (or ``optimizer``) over ``batches`` (dicts of the forward's arguments), one step
    each: the single-process reference a strategy's run is compared with; each step's loss."""
    optim, losses = optimizer or torch.optim.SGD(model.parameters(), lr=lr), []
    for batch in batches:
        loss = loss_func(batch, model(**batch))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(float(loss))
    return losses


def train_returned(result: Any, steps: int, input_format: Optional[str] = "unpack_dict") -> list[float]:
    """Train what ``auto_accelerate`` returned for ``steps`` steps with the user's loop, as the contract
    writes it; the global mean loss of each step."""
    losses, batches = [], iter(result.dataloader)
    for _ in range(steps):
        batch = result.prepare_input(next(batches))
        loss = result.loss_func(batch, call_model(result.model, batch, input_format))
        result.optim.backward(loss) if result.args.use_optim_backward else loss.backward()
        result.optim.step()
        result.optim.zero_grad()
        losses.append(global_mean(loss.detach().float()))
    return losses


def accelerated_llama(load_strategy: Any = ()) -> tuple[list, Any]:
    """32 rows of HF Llama's forward arguments and auto_accelerate's result on them (SGD, 8 rows a batch)."""
    torch.manual_seed(0)
    model = zoo_model("llama").build()
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(32):
        ids = torch.randint(1, 64, (12,), generator=generator)
        rows.append({"input_ids": ids, "labels": ids})
    _, result, _ = auto_accelerate(model, torch.optim.SGD, rows, lambda batch, output: output.loss,
                                   optim_args={"lr": 0.1}, dataloader_args={"batch_size": 8},
                                   load_strategy=list(load_strategy))
    return rows, result


# the loss each micro-step of a window of two is scaled by before backward: the mean of the window, a
# sum, and weights of the loop's own (as a loop weighting micro-steps by their token counts has)
WINDOW_SCALES = {"mean": (0.5, 0.5), "sum": (1.0, 1.0), "weighted": (0.25, 0.75)}


def train_accumulating(load_strategy: Any = (), scales: tuple[float, float] = (0.5, 0.5)) -> dict[str, torch.Tensor]:
    """The user's own gradient accumulation over ``accelerated_llama``'s 4 batches, windows of two, the
    boundary set before each model call as the README says, each call's loss multiplied by its ``scales``
    entry before backward; the full final weights."""
    _, result = accelerated_llama(load_strategy)
    for step, batch in enumerate(result.dataloader):
        batch = result.prepare_input(batch)
        if result.args.requires_set_gradient_accumulation_boundary:
            result.optim.set_gradient_accumulation_boundary(step % 2 == 1)
        loss = result.loss_func(batch, result.model(**batch)) * scales[step % 2]
        result.optim.backward(loss) if result.args.use_optim_backward else loss.backward()
        if step % 2 == 1:
            result.optim.step()
            result.optim.zero_grad()
    model = result.model
    return model.full_state_dict() if hasattr(model, "full_state_dict") else full_state_dict(model)


def shared_mask_loss(batch: dict, output: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of ``TorchEncoderMaskArgLM``'s logits on its batch's ``input_ids``."""
    logits, ids = output[:, :-1].float(), batch["input_ids"]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def train_shared_mask(load_strategy: Any, rows: int = 8, steps: int = 3) -> dict:
    """``TorchEncoderMaskArgLM`` trained ``steps`` SGD steps on ``shared_mask_batches`` (each batch's rows
    share one causal mask, an input of another first dimension than the batch's) under ``load_strategy``,
    and the same steps plainly on this process: both runs' losses and weights. ``None``: the plain run alone."""
    batches = shared_mask_batches(rows, steps)
    torch.manual_seed(0)
    plain = TorchEncoderMaskArgLM()
    reference = {"losses": train_plainly(plain, batches, shared_mask_loss), "weights": full_state_dict(plain)}
    rows_of_data = [{"input_ids": row} for batch in batches for row in batch["input_ids"]]

    def collate(items: list) -> dict:  # as the script's own collate_fn: the rows stacked, the one mask beside them
        return {"src_mask": batches[0]["src_mask"], "input_ids": torch.stack([item["input_ids"] for item in items])}

    torch.manual_seed(0)
    _, result, _ = auto_accelerate(TorchEncoderMaskArgLM(), torch.optim.SGD, rows_of_data, shared_mask_loss,
                                   optim_args={"lr": 0.1}, dataloader_args={"batch_size": rows, "collate_fn": collate},
                                   model_input_format="unpack_dict", load_strategy=list(load_strategy))
    losses = []
    for batch in batches:
        batch = result.prepare_input(batch)
        loss = result.loss_func(batch, result.model(**batch))
        result.optim.backward(loss) if result.args.use_optim_backward else loss.backward()
        result.optim.step()
        result.optim.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "weights": full_state_dict(result.model), "reference": reference}
