"""How much of each transformers family tensor_parallel splits, beyond the conformance zoo.

Each family is built from a tiny config of its own (4 layers, hidden 32, 4 query heads and 2 key /
value heads where the family has grouped heads; its own keys for the rest), one sample row of tokens
is traced, and the plan tensor_parallel would apply at tensor size 2 is compared with what a
Megatron-style scheme splits (``conformance.megatron_share``). No process group is needed: this reads
the plan, it does not train. The families are trained under tensor parallelism by the tests: as the
conformance rows ``family:<model_type>`` (``tests/methods/test_conformance.py``), and those that needed
new structure on 2 and 4 processes in ``tests/methods/test_model_parallel.py``. A family whose plan is
refused prints the typed reason. The configs are in ``atorch.testing.family_configs``.

``python -m atorch.testing.families`` prints the table (docs/model-parallel.md holds a copy).
"""
from __future__ import annotations

import argparse
from typing import Optional

import torch

from atorch.auto.opt_lib.tp_mha import split_mha
from atorch.auto.opt_lib.tp_plan import find_tp_plan, split_share
from atorch.errors import AtorchError
from atorch.testing.conformance import megatron_share
from atorch.testing.family_configs import COMMON, FAMILIES, build  # noqa: F401 (COMMON: read by the tests)
from atorch.testing.hf_models import token_dataset
from atorch.utils.batch import call_with_batch
from atorch.utils.dataflow import record_dataflow


def family_share(name: str, tp: int = 2) -> tuple[float, float]:
    """(atorch's split share, the Megatron-style share) of one family's tiny model."""
    torch.manual_seed(0)
    model = build(name)
    megatron = megatron_share(model)
    batch = torch.utils.data.default_collate([token_dataset(2, 0)[0]])
    split_mha(model)
    flow = record_dataflow(model, lambda m: call_with_batch(m, batch, "unpack_dict"))
    return split_share(model, find_tp_plan(model, tp, flow)), megatron


def table(names: Optional[list[str]] = None) -> str:
    rows = ["| family (transformers model_type) | atorch splits | Megatron-style splits | ratio |", "|---|---|---|---|"]
    for name in names or list(FAMILIES):
        try:
            ours, megatron = family_share(name)
            rows.append(f"| {name} | {ours:.1%} | {megatron:.1%} | {ours / megatron:.2f} |")
        except AtorchError as error:
            reason = str(error).split(": ", 1)[-1]
            rows.append(f"| {name} | refused: {reason if len(reason) <= 140 else reason[:137] + '...'} | | |")
    return "\n".join(rows) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="*", help=f"subset of {list(FAMILIES)}")
    print(table(parser.parse_args(argv).families), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
