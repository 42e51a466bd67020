"""The search's cost formulas now live in ``atorch/cost_model.py``, shared with ``atorch.plan`` so the
two cannot drift apart; these names are re-exported for code that still imports them from here."""
from atorch.cost_model import (  # noqa: F401
    EXTRA_MICRO_BATCHES_IN_FLIGHT,
    MICRO_STEP_OVERHEAD,
    REPLICATED_ACTIVATION_SHARE,
    Estimate,
    estimate,
    estimate_layout_memory,
    estimate_layout_time,
)
