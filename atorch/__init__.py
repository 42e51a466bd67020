"""atorch: a PyTorch auto-optimization strategy engine."""
from atorch.auto.accelerate import auto_accelerate
from atorch.auto.gradients import clip_grad_norm_
from atorch.auto.strategy import Strategy
from atorch.distributed.init import init_distributed

__version__ = "0.1.0"
__all__ = ["auto_accelerate", "clip_grad_norm_", "init_distributed", "Strategy", "__version__"]
