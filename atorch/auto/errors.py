"""Public alias of :mod:`atorch.errors` (the typed errors auto_accelerate raises)."""
from atorch.errors import *  # noqa: F401,F403
from atorch.errors import __all__  # noqa: F401
