"""Checking a tensor-parallel plan before it is accepted: the split model must reproduce the
unsplit model on a sample batch, forward and backward, or ``auto_accelerate`` refuses it.

Why: a plan is found from one traced forward, and the model's own code may do things the trace
cannot promise survive a split (a width read from its input, an attribute used to build a tensor).
Refusing here, with a typed error, is the difference between "not supported" and a crash or a wrong
loss inside the user's training loop. The check runs in eval mode (no dropout) under a forked RNG
and leaves no gradient behind.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from atorch.auto.opt_lib.pipeline_structure import no_cache_kwargs
from atorch.auto.opt_lib.tp_shapes import ShapeLocalizer, localize_attributes, remove_localizer, restore_attributes
from atorch.distributed.agreement import exchange_outside_collectives
from atorch.errors import MethodConfigError
from atorch.utils.batch import call_with_batch, loss_value, tensors
from atorch.utils.dataflow import Dataflow, record_dataflow
from atorch.utils.meta_init import has_meta_tensors, sample_values

logger = logging.getLogger(__name__)
VARIANTS = ("views", "heads", "attributes")  # tp_shapes' remedies, in the order they are tried


@dataclass
class Probe:
    """One sample batch and how to run the model and the loss on it."""

    batch: Any
    call: Callable[[nn.Module, Any], Any]
    loss: Optional[Callable[[Any, Any], Any]] = None
    input_format: Optional[str] = None  # how ``call`` passes the batch (model_input_format)

    def run(self, model: nn.Module) -> Any:
        with sample_values(model):  # a model still on the meta device runs on sample values
            return self.call(model, self.batch)

    def record(self, model: nn.Module) -> tuple[Dataflow, "Reference"]:
        """The dataflow of one forward, and that forward's output tensors and Linear outputs (the reference)."""
        holder = {}
        with linear_prints(model) as prints:
            flow = record_dataflow(model, lambda m: holder.setdefault("out", self.run(m)))
        outputs = [t.detach().clone() for t in _float_tensors(holder["out"])]
        return flow, Reference(outputs, prints, _tolerance(_computed_in(model, outputs)))


@dataclass
class Reference:
    """The unsplit model's forward on the probe: its output tensors, and (sum, sum of absolute values) of
    every Linear's output, call by call (``linear_prints``)."""

    outputs: list[torch.Tensor]
    prints: dict[str, list[tuple[float, float]]]
    tolerance: float = 1e-3  # relative, for the precision the unsplit model computed in (``_computed_in``)


