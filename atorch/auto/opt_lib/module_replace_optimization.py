"""The seed's import path for ``register_replace_pair`` (the method lives in ``module_replace.py``)."""
from atorch.auto.opt_lib.module_replace import ReplacePair, register_replace_pair, registered_pairs

__all__ = ["ReplacePair", "register_replace_pair", "registered_pairs"]
