"""What a model split by tensor_parallel may return: not the attention weights of this rank's heads.

An attention split by heads computes, beside its output (all-reduced, or reduce-scattered, to the whole
one), the weights of its own heads only. A model asked for them (transformers' ``output_attentions``)
would return this rank's heads as if they were all, a tensor of another shape than one process's, with
nothing said. The attention modules' further outputs are recorded by identity during each forward; one
of them in the model's output is an ``InputError`` there. Further outputs of layers without heads (an
MoE layer's router logits, computed by its whole router) are the whole ones and pass. Inside a graph
torch.compile traces (native_dynamo's "model" scope) nothing is recorded: the check is eager only.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from atorch.errors import InputError
from atorch.utils.batch import tensors


class _HeadOutputs:
    def __init__(self) -> None:
        self.seen: dict[int, tuple[torch.Tensor, str]] = {}
        self.active = False  # inside the model's forward: a checkpoint's recompute in backward keeps nothing

    def begin(self, module: nn.Module, args: tuple) -> None:
        self.seen, self.active = {}, True

    def record(self, name: str, module: nn.Module, args: tuple, output: Any) -> None:
        if self.active and isinstance(output, tuple) and not torch.compiler.is_compiling():  # eager only
            for extra in tensors(output[1:]):
                self.seen[id(extra)] = (extra, name)

    def refuse_in_output(self, module: nn.Module, args: tuple, output: Any) -> None:
        seen, self.seen, self.active = self.seen, {}, False
        if not seen or torch.compiler.is_compiling():  # nothing recorded (SDPA returns no weights): no walk
            return
        returned = sorted({seen[id(t)][1] for t in tensors(output) if id(t) in seen and seen[id(t)][0] is t})
        if returned:
            raise InputError(f"tensor_parallel: the model returns what its split attention computes beside its "
                             f"output ({', '.join(returned[:3])}{', ...' if len(returned) > 3 else ''}): the "
                             "attention weights of this rank's heads only (transformers' output_attentions=True), "
                             "not all of them as one process returns; call without it, or read them from a model "
                             "that is not split")


def refuse_head_outputs(model: nn.Module, attentions: list[str]) -> None:
    """Record the further outputs of the ``attentions`` (modules holding split heads) and refuse a forward
    of ``model`` that returns one of them."""
    if not attentions:
        return
    outputs = _HeadOutputs()
    for name in attentions:
        model.get_submodule(name).register_forward_hook(partial(outputs.record, name))
    model.register_forward_pre_hook(outputs.begin)
    model.register_forward_hook(outputs.refuse_in_output, always_call=True)
