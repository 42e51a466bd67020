"""The one small interface every optimization method implements, and the facts it declares."""
from __future__ import annotations

from typing import Any, ClassVar, Optional, Union

import torch

from atorch.auto.model_context import ModelContext
from atorch.utils.config import MethodConfig, validate_config

# the exclusive group of the methods that shard parameters with FSDP2 and of those that run a pipeline
# schedule: measured, pipeline 2 x data 2 with fsdp or zero2 left every weight unchanged after a step
SHARDED_STAGES = "sharded pipeline stages"
SHARDED_STAGES_WHY = ("a pipeline schedule runs each stage's backward itself, and fsdp / zero2 (FSDP2) do not "
                      "reduce the gradients of those backwards, so the stages would not train correctly (measured: "
                      "losses off the single-process run's from the second step); use zero1 or DDP beside a pipeline")


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

    # --- facts: read by the registry (the stage contract, the mesh check, the compatibility check,
    # the docs), never by other methods. Names are context attributes (``ModelContext``) and stages.
    stages: ClassVar[tuple[str, ...]] = ()
    """The stages (``atorch.auto.stages.STAGES``) at which what ``transform`` records runs: its
    wrappers, a data-parallel wrapper it claims (``data_parallel``), an optimizer factory it sets
    (``optimizer``)."""
    reads: ClassVar[Union[tuple[str, ...], dict[str, tuple[str, ...]]]] = ()
    """Context attributes what runs at those stages reads; a dict ``{stage: names}`` where the
    stages differ."""
    writes: ClassVar[Union[tuple[str, ...], dict[str, tuple[str, ...]]]] = ()
    """Context attributes what runs at those stages writes (``args``: ``result.args``); a dict
    ``{stage: names}`` where the stages differ."""
    record_writes: ClassVar[tuple[str, ...]] = ()
    """Context attributes ``transform`` itself sets when the strategy is recorded, before any stage
    runs, for wrappers of other stages to read."""
    mesh_dims: ClassVar[tuple[str, ...]] = ()
    """``parallel_mode`` dimensions the method works on: under several ranks a strategy naming it
    without them (size above 1) is refused rather than trained as plain data parallelism."""
    requires_one_of: ClassVar[tuple[str, ...]] = ()
    """Methods of which at least one must be in the same strategy."""
    excludes: ClassVar[dict[str, str]] = {}
    """Exclusive groups the method belongs to, ``{group: why}``: at most one method of a group may
    be in a strategy, and ``why`` is said when two are (members of a group give the same reason)."""
    provides_mesh: ClassVar[bool] = False
    """The method whose config is the device mesh (``parallel_mode``): added with its defaults under
    several ranks when a strategy has none; ``mesh_dims`` are checked against its config."""

    def facts_at(self, stage: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(reads, writes) declared for ``stage``; empty where the method does not act there."""
        if stage not in self.stages:
            return (), ()
        return tuple(_at(self.reads, stage)), tuple(_at(self.writes, stage))

    def precision(self, config: Any) -> Optional[torch.dtype]:
        """The low-precision dtype this method (with this normalized config) trains in, if any:
        methods asking for different ones cannot be combined."""
        return None

    def stores_weights_in(self, config: Any) -> Optional[torch.dtype]:
        """The dtype this method stores the parameters in where it casts them (``half``), else None:
        a method that needs fp32 parameters (``needs_fp32_weights``) cannot go beside it."""
        return None

    def needs_fp32_weights(self, config: Any) -> Optional[str]:
        """Why this method, with this config, needs the parameters kept in fp32 (amp_native fp16: its
        loss scaler unscales fp32 gradients only), or None."""
        return None

    def check_structure(self, config: Any) -> Any:
        """The config checked where the method is dropped (a single process): by default
        ``normalize``; a method whose config is fitted to the world size checks its form only."""
        return self.normalize(config)

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


def _at(declared: Union[tuple[str, ...], dict[str, tuple[str, ...]]], stage: str) -> tuple[str, ...]:
    return declared.get(stage, ()) if isinstance(declared, dict) else declared
