"""The one small interface every optimization method implements."""
from __future__ import annotations

from typing import Any, ClassVar, Optional

from atorch.auto.model_context import ModelContext
from atorch.utils.config import MethodConfig, validate_config


class Optimization:
    """One method of a strategy (``amp_native``, ``fsdp``, ...).

    A method never reaches into another: ``transform`` records what it needs on the context (a
    wrapper at one of the canonical stages, or a setting such as the data-parallel wrapper), and the
    context applies everything in one order. Subclasses set the class attributes and override what
    they need.
    """

    name: ClassVar[str] = ""
    """How strategies name the method; the registry key."""
    config_class: ClassVar[Optional[type[MethodConfig]]] = None
    """The frozen dataclass ``normalize`` returns; ``config_class()`` is the default config. A user's
    method may leave it None: its configs are then passed to ``transform`` unchanged."""
    distributed_only: ClassVar[bool] = False
    """Dropped (with a log line) in a single process, where it has nothing to do."""
    ignored_when_unavailable: ClassVar[bool] = False
    """When ``requirements`` says no: warn and skip the method instead of raising."""

    def requirements(self, config: Any = None) -> Optional[str]:
        """Why this method (with this normalized config) cannot run here (missing package or
        hardware), or None when it can: checked before anything is applied, so a strategy fails
        up front with the reason."""
        return None

    def normalize(self, config: Any) -> Any:
        """The config in its one canonical form (a ``config_class`` instance), from None (defaults),
        a dict or an instance; raise MethodConfigError when bad. Called once when a strategy is
        resolved, so transforms, compatibility checks and saved strategies all see the same value.
        Methods with short forms (a dtype, a tuple of modules) turn them into the dict first."""
        if self.config_class is None:
            return config
        return validate_config(self.name, self.config_class, {} if config is None else config)

    def transform(self, ctx: "ModelContext", config: Any) -> None:
        """Record this method's effect on ``ctx`` (config is already normalized): wrappers at the
        canonical stages, applied later in one order so methods compose without knowing each other."""
        raise NotImplementedError(f"{type(self).__name__}.transform")
