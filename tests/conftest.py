"""The unit / multi-process split holds: a test that launches processes must be marked ``multirank``.

``pytest -m "not multirank"`` (``make test-unit``) is then the fast single-process suite, and
``make test-multirank`` the rest. A test without the marker that starts ranks (through
``atorch.testing.launcher`` or ``torch.multiprocessing``) or starts torchrun fails here, naming the
marker, instead of silently landing in the wrong half.
"""
from __future__ import annotations

import subprocess

import pytest
import torch.multiprocessing

LAUNCHERS = ("torch.distributed.run", "torchrun")


@pytest.fixture(autouse=True)
def _multi_process_launches_need_the_marker(request, monkeypatch):
    if request.node.get_closest_marker("multirank") is not None:
        return

    def refuse(what: str) -> None:
        pytest.fail(f"{request.node.nodeid} {what} but is not marked multirank: add @pytest.mark.multirank "
                    "(or a module-level pytestmark) so the unit / multi-process split stays true")

    real_get_context, real_popen_init = torch.multiprocessing.get_context, subprocess.Popen.__init__

    def get_context(method=None):
        if method in ("spawn", "forkserver"):
            refuse("starts ranks")
        return real_get_context(method)

    def popen_init(self, args, *rest, **kwargs):  # the class itself stays subprocess.Popen (picklable)
        words = [args] if isinstance(args, (str, bytes)) else [str(a) for a in args]
        if any(launcher in str(word) for word in words for launcher in LAUNCHERS):
            refuse("starts torchrun")
        real_popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(torch.multiprocessing, "get_context", get_context)
    monkeypatch.setattr(subprocess.Popen, "__init__", popen_init)
