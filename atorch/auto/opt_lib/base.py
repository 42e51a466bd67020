"""The one small interface every optimization method implements."""
from __future__ import annotations

from typing import Any, ClassVar, Optional

from atorch.auto.model_context import ModelContext


class Optimization:
    """One method of a strategy (``amp_native``, ``fsdp``, ...).

    A method never reaches into another: ``transform`` records what it needs on the context (a
    wrapper at one of the canonical stages, or a setting such as the data-parallel wrapper), and the
    context applies everything in one order. Subclasses set the class attributes and override what
    they need.
    """

    name: ClassVar[str] = ""
    distributed_only: ClassVar[bool] = False  # dropped (with a log line) in a single process
    ignored_when_unavailable: ClassVar[bool] = False  # missing requirements: warn and skip instead of raising
    is_tunable: ClassVar[bool] = False  # whether finetune/search may change its config
    default_config: ClassVar[Any] = None

    def requirements(self, config: Any = None) -> Optional[str]:
        """Why this method (with this normalized config) cannot run here (missing package or
        hardware), or None when it can."""
        return None

    def normalize(self, config: Any) -> Any:
        """Validate ``config`` and return its canonical form; raise MethodConfigError when bad."""
        return self.default_config if config is None else config

    def transform(self, ctx: "ModelContext", config: Any) -> None:
        """Record this method's effect on ``ctx`` (config is already normalized)."""
        raise NotImplementedError(f"{type(self).__name__}.transform")

    def candidates(self, ctx: "ModelContext") -> list[Any]:
        """Configs the fully automatic search may try (the default config only, by default)."""
        return [self.default_config]
