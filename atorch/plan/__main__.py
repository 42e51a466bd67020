"""``python -m atorch.plan``: the planner's ranked table from the command line (see ``atorch.plan``)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from atorch.errors import AtorchError
from atorch.plan import plan, plot_plan
from atorch.plan.hardware_specs import DEVICES
from atorch.plan.model_specs import BUILTIN_CONFIGS


def _three_numbers(text: str) -> tuple[float, float, float]:
    parts = text.split(",")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"{text!r}: give three comma-separated numbers, HIDDEN,FFN,KV")
    try:
        return tuple(float(part) for part in parts)  # type: ignore[return-value]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give three comma-separated numbers, HIDDEN,FFN,KV") from None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m atorch.plan", description=__doc__)
    parser.add_argument("--model", required=True,
                        help=f"a transformers config.json (file or directory) or one of {sorted(BUILTIN_CONFIGS)}")
    parser.add_argument("--cluster", required=True,
                        help=f"GPUSxDEVICE or NODESxGPUSxDEVICE (devices: {sorted(DEVICES)}), or a JSON file")
    parser.add_argument("--device", help="a JSON file with your own device's numbers (DeviceSpec fields)")
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    parser.add_argument("--exclude", nargs="*", default=[], help="method names to leave out")
    parser.add_argument("--attention-span", type=int,
                        help="packed documents: the document length a token sits in, averaged over the tokens")
    parser.add_argument("--elementwise-bytes", type=_three_numbers, metavar="HIDDEN,FFN,KV",
                        help="the block's memory-bound bytes per token and element of the hidden size, the MLP's "
                             "width and the key / value width (atorch.plan.elementwise.elementwise_bytes)")
    parser.add_argument("--top", type=int, default=20, help="rows to print (0: all)")
    parser.add_argument("--plot", help="write a PNG of the candidates here (needs matplotlib)")
    parser.add_argument("--strategy-out", help="write the top plan's strategy (JSON) here")
    args = parser.parse_args(argv)
    try:
        device = json.loads(open(args.device).read()) if args.device else None
        result = plan(args.model, args.cluster, args.global_batch, args.seq_len, args.exclude, device=device,
                      attention_span=args.attention_span, elementwise_bytes=args.elementwise_bytes)
    except (AtorchError, OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(result.table(args.top or None))
    if args.plot:
        print(f"plot: {plot_plan(result, args.plot) or 'not written (matplotlib is not installed)'}")
    if args.strategy_out and result.strategy is not None:
        result.strategy.save(args.strategy_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
