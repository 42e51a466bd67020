"""How a training loop scaled a loss whose backward already ran inside the model call.

A pipeline schedule, the micro_batch method and DeepSpeed's pipeline engine run backward inside
``model(...)``, on the loss they computed. The loop still calls ``optim.backward(loss)`` on what it made
of that loss: a loop that accumulates gradients over calls divides it (``loss / steps``), one weighting
calls by their token counts multiplies it. Ignoring that trains on the sum where the loop asked for the
mean, silently. So the loss such a call returns carries a probe (a leaf of value 0 added to it): the
loop's backward leaves d(the loop's loss)/d(loss) in the probe's gradient, exactly the factor that
backward would have scaled the call's gradients by. The method then applies it: per call where it
keeps each call's gradients apart (pipeline_parallel), per accumulation window where it cannot
(``WindowScales``: every call of a window must be scaled alike, else InputError).
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from atorch.errors import InputError


def with_scale_probe(loss: torch.Tensor, on_scale: Callable[[float], None]) -> torch.Tensor:
    """``loss`` (detached) plus a probe: when the loop's backward reaches it, ``on_scale(factor)``."""
    probe = torch.zeros((), dtype=loss.dtype, device=loss.device, requires_grad=True)
    probe.register_post_accumulate_grad_hook(lambda leaf: on_scale(float(leaf.grad)))
    return loss.detach() + probe


class WindowScales:
    """The factors the loop's backwards gave the calls of one accumulation window, applied to the
    window's gradients when the optimizer reads them (``settle``). A call without a backward counts
    as unscaled. Calls scaled differently cannot be told apart once their gradients are summed."""

    def __init__(self, method: str):
        self.method = method
        self.calls = 0
        self.scales: list[float] = []

    def probe(self, loss: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return with_scale_probe(loss, self.scales.append)

    def settle(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        scales = self.scales + [1.0] * max(self.calls - len(self.scales), 0)
        self.calls, self.scales = 0, []
        if not scales:
            return
        scale = scales[0]
        if any(abs(s - scale) > 1e-6 * max(abs(scale), 1e-30) for s in scales):
            raise InputError(
                f"{self.method} ran backward inside each model call, and the loop scaled those calls' losses "
                f"differently before its backward ({', '.join(f'{s:g}' for s in scales)}): their gradients are "
                "already summed, so only one factor for the whole accumulation window can be applied. Scale every "
                "call's loss alike (loss / steps), or let the method accumulate (its num_micro_batch)")
        if scale != 1.0:
            with torch.no_grad():
                for param in parameters:
                    if param.grad is not None:
                        param.grad.mul_(scale)
