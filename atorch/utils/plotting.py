"""matplotlib, when installed (the ``.[plot]`` extra), set up to draw into files on a machine without
a display; plots are an extra, so their absence is logged, never raised."""
from __future__ import annotations

import logging
from typing import Any, Optional

logger = logging.getLogger(__name__)


def headless_pyplot(what: str) -> Optional[Any]:
    """``matplotlib.pyplot`` on the file-only Agg backend, or None (logged: no ``what``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib is not installed: no %s", what)
        return None
    return plt
