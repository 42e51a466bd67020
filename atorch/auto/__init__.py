"""auto_accelerate and the strategy language."""
from atorch.auto.accelerate import AutoAccelerateResult, auto_accelerate
from atorch.auto.strategy import Strategy

__all__ = ["auto_accelerate", "AutoAccelerateResult", "Strategy"]