@contextlib.contextmanager
def linear_prints(model: nn.Module, names: Optional[set[str]] = None):
    """(sum, sum of absolute values) of the output of each Linear (of ``names``, else every one), call by
    call, while the block runs."""
    prints: dict[str, list[tuple[float, float]]] = {}

    def hook(name: str):
        def record(module, args, output):
            if not (isinstance(output, torch.Tensor) and output.is_floating_point()):
                return
            with torch._C.DisableTorchFunction():  # unseen by a recording of the dataflow around it
                local = (output.to_local() if isinstance(output, DTensor) else output).detach().double()
                prints.setdefault(name, []).append((float(local.sum()), float(local.abs().sum())))
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()
               if (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D") and (names is None or n in names)]
    try:
        yield prints
    finally:
        for handle in handles:
            handle.remove()


def probe_from_context(ctx) -> Optional[Probe]:
    """A probe on one row of the user's data, called as training calls the model (no KV cache)."""
    batch = ctx.sample_batch()
    if batch is None:
        return None
    def call(model: nn.Module, data: Any) -> Any:
        if ctx.model_input_format == "unpack_dict":
            return model(**data, **no_cache_kwargs(model, data))
        return call_with_batch(model, data, ctx.model_input_format)

    return Probe(batch, call, ctx.loss_func, ctx.model_input_format)


def _float_tensors(output: Any) -> list[torch.Tensor]:
    return [t for t in tensors(output) if t.is_floating_point()]


def check_plan(model: nn.Module, probe: Probe, reference: Reference, *, regions: dict[str, nn.Module],
               sizes: dict[str, set], heads: dict[str, set], localizers: dict[str, ShapeLocalizer], tp: int, group,
               described: str, whole_outputs: frozenset = frozenset(), sharded_outputs: frozenset = frozenset()) -> str:
    """Try tp_shapes' remedies in order until the split model matches ``reference`` on every rank of
    ``group``; then one backward. Returns the remedy kept; MethodConfigError when none works.
    ``whole_outputs``: split Linears whose output is whole on every rank (row-wise, reduced): each call's
    output must match the unsplit model's too, since a wrong split part can hide in the model's output
    behind the residual stream (at initialisation an MLP's output is small beside it).
    ``sharded_outputs``: split Linears whose output is reduced and split over the sequence (sequence
    parallelism): each rank holds other tokens of it, so the ranks' fingerprints, summed, must match."""
    failures = []
    for variant in VARIANTS:
        chosen = {"views": {}, "heads": heads, "attributes": sizes}[variant]
        changed = {n: localize_attributes(m, chosen.get(n, set()), tp) for n, m in regions.items()}
        for mode in localizers.values():
            mode.rewrites = 0
        error, raised, shards = _forward_error(model, probe, reference, whole_outputs, sharded_outputs)
        error = _agreed(error, raised, group, shards, reference)
        if error is None:
            _backward(model, probe, group)
            _drop_unused(localizers)
            return variant
        failures.append(f"{variant}: {error}")
        for name, old in changed.items():
            restore_attributes(regions[name], old)
    raise MethodConfigError(
        "tensor_parallel", f"the plan found does not reproduce the unsplit model on a sample batch "
        f"({'; '.join(failures)}); it split {described}; give the split with {{'plan': {{...}}}} or use another "
        "parallelism")


def _forward_error(model: nn.Module, probe: Probe, reference: Reference, whole_outputs: frozenset = frozenset(),
                   sharded_outputs: frozenset = frozenset()) -> tuple[Optional[str], bool, dict]:
    """Why the split model's output, or a whole row-wise Linear's, differs from ``reference`` (None when
    they match), whether it raised rather than computed, and this rank's fingerprints of the
    sequence-split row-wise outputs (``sharded_outputs``), to be summed over the ranks."""
    training = model.training
    try:
        with (torch.no_grad(), torch.random.fork_rng(devices=_devices()),
              linear_prints(model, whole_outputs | sharded_outputs) as got):
            model.eval()
            outputs = _float_tensors(probe.run(model))
    except Exception as error:  # the split model's own code failed: the next remedy, or a refusal
        return f"{type(error).__name__}: {str(error)[:300]}", True, {}
    finally:
        model.train(training)
    whole = {name: calls for name, calls in got.items() if name not in sharded_outputs}
    shards = {name: calls for name, calls in got.items() if name in sharded_outputs}
    error = (_output_error(outputs, reference.outputs, reference.tolerance)
             or _print_error(whole, reference.prints, reference.tolerance))
    return error, False, shards


def _computed_in(model: nn.Module, outputs: list[torch.Tensor]) -> torch.dtype:
    """The least precise floating dtype the check's numbers went through: the model's parameters' (a model
    the user cast to bf16 whose head returns fp32 logits, as HF's do, still computes every layer in bf16)
    or its outputs'."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()} | {t.dtype for t in outputs}
    return max(dtypes, key=lambda dtype: torch.finfo(dtype).eps, default=torch.float32)


def _print_error(got: dict[str, list], expected: dict[str, list], tolerance: float) -> Optional[str]:
    """The first row-wise Linear whose output (sum, sum of absolute values) differs from the unsplit
    model's, relative to the latter, beyond the tolerance of the precision the model computes in."""
    for name, calls in got.items():
        for index, ((total, size), (ref_total, ref_size)) in enumerate(zip(calls, expected.get(name, []))):
            scale = max(ref_size, 1e-30)
            diff = max(abs(total - ref_total), abs(size - ref_size)) / scale
            if not diff <= tolerance:
                return (f"{name}'s output (call {index}) differs by {diff:.1e} (relative) from the unsplit model's: "
                        "a split part computes something else")
    return None


def _output_error(got: list[torch.Tensor], reference: list[torch.Tensor], tolerance: float) -> Optional[str]:
    if len(got) != len(reference):
        return f"{len(got)} output tensors instead of {len(reference)}"
    for index, (a, b) in enumerate(zip(got, reference)):
        if a.shape != b.shape:
            return f"output {index} has shape {tuple(a.shape)} instead of {tuple(b.shape)}"
        scale = b.abs().max().item() or 1.0
        diff = (a.float() - b.float()).abs().max().item() / scale
        if not diff <= tolerance:
            return f"output {index} differs by {diff:.1e} (relative) from the unsplit model's"
    return None


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2


def _agreed(error: Optional[str], raised: bool, group, shards: Optional[dict] = None,
            reference: Optional[Reference] = None) -> Optional[str]:
    """None when every rank's split model matched, else why not, agreed through the store (not a
    collective: when only this rank raised, the others are still inside one of the split model's
    collectives). The sequence-split row-wise outputs' fingerprints (``shards``) are summed over the
    ranks and compared with the ``reference``'s there.

    Every rank raising the same error is the plan's problem: the next remedy. Ranks that raised
    differently, or some not at all, met a fault of one rank (the others' collectives then time out):
    every rank raises the earliest failure, naming its rank, instead of trying the next remedy on a
    broken process group."""
    if group is None or not dist.is_initialized():
        return error
    mine = json.dumps({"rank": dist.get_rank(), "error": error, "raised": raised, "at": time.time(),
                       "shards": shards or {}})
    records = [json.loads(r) for r in exchange_outside_collectives(mine, group)]
    raisers = [r for r in records if r["raised"]]
    if raisers and len({r["error"] for r in records}) > 1:
        first = min(raisers, key=lambda r: r["at"])
        raise MethodConfigError("tensor_parallel", f"checking the plan on a sample, the split model raised on rank "
                                f"{first['rank']} only ({first['error']}); the other ranks' collectives failed "
                                "after it")
    if any(r["error"] is not None for r in records):
        return error or "another rank differed"
    if reference is None:
        return None
    return _summed_shards_error([r["shards"] for r in records], reference)


def _summed_shards_error(shards: list[dict], reference: Reference) -> Optional[str]:
    """``_print_error`` on the ranks' fingerprints of each sequence-split output, summed: the ranks hold
    disjoint tokens of it, so the sums add up to the whole output's."""
    summed = {}
    for name in shards[0] if shards else []:
        calls = [rank.get(name, []) for rank in shards]
        if len({len(c) for c in calls}) != 1:
            return f"{name} ran a different number of times on different ranks"
        summed[name] = [(sum(c[i][0] for c in calls), sum(c[i][1] for c in calls)) for i in range(len(calls[0]))]
    return _print_error(summed, reference.prints, reference.tolerance)


class LossFuncError(Exception):
    """The user's loss_func raised on the sample batch (``_sample_loss``)."""


def _sample_loss(probe: Probe, output: Any) -> torch.Tensor:
    """The user's loss on the sample batch, its failure told apart from the split model's: a loss_func that
    reads what prepare_input dropped (labels kept out of the model's input) fails here first."""
    try:
        return loss_value(probe.loss(probe.batch, output))
    except Exception as error:
        raise LossFuncError(f"your loss_func(batch, output) raised {type(error).__name__}: {str(error)[:300]} on it "
                            "(batch as prepare_input returns it, the model's input, which loss_func gets too: "
                            "keep in it what the loss reads, such as labels)") from error


def _backward(model: nn.Module, probe: Probe, group=None) -> None:
    """One forward and backward through the loss (no optimizer step); gradients are dropped after.

    Every parameter left whole (not a DTensor) is the same on every tensor rank and must get the same
    gradient there, or the ranks' copies drift apart step by step, silently. One that gets different
    gradients is used by split computation that sees only this rank's share (a scalar gain on a
    column-split activation, a key head broadcast to each rank's own heads): the plan is refused,
    naming it, rather than trained."""
    if probe.loss is None:
        return
    training = model.training
    try:
        with torch.random.fork_rng(devices=_devices()):
            model.eval()
            loss = _sample_loss(probe, probe.run(model))
            if not loss.requires_grad and has_meta_tensors(model):
                # a model still on the meta device runs forward only on sample values (sample_values), where
                # no trainable leaf is reached when every parameter it holds is a sample (a frozen base with
                # its adapters, PEFT's LoRA, on meta): nothing to check until its values are real
                return
            loss.backward()
        prints = _gradient_prints(model)
    except LossFuncError as error:  # at once: a peer waiting in a collective is ended by the dry run's fault handling
        raise MethodConfigError("tensor_parallel", f"checking the split model on a sample batch, {error}") from error
    except Exception as error:
        raise MethodConfigError("tensor_parallel", f"the split model's backward failed on a sample batch: "
                                f"{type(error).__name__}: {str(error)[:300]}") from error
    finally:
        model.train(training)
        for param in model.parameters():
            param.grad = None
    if group is None or not dist.is_initialized():
        return
    records = [json.loads(r) for r in exchange_outside_collectives(json.dumps({"prints": prints}), group)]
    diverged = _diverged_gradients(records)
    if diverged:
        raise MethodConfigError(
            "tensor_parallel", f"{diverged[0]} is kept whole on every tensor rank but gets a different gradient on "
            f"each ({len(diverged)} such parameter(s): {', '.join(diverged[:4])}): split computation uses it with "
            "only its rank's share, so the copies would drift apart; give the split with {'plan': {...}} or use "
            "another parallelism")


def _gradient_prints(model: nn.Module) -> dict[str, list[float]]:
    """(sum, sum of absolute values) of each whole parameter's gradient."""
    return {name: [float(p.grad.double().sum()), float(p.grad.double().abs().sum())]
            for name, p in model.named_parameters()
            if p.grad is not None and not isinstance(p, DTensor) and not isinstance(p.grad, DTensor)}


def _diverged_gradients(records: list[dict]) -> list[str]:
    """Whole parameters whose gradient fingerprints differ between the ranks."""
    if len(records) < 2:
        return []
    first, diverged = records[0]["prints"], []
    for name, (total, size) in first.items():
        for record in records[1:]:
            other = record["prints"].get(name)
            scale = max(size, 1e-30)
            if other is None or abs(other[0] - total) > 1e-5 * scale or abs(other[1] - size) > 1e-5 * scale:
                diverged.append(name)
                break
    return diverged


def _drop_unused(localizers: dict[str, ShapeLocalizer]) -> None:
    """Regions whose shapes all fitted need no localizer in training."""
    for mode in localizers.values():
        if mode.rewrites == 0:
            remove_localizer(mode)


def _devices() -> list[int]:
    return [torch.cuda.current_device()] if torch.cuda.is_available() else []
