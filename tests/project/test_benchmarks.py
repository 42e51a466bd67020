"""Every benchmark keeps running: each runs here in its smallest mode (``--tiny``: a tiny model, one
round of one step; seconds each) and must exit 0 and print its table. ``benchmarks/gpu.py --tiny``
trains every row of the GPU benchmark on a tiny Llama on CPU and prints the table, the search report
and the ratios; without CUDA and without ``--tiny`` it skips with a message and exit status 0. Every
script in benchmarks/ must be listed here, and in ``make bench``. No timing is asserted."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu.py"
ROWS = ("eager fp32", "eager bf16 autocast", "expert", "auto_accelerate")


# script: (its smallest mode's arguments, text its output must hold)
SMALLEST = {
    "overhead.py": (["--tiny"], "step-time ratio auto_accelerate / hand-written"),
    "memory.py": (["--tiny"], "fsdp + checkpoint"),
    "compute.py": (["--tiny"], "module_replace, HF GPT-2 eager, fp32"),
    "model_parallel.py": (["--tiny"], "TP2 x PP2"),
    "search_quality.py": (["--tiny"], "memory-limited (repo GPT"),
    "checkpoint.py": (["--tiny"], "asynchronous save: training blocked"),
    "host_memory.py": (["--tiny"], "atorch / pytorch recipe: "),
    "plan_vs_published.py": ([], "calibrated constants"),
    "elementwise_traffic.py": (["--tiny"], "measured / predicted"),
    "compiled_activations.py": (["--tiny"], "compiled / eager"),
    "compiled_loss.py": (["--tiny"], "compiled / eager"),
    "gpu.py": (["--tiny"], "auto / expert = "),  # checked further below
}


def run_script(*args: str, script: Path = SCRIPT) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(script), *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=env)


def test_every_benchmark_is_smoke_tested_and_run_by_make_bench():
    # a leading underscore marks a helper module the scripts import, not a script
    scripts = {path.name for path in (ROOT / "benchmarks").glob("*.py") if not path.name.startswith("_")}
    assert scripts == set(SMALLEST), f"benchmarks without a smoke test here: {sorted(scripts - set(SMALLEST))}"
    bench = (ROOT / "Makefile").read_text().split("\nbench:", 1)[1].split("\n\n", 1)[0]
    assert all(f"benchmarks/{name}" in bench for name in scripts), bench


@pytest.fixture(scope="module")
def smallest_runs() -> dict[str, subprocess.CompletedProcess]:
    """Every benchmark's smallest mode, two at a time: most run in one process, which keeps one of CI's
    two cores busy, so running them in pairs halves their wall time without changing what they run."""
    names = sorted(set(SMALLEST) - {"gpu.py"})
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = pool.map(lambda name: run_script(*SMALLEST[name][0], script=ROOT / "benchmarks" / name), names)
        return dict(zip(names, runs))


@pytest.mark.multirank
@pytest.mark.parametrize("name", sorted(set(SMALLEST) - {"gpu.py"}))
def test_a_benchmark_runs_in_its_smallest_mode(name, smallest_runs):
    if name in ("compute.py", "search_quality.py"):
        pytest.importorskip("transformers")  # their HF GPT-2 rows
    done = smallest_runs[name]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert SMALLEST[name][1] in done.stdout, done.stdout


def test_gpu_benchmark_tiny_prints_table_and_ratios(tmp_path):
    pytest.importorskip("transformers")
    done = run_script("--tiny", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    for row in ROWS:
        assert f"\n{row} " in done.stdout, done.stdout
    assert "auto / expert = " in done.stdout and "auto / eager fp32 = " in done.stdout
    assert "dry run(s)" in done.stdout and "out of memory" in done.stdout
    record = json.loads(next(tmp_path.glob("gpu-tiny-cpu-*.json")).read_text())
    assert [row["name"] for row in record["rows"]] == list(ROWS)
    assert record["search"]["dry_runs"] >= 1 and record["search"]["runs"][0]["predicted_mib"] > 0
    assert {"device", "torch", "date", "ratios"} <= set(record)
    assert next(tmp_path.glob("gpu-tiny-cpu-*.md")).read_text().startswith("# benchmarks/gpu.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the script would run the full benchmark")
def test_gpu_benchmark_without_cuda_skips_with_exit_0():
    done = run_script()
    assert done.returncode == 0, done.stderr
    assert "skipped, no CUDA device" in done.stdout
