"""What a model split by tensor_parallel may return: not the attention weights of this rank's heads.

An attention split by heads computes, beside its output (all-reduced, or reduce-scattered, to the whole
one), the weights of its own heads only. A model asked for them (transformers' ``output_attentions``)
would return this rank's heads as if they were all, a tensor of another shape than one process's, with
nothing said. The attention modules' further outputs are recorded by identity during each forward; one
of them in the model's output is an ``InputError`` there. Further outputs of layers without heads (an
MoE layer's router logits, computed by its whole router) are the whole ones and pass. The recorders also
run inside the code native_dynamo compiles; there a side effect inside a checkpoint that the compiler
captures (HF's gradient checkpointing over an attention returning weights) makes dynamo run that block
eagerly: correct, slower.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from atorch.errors import InputError
from atorch.utils.batch import tensors


class _HeadOutputs:
    """The further outputs of each split attention during one forward, in a slot per module: a compiled
    block (native_dynamo) writes its own slot, so the graph it shares with the other blocks neither reads
    a list the blocks grow (dynamo would guard on its length and recompile for each layer) nor a name."""

    def __init__(self, names: list[str]) -> None:
        self.slots = [_Slot(self, name) for name in names]
        self.active = False  # inside the model's forward: a checkpoint's recompute in backward keeps nothing

    def begin(self, module: nn.Module, args: tuple) -> None:
        self._reset(active=True)

    def _reset(self, active: bool) -> None:
        self.active = active
        for slot in self.slots:
            slot.outputs = ()

    def refuse_in_output(self, module: nn.Module, args: tuple, output: Any) -> None:
        recorded = [(slot.name, slot.outputs) for slot in self.slots if slot.outputs]
        self._reset(active=False)
        if not recorded:  # nothing recorded (SDPA returns no weights): no walk
            return
        returned = sorted({name for value in tensors(output) for name, extras in recorded
                           if any(extra is value for extra in extras)})
        if returned:
            raise InputError(f"tensor_parallel: the model returns what its split attention computes beside its "
                             f"output ({', '.join(returned[:3])}{', ...' if len(returned) > 3 else ''}): the "
                             "attention weights of this rank's heads only (transformers' output_attentions=True), "
                             "not all of them as one process returns; call without it, or read them from a model "
                             "that is not split")


class _Slot:
    def __init__(self, owner: _HeadOutputs, name: str) -> None:
        self.owner, self.name, self.outputs = owner, name, ()

    def record(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.owner.active and isinstance(output, tuple):
            extras = tuple(tensors(output[1:]))
            if extras:
                self.outputs = self.outputs + extras


def refuse_head_outputs(model: nn.Module, attentions: list[str]) -> None:
    """Record the further outputs of the ``attentions`` (modules holding split heads) and refuse a forward
    of ``model`` that returns one of them."""
    if not attentions:
        return
    outputs = _HeadOutputs(attentions)
    for slot in outputs.slots:
        model.get_submodule(slot.name).register_forward_hook(slot.record)
    model.register_forward_pre_hook(outputs.begin)
    model.register_forward_hook(outputs.refuse_in_output, always_call=True)
