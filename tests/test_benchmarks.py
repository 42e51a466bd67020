"""The benchmarks that CI can run keep running: ``benchmarks/gpu.py --tiny`` trains every row of the
GPU benchmark on a tiny Llama on CPU and prints the table, the search report and the ratios; without
CUDA and without ``--tiny`` it skips with a message and exit status 0. No timing is asserted."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu.py"
ROWS = ("eager fp32", "eager bf16 autocast", "expert", "auto_accelerate")


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


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
