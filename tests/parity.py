"""Shared pieces of the parity tests: strategies, tolerances, and the per-rank suite runner."""
from __future__ import annotations

import torch
import torch.distributed as dist

from atorch.testing.training import relative_difference, train_gpt, weight_difference

FP32_TOL = 1e-5   # relative difference of losses and of all final weights, fp32
LOW_TOL = 2e-2    # the same with bf16 / fp16 anywhere in the strategy
BF16 = ("amp_native", {"dtype": torch.bfloat16})
CKPT = ("checkpoint", ("GPTBlock",))


def case_parts(case) -> tuple[list, dict]:
    """A case is a strategy, or {"strategy": [...], **train_gpt keyword arguments}."""
    if isinstance(case, dict):
        case = dict(case)
        return case.pop("strategy"), case
    return case, {}


def tolerance(strategy) -> float:
    names = [s if isinstance(s, str) else s[0] for s in strategy]
    return LOW_TOL if ("amp_native" in names or "half" in names) else FP32_TOL


def run_suite(cases: dict) -> dict:
    """On every rank: train each case; rank 0 keeps the weights. Errors are returned, not raised,
    so one bad case reports its message instead of ending the launch."""
    out = {}
    for key, case in cases.items():
        strategy, kwargs = case_parts(case)
        try:
            run = train_gpt(strategy, **kwargs)
        except Exception as error:  # an expected-error case
            out[key] = {"error": f"{type(error).__name__}: {error}"}
            continue
        keep_weights = not dist.is_initialized() or dist.get_rank() == 0
        out[key] = {
            "losses": run["losses"],
            "weights": run["weights"] if keep_weights else None,
            "strategy": run["strategy"],
            "grad_norms": run["grad_norms"],
            "state_bytes": run["state_bytes"],
        }
    return out


def assert_matches(run: dict, reference: dict, strategy, label: str) -> None:
    tol = tolerance(strategy)
    assert "error" not in run, f"{label}: {run.get('error')}"
    loss_diff = relative_difference(run["losses"], reference["losses"])
    assert loss_diff < tol, (f"{label}: losses differ by {loss_diff:.2e} (tolerance {tol})\n"
                             f"{run['losses']}\n{reference['losses']}")
    if run["weights"] is not None:
        weight_diff = weight_difference(run["weights"], reference["weights"])
        assert weight_diff < tol, f"{label}: final weights differ by {weight_diff:.2e} (tolerance {tol})"
    if run.get("grad_norms"):  # the norm the loop's clip_grad_norm_ returned each step, as one process's
        assert None not in run["grad_norms"], f"{label}: clip_grad_norm_ returned None: {run['grad_norms']}"
        norm_diff = relative_difference(run["grad_norms"], reference["grad_norms"])
        assert norm_diff < tol, (f"{label}: the returned gradient norms differ by {norm_diff:.2e} (tolerance {tol})"
                                 f"\n{run['grad_norms']}\n{reference['grad_norms']}")
