"""Typed errors: every bad input names the bad key or value and the valid choices."""
from __future__ import annotations

import difflib
from typing import Iterable, Optional


def nearest_name(name: object, valid: Iterable[str]) -> Optional[str]:
    """The valid name closest to a misspelt one, or None: the one "did you mean" rule that every
    unknown-name message (methods, config keys, keyword arguments) uses."""
    close = difflib.get_close_matches(str(name), list(valid), n=1, cutoff=0.5)
    return close[0] if close else None


class AtorchError(Exception):
    """Base of every error atorch raises on purpose."""


class StrategyError(AtorchError, ValueError):
    """A strategy (or one of its items) is malformed."""


class UnknownMethodError(StrategyError, KeyError):
    """A strategy names a method the registry does not know."""

    def __init__(self, name: str, valid: Iterable[str]):
        valid = sorted(valid)
        close = nearest_name(name, valid)
        hint = f" Did you mean {close!r}?" if close else ""
        self.name, self.valid, self.suggestion = name, valid, close
        super().__init__(f"unknown optimization method {name!r}.{hint} Valid methods: {', '.join(valid)}")

    def __str__(self) -> str:  # KeyError would otherwise quote the whole message
        return self.args[0]


class MethodConfigError(StrategyError):
    """A method's config has a bad key, type or value."""

    def __init__(self, method: str, message: str):
        self.method = method
        super().__init__(f"{method}: {message}")


class IncompatibleMethodsError(StrategyError):
    """Two methods (or configs) in one strategy cannot be combined."""


class ParallelModeError(StrategyError):
    """parallel_mode sizes do not fit the world size, or name an unknown dimension."""


class StrategyFileError(StrategyError):
    """A strategy file or blob cannot be read (unknown format, or unsafe pickle content)."""


class UnsafeStrategyError(StrategyFileError):
    """A pickled strategy would import or call something beyond plain strategy data."""


class InputError(AtorchError, ValueError):
    """auto_accelerate was given arguments that cannot run together."""


class MetaModelError(InputError):
    """A model built on the meta device has a part atorch cannot initialise (no initialiser, or one
    that leaves a tensor unset); ``module`` names it."""

    def __init__(self, message: str, module: Optional[str] = None):
        self.module = module
        super().__init__(message)


class RequirementError(AtorchError, RuntimeError):
    """A method's optional dependency or hardware is missing."""


class DryRunError(AtorchError, RuntimeError):
    """A dry run of a strategy failed on at least one rank."""


class UnsupportedAttentionError(AtorchError, ValueError):
    """atorch's attention was asked for something it does not compute (attention weights, or a term
    added to the scores such as a position bias, a soft cap or sink logits)."""


class ExpertBankCallError(AtorchError, ValueError):
    """An expert bank that tensor_parallel split by expert was called in a way the split cannot serve
    (a grouped bank whose second input is not one integer count per expert)."""


def check_choice(method: str, key: str, value: object, choices: Iterable[object]) -> None:
    """Raise MethodConfigError unless ``value`` is one of ``choices``."""
    choices = list(choices)
    if value not in choices:
        raise MethodConfigError(method, f"{key}={value!r} is not valid; choose one of {choices}")


__all__ = [
    "AtorchError", "StrategyError", "UnknownMethodError", "MethodConfigError", "IncompatibleMethodsError",
    "ParallelModeError", "StrategyFileError", "UnsafeStrategyError", "InputError", "RequirementError",
    "DryRunError", "UnsupportedAttentionError", "ExpertBankCallError", "check_choice", "nearest_name",
]


class RankLostError(AtorchError, RuntimeError):
    """A rank stopped answering (killed, or hung outside atorch) while the others waited for it."""

    def __init__(self, message: str, lost_ranks: Iterable[int] = ()):
        self.lost_ranks = list(lost_ranks)
        super().__init__(message)


__all__.append("RankLostError")


class PeerRankError(AtorchError, RuntimeError):
    """Work that every rank does together (applying a strategy) failed on another rank; this rank
    stopped too, with that rank's reason, instead of waiting for it inside a collective."""

    def __init__(self, message: str, failed_rank: Optional[int] = None):
        self.failed_rank = failed_rank
        super().__init__(message)


__all__.append("PeerRankError")


class CheckpointError(AtorchError, RuntimeError):
    """A checkpoint cannot be saved or loaded: a bad path or argument, an incomplete or foreign
    directory, or state that does not match the model (the message names the key)."""

    def __init__(self, message: str, key: Optional[str] = None):
        self.key = key
        super().__init__(message)


class ShardedStateError(CheckpointError):
    """``state_dict()`` / ``load_state_dict()`` called where the strategy shards or partitions the
    state, so the result would be partial or index-keyed shards: use atorch.save_checkpoint /
    atorch.load_checkpoint (or atorch.export_model for the weights)."""


__all__ += ["CheckpointError", "ShardedStateError"]


class LoopError(AtorchError, RuntimeError):
    """The training loop used the returned optimizer in a way its strategy cannot serve (a step after
    ``loss.backward()`` where the strategy scales the loss in ``optim.backward``); the message names
    the call to make instead. Raised at that step, before any parameter changes."""


__all__.append("LoopError")
