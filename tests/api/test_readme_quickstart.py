"""The README's quickstart runs as written: its first ```python block, in a fresh plain process."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def first_python_block(text: str) -> str:
    match = re.search(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert match, "README.md has no ```python block"
    return match.group(1)


def test_readme_is_short():
    assert len(README.read_bytes()) < 8192, "README.md must stay under 8 KB: move detail to docs/"


def test_quickstart_runs_as_written(tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(first_python_block(README.read_text()))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}  # one plain process
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["CUDA_VISIBLE_DEVICES"] = ""  # as the README says: on a CPU
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, f"the README quickstart failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    losses = [float(x) for x in re.findall(r"epoch \d+: loss ([0-9.]+)", done.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], f"the quickstart's loss did not fall:\n{done.stdout}"
    assert "Strategy:" in done.stdout
