"""The planner's predictions against published training runs: throughput and memory, row by row.

Every row below is a published measurement with its source (repository, file and commit) and the
configuration it was run with. ``role`` says whether a row was used to set a constant of the cost
model (``calibration``: which constant is named) or only tests it (``test``). The script prints
published, predicted and their ratio for each row, then the worst held-out ratios; it asserts
nothing (goal: throughput within 20 %, memory within 15 % on the test rows).

    .venv/bin/python benchmarks/plan_vs_published.py
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atorch.auto.search.analytic import Workload, predict, spec_layout_facts  # noqa: E402
from atorch.auto.search.candidates import Candidate  # noqa: E402
from atorch.auto.search.hardware_specs import DEVICES, ClusterSpec  # noqa: E402
from atorch.auto.search.model_specs import model_spec  # noqa: E402

GIB, MIB = 2**30, 2**20
TORCHTITAN_A100 = ("pytorch/torchtitan docs/performance.md @ 041336434916bdc0f88c1f89fda176fd3c2092e4 "
                   "(Llama 3 on 64 A100-80GB, FSDP2, bf16, local batch 1 or 2)")
TORCHTITAN_H100 = ("pytorch/torchtitan docs/performance.md @ eaea6f6a2fa940f03a10906be1df3489cf30af85 "
                   "(Table 1 / Table 3: Llama 3.1 8B, FSDP2, bf16, local batch 2, selective AC; memory = max reserved)")
ATORCH_A100 = ("intelligent-machine-learning/dlrover atorch/examples/llama2/README.md @ "
               "11bf2fbfa2e9625073a4bcb6d2dea3c5e0ce1d44 (Llama2-7B FSDP, no LoRA, 4 x 4096 tokens per GPU, "
               "bf16 amp, gradient checkpointing, 8 A100-80GB per node, 800 Gb/s RDMA per node; "
               "TFLOPs per GPU converted to tokens/s with the planner's FLOPs per token incl. recompute; "
               "memory = max allocated)")


@dataclass(frozen=True)
class Published:
    name: str
    source: str
    model: str
    device: str
    nodes: int
    gpus_per_node: int
    local_batch: int
    seq_len: int
    checkpointing: str                    # none / selective / full
    tokens_per_s: Optional[float] = None  # per GPU
    mfu: Optional[float] = None
    memory_gib: Optional[float] = None
    tflops: Optional[float] = None        # per GPU, when that is what was published
    network_bytes_per_s: Optional[float] = None  # per GPU, when the source says
    logit_bytes: Optional[int] = None     # per logit through the loss, when the code differs from the default
    fp32_residual: Optional[bool] = None  # autocast over fp32 weights (FSDP1 without a mixed-precision policy)
    role: str = "test"                    # or "calibration: <constant>"
    note: str = ""


# ATorch's fsdp_llama2.py (same commit family): FSDP1 with amp_native (autocast, no FSDP mixed-precision
# policy: fp32 residual stream) and module_replace (flash attention); transformers of the peft 0.4.0 era
# computes the loss on logits.float() after a shifted .contiguous() copy: 2 + 4 + 4 + 4 (log-softmax)
# + 4 (its gradient) bytes per logit.
_ATORCH_RUN = {"network_bytes_per_s": 12.5e9, "logit_bytes": 18, "fp32_residual": True}

ROWS = [
    Published("titan llama3-8b 64xA100 sel-layer", TORCHTITAN_A100, "llama3-8b", "A100-80GB", 8, 8, 1, 8192,
              "selective", tokens_per_s=2904, mfu=0.568, note="selective per layer: every 2nd block fully recomputed"),
    Published("titan llama3-8b 64xA100 sel-op", TORCHTITAN_A100, "llama3-8b", "A100-80GB", 8, 8, 1, 8192,
              "selective", tokens_per_s=2973, mfu=0.582),
    Published("titan llama3-70b 64xA100 full", TORCHTITAN_A100, "llama3-70b", "A100-80GB", 8, 8, 1, 8192,
              "full", tokens_per_s=331, mfu=0.517),
    Published("titan llama2-13b 64xA100 none", TORCHTITAN_A100, "llama2-13b", "A100-80GB", 8, 8, 2, 4096,
              "none", tokens_per_s=2162, mfu=0.611),
    Published("titan llama2-13b 64xA100 sel-op", TORCHTITAN_A100, "llama2-13b", "A100-80GB", 8, 8, 2, 4096,
              "selective", tokens_per_s=1904, mfu=0.538),
    Published("titan llama2-70b 64xA100 full", TORCHTITAN_A100, "llama2-70b", "A100-80GB", 8, 8, 2, 4096,
              "full", tokens_per_s=353, mfu=0.505),
    Published("titan llama3.1-8b 8xH100 fsdp", TORCHTITAN_H100, "llama3.1-8b", "H100-96GB", 1, 8, 2, 8192,
              "selective", tokens_per_s=5762, memory_gib=82.4,
              role="calibration: H100 efficiency, SELECTIVE_ACTIVATION_SHARE"),
    Published("titan llama3.1-8b 128xH100 fsdp", TORCHTITAN_H100, "llama3.1-8b", "H100-96GB", 16, 8, 2, 8192,
              "selective", tokens_per_s=5605, memory_gib=67.0),
    Published("titan llama3.1-8b 8xH100 fsdp+compile", TORCHTITAN_H100, "llama3.1-8b", "H100-96GB", 1, 8, 2, 8192,
              "selective", tokens_per_s=6667, memory_gib=77.0, note="torch.compile: not modelled"),
    Published("titan llama3.1-8b 128xH100 fsdp+compile", TORCHTITAN_H100, "llama3.1-8b", "H100-96GB", 16, 8, 2,
              8192, "selective", tokens_per_s=6514, memory_gib=62.0, note="torch.compile: not modelled"),
    Published("atorch llama2-7b 8xA100 fsdp", ATORCH_A100, "llama2-7b", "A100-80GB", 1, 8, 4, 4096, "full",
              tflops=204.67, memory_gib=39596.3 * MIB / GIB, **_ATORCH_RUN,
              role="calibration: A100 efficiency"),
    Published("atorch llama2-7b 16xA100 fsdp", ATORCH_A100, "llama2-7b", "A100-80GB", 2, 8, 4, 4096, "full",
              tflops=197.22, memory_gib=34776.7 * MIB / GIB, **_ATORCH_RUN),
    Published("atorch llama2-7b 32xA100 fsdp", ATORCH_A100, "llama2-7b", "A100-80GB", 4, 8, 4, 4096, "full",
              tflops=196.04, memory_gib=32366.8 * MIB / GIB, **_ATORCH_RUN),
    Published("atorch llama2-7b 64xA100 fsdp", ATORCH_A100, "llama2-7b", "A100-80GB", 8, 8, 4, 4096, "full",
              tflops=195.14, memory_gib=31161.9 * MIB / GIB, **_ATORCH_RUN),
]


def hardware_flops_per_token(row: Published) -> float:
    spec = model_spec(row.model)
    flops = spec.model_flops_per_token(row.seq_len)
    return flops + (spec.recompute_flops_per_token(row.seq_len) if row.checkpointing == "full" else 0.0)


def published_tokens(row: Published) -> float:
    return row.tokens_per_s if row.tokens_per_s is not None else row.tflops * 1e12 / hardware_flops_per_token(row)


def prediction(row: Published):
    spec = model_spec(row.model)
    device = DEVICES[row.device]
    if row.network_bytes_per_s:
        device = dataclasses.replace(device, network_bytes_per_s=row.network_bytes_per_s)
    cluster = ClusterSpec(row.nodes, row.gpus_per_node, device)
    world = cluster.world_size
    candidate = Candidate("fsdp", "amp_bf16", row.checkpointing != "none", block=spec.block)
    extra = {k: v for k, v in (("logit_bytes", row.logit_bytes), ("fp32_residual", row.fp32_residual)) if v is not None}
    work = Workload(row.local_batch * world, row.seq_len, row.checkpointing, **extra)
    return predict(candidate, spec, cluster, work, spec_layout_facts(spec, world))


def main() -> None:
    header = (f"{'row':<42}{'role':<13}{'tok/s pub':>10}{'pred':>8}{'ratio':>7}{'mem pub':>9}{'pred':>7}{'ratio':>7}"
              f"{'MFU pred':>9}")
    print(header)
    print("-" * len(header))
    held_out = {"throughput": [], "memory": []}
    for row in ROWS:
        p = prediction(row)
        tokens = published_tokens(row)
        t_ratio = p.tokens_per_s_per_gpu / tokens
        mem = p.memory_bytes / GIB
        m_ratio = mem / row.memory_gib if row.memory_gib else None
        role = "calibration" if row.role.startswith("calibration") else "test"
        print(f"{row.name:<42}{role:<13}{tokens:>10.0f}{p.tokens_per_s_per_gpu:>8.0f}{t_ratio:>7.2f}"
              + (f"{row.memory_gib:>9.1f}{mem:>7.1f}{m_ratio:>7.2f}" if m_ratio else f"{'':>9}{mem:>7.1f}{'':>7}")
              + f"{p.mfu * 100:>8.1f}%" + (f"  ({row.note})" if row.note else ""))
        if role == "test" and "not modelled" not in row.note:
            held_out["throughput"].append(t_ratio)
            if m_ratio:
                held_out["memory"].append(m_ratio)
    print()
    for kind, goal in (("throughput", 0.20), ("memory", 0.15)):
        ratios = held_out[kind]
        worst = max(ratios, key=lambda r: abs(r - 1)) if ratios else float("nan")
        inside = sum(abs(r - 1) <= goal for r in ratios)
        print(f"held-out {kind}: {len(ratios)} rows, {inside} within +-{goal:.0%}, worst ratio {worst:.2f}")
    print("\nsources:")
    for source in dict.fromkeys(r.source for r in ROWS):
        print(f"- {source}")
    print("calibrated constants: " + "; ".join(f"{r.name} -> {r.role.split(': ', 1)[1]}" for r in ROWS
                                                if r.role.startswith("calibration")))


if __name__ == "__main__":
    main()
