"""The planner's fitted constants, each with the published rows it was fitted on.

The analytic cost model (``analytic.py``) is first principles (FLOPs, bytes, link speeds) except for
the few numbers below, which no datasheet gives: how close each chip's matmuls come to their peak,
how narrow a matmul may be before it loses half its speed, how much slower attention runs than a
dense matmul. Each is fitted
on the rows of ``benchmarks/published_runs.json`` that name it (``role: calibration``, ``sets``), and
only on those: ``benchmarks/plan_vs_published.py --fit`` refits them and prints the values below,
``tests/search/test_plan_calibration.py`` checks that refitting on the named rows alone gives these values
and that no held-out row is named. The other rows are held out; the accuracy printed on them is the
planner's accuracy on runs it was not fitted to.

Kept as plain data (no code runs to load it) so a user, or a later fit, can change a value without
touching the formulas.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fitted:
    """A constant's value, the calibration rows it was fitted on (ids in published_runs.json), and
    the bounds the fit searches within (the physically sensible range)."""

    value: float
    rows: tuple[str, ...]
    low: float
    high: float
    doc: str = ""
    target: str = "throughput"   # what the rows' published figure it is fitted to: throughput or memory


FITTED: dict[str, Fitted] = {
    "ampere efficiency": Fitted(
        0.6811, ("lf A100-80GB 7b s2048 8gpu", "lf A100-80GB 13b s2048 8gpu", "atorch llama2-7b 8xA100 fsdp"),
        0.3, 0.95, "share of the bf16 peak that large dense matmuls reach on A100 (40 and 80 GB: one chip)"),
    "hopper efficiency": Fitted(
        0.5224, ("lf H100-80GB 7b s2048 8gpu", "lf H100-80GB 13b s2048 8gpu", "lf H100-80GB 30b s2048 8gpu"),
        0.2, 0.95, "the same on H100 SXM 700 W (and H200 / GH200, the same chip with other memory)"),
    "hopper 500W efficiency": Fitted(
        0.5602, ("titan llama3.1-8b 8xH100 fsdp",),
        0.2, 0.95, "the same on the power-capped 500 W H100 96 GB (torchtitan's Grand Teton parts)"),
    "blackwell efficiency": Fitted(
        0.6564, ("mbridge llama3-8b pretrain 8gpu b200 25.11",),
        0.2, 0.95, "the same on B200 SXM 1000 W (fitted on an fp8 run: the fp8 share above applies); attention on "
        "Blackwell takes Hopper's fitted share (analytic.attention_family)"),
    "blackwell 750W efficiency": Fitted(
        0.2881, ("torchao llama3.1-8b 8xB200-750W fsdp bf16+compile",),
        0.2, 0.95, "the same on the B200 power-capped to 750 W (torchao's benchmark parts)"),
    "fp8 efficiency": Fitted(
        0.9334, ("lf H100-80GB 3b s2048 8gpu fp8", "lf H100-80GB 1b s8192 8gpu fp8"),
        0.1, 1.0, "fp8 matmuls' share of the fp8 peak, relative to bf16 matmuls' share of theirs"),
    "matmul half width per ridge": Fitted(
        2.003, ("lf A100-80GB 760m s2048 8gpu", "lf A100-40GB 350m s2048 8gpu", "lf H100-80GB 760m s2048 8gpu",
              "lf A100-80GB 125m s2048 8gpu", "lf A100-40GB 125m s2048 8gpu"),
        0.0, 20.0, "the matmul width (2 k n / (k + n) of its shape on a tensor rank) at which matmuls run at "
        "half the chip's efficiency, "
        "over the chip's ridge point (peak FLOPs / HBM bytes per second)"),
    "ampere attention efficiency": Fitted(
        0.5967, ("lf A100-80GB 7b s32768 8gpu",),
        0.1, 1.5, "flash attention's share of the chip's dense-matmul efficiency on A100"),
    "hopper attention efficiency": Fitted(
        0.4448, ("lf H100-80GB 1b s32768 8gpu",),
        0.1, 1.5, "the same on Hopper parts (H100, H200, GH200)"),
    "selective activation share": Fitted(
        0.5122, ("titan llama3.1-8b 8xH100 fsdp",), 0.1, 1.0,
        "share of a block's activations selective checkpointing (torchtitan's op policy) keeps", "memory"),
}


def value(name: str) -> float:
    return FITTED[name].value


def calibration_rows() -> dict[str, str]:
    """{row id: the constant it sets}."""
    return {row: name for name, fitted in FITTED.items() for row in fitted.rows}
