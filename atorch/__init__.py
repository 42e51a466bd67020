"""atorch: a PyTorch auto-optimization strategy engine."""
from atorch import plan  # the package, callable as its function plan (atorch.plan.estimate reaches the package)
from atorch.auto.accelerate import auto_accelerate
from atorch.auto.gradients import clip_grad_norm_
from atorch.auto.strategy import Strategy
from atorch.checkpoint.api import load_checkpoint, save_checkpoint
from atorch.checkpoint.async_save import wait_for_checkpoint
from atorch.checkpoint.export import export_model
from atorch.checkpoint.pretrained import LoadResult, load_pretrained
from atorch.distributed.distributed import local_rank, rank, reset_distributed, world_size
from atorch.distributed.init import init_distributed
from atorch.plan import estimate

__version__ = "0.1.0"
__all__ = ["auto_accelerate", "save_checkpoint", "load_checkpoint", "wait_for_checkpoint", "export_model",
           "load_pretrained", "LoadResult", "clip_grad_norm_", "init_distributed", "rank", "local_rank", "world_size",
           "reset_distributed", "Strategy", "plan", "estimate", "__version__"]
