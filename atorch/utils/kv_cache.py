"""Training forwards without a key/value cache, evaluation forwards with the model's own setting.

transformers' models take ``use_cache`` in ``forward`` and default it to ``config.use_cache`` (True for
most decoders). A training step has no use for the cache, and two methods are hurt by it:

- ``checkpoint`` recomputes a block's forward in backward, which would append to the cache a second
  time; transformers' own gradient checkpointing turns the cache off in training for that reason, even
  when the caller asked for it (with a warning).
- ``native_dynamo`` compiles the blocks' shared forward once per layer when each layer is handed its own
  cache entry (a guard per layer): 8 graphs, then dynamo's recompile limit, and later layers run eagerly.

Both turn the cache off only where it does harm, the training forwards: ``model.eval()`` and
``generate`` keep ``config.use_cache``, so a user's evaluation or sampling during training still runs
with its cache (setting ``config.use_cache = False`` for good, as this project's checkpoint method once
did, made every later ``generate`` recompute the whole prefix for each new token).

Which modules: those whose ``forward`` signature takes ``use_cache`` (the transformers convention, found
from the signature, not from class names).
"""
from __future__ import annotations

import inspect
import logging
import warnings
from dataclasses import dataclass, field
from typing import Optional

from torch import nn

logger = logging.getLogger(__name__)

POLICY_ATTR = "_atorch_train_without_kv_cache"


@dataclass
class _NoCacheInTraining:
    """The pre-hook of one module: ``position`` of ``use_cache`` among the forward's positional arguments;
    ``overriding`` names the methods under which an explicit ``use_cache=True`` is turned off in training
    (it would give wrong results), ``warning`` the methods that only warn (it is slow, not wrong)."""

    position: int
    overriding: dict[str, str] = field(default_factory=dict)  # method -> why the cache is turned off
    warning: dict[str, str] = field(default_factory=dict)  # method -> why the cache is slow
    warned: bool = False

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        if not module.training:
            return None
        said = args[self.position] if len(args) > self.position else kwargs.get("use_cache")
        if said is None:
            return _with_use_cache(args, kwargs, self.position, False)
        policies = self.overriding or self.warning
        if said and policies and not self.warned:
            self.warned = True
            method, why = next(iter(policies.items()))
            then = "it runs with use_cache=False" if self.overriding else "pass use_cache=False to train"
            warnings.warn(f"{type(module).__name__} is trained with use_cache=True under {method}: {why}; {then}",
                          stacklevel=2)
        if said and self.overriding:
            return _with_use_cache(args, kwargs, self.position, False)
        return None


def train_without_kv_cache(model: nn.Module, method: str, why: str, override_explicit: bool) -> int:
    """Training forwards of ``model``'s modules that take ``use_cache`` run with ``use_cache=False`` where the
    caller leaves it unsaid (absent or None). An explicit ``use_cache=True`` in training is turned off
    with a warning when ``override_explicit`` (the cache would make ``method`` wrong), else kept with a
    warning. ``why`` says, in the warning, what the cache does under ``method``. Calling it again (a
    second method) adds to the one hook a module has. Returns the number of modules hooked."""
    hooked = 0
    for module in model.modules():
        policy = getattr(module, POLICY_ATTR, None)
        if policy is None:
            position = use_cache_position(module)
            if position is None:
                continue
            policy = _NoCacheInTraining(position)
            module.register_forward_pre_hook(policy, with_kwargs=True)
            setattr(module, POLICY_ATTR, policy)
        (policy.overriding if override_explicit else policy.warning)[method] = why
        hooked += 1
    if hooked:
        logger.info("%s: training forwards of %d module(s) run with use_cache=False; evaluation keeps the model's "
                    "setting", method, hooked)
    return hooked


def use_cache_position(module: nn.Module) -> Optional[int]:
    """Where ``use_cache`` sits among ``module.forward``'s positional arguments, None if it takes none."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    names = [p.name for p in parameters]
    if "use_cache" not in names:
        return None
    return names.index("use_cache")


def _with_use_cache(args: tuple, kwargs: dict, position: int, value: bool) -> tuple[tuple, dict]:
    if len(args) > position:
        return args[:position] + (value,) + args[position + 1:], kwargs
    return args, {**kwargs, "use_cache": value}
