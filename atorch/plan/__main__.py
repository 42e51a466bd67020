"""``python -m atorch.plan``: the planner's ranked table from the command line (see ``atorch.plan``), or
with ``--estimate`` the one configuration its layout options name (``atorch.estimate``)."""
from __future__ import annotations

import argparse
import inspect
import json
import sys
from typing import Any, Optional

from atorch.errors import AtorchError, InputError
from atorch.plan import GIB, configuration, estimate, model_spec, plan, plan_label, plot_plan
from atorch.plan.analytic import (
    expert_copies,
    expert_ranks_a_node,
    memory_breakdown,
    predict,
    spec_layout_facts,
    step_breakdown,
)
from atorch.plan.hardware_specs import DEVICES, cluster_spec
from atorch.plan.model_specs import BUILTIN_CONFIGS


def _three_numbers(text: str) -> tuple[float, float, float]:
    parts = text.split(",")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"{text!r}: give three comma-separated numbers, HIDDEN,FFN,KV")
    try:
        return tuple(float(part) for part in parts)  # type: ignore[return-value]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give three comma-separated numbers, HIDDEN,FFN,KV") from None


# estimate()'s options with a flag of their own (the rest through --set KEY=VALUE)
LAYOUT_FLAGS = {"tensor": int, "pipeline": int, "context": int, "virtual_stages": int, "sharding": str,
                "precision": str, "activation_checkpointing": str, "recompute_layers": int, "micro_batch_size": int,
                "expert": int}


def _estimate_options(args: argparse.Namespace) -> dict[str, Any]:
    """The layout flags given, the --set pairs (values read as JSON where they parse: true, 2, null; else
    as text), and the workload options the ranked table takes too; a key estimate() does not take is
    refused by name with the valid ones."""
    options = {name: getattr(args, name) for name in LAYOUT_FLAGS if getattr(args, name) is not None}
    options.update(attention_span=args.attention_span, elementwise_bytes=args.elementwise_bytes)
    valid = [name for name, p in inspect.signature(estimate).parameters.items()
             if p.kind is p.KEYWORD_ONLY and name not in ("global_batch", "seq_len")]  # flags of their own
    for pair in args.set:
        key, sep, text = pair.partition("=")
        if not sep or key not in valid:
            raise InputError(f"--set {pair!r} is not valid: give KEY=VALUE with KEY one of {sorted(valid)}")
        try:
            options[key] = json.loads(text)
        except ValueError:
            options[key] = text
    return options


def _print_estimate(args: argparse.Namespace, options: dict[str, Any], device: Optional[dict]) -> None:
    cluster = cluster_spec(args.cluster)
    if device:  # the user's own device on the cluster's nodes, as plan() takes it
        cluster = cluster_spec({"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node, "device": device})
    spec, cluster, candidate, work = configuration(model_spec(args.model), cluster, global_batch=args.global_batch,
                                                   seq_len=args.seq_len, **options)
    facts = spec_layout_facts(spec, cluster.world_size)
    pred = predict(candidate, spec, cluster, work, facts)  # what estimate() returns, its inputs kept
    t, p, c = options.get("tensor", 1), options.get("pipeline", 1), options.get("context", 1)
    named = ", ".join(f"{k}={v}" for k, v in options.items() if k not in ("tensor", "pipeline", "context")
                      and v is not None)
    print(f"model {spec.name}: {spec.param_count / 1e9:.2f} B parameters; cluster {cluster.label} "
          f"({cluster.device.memory_bytes / GIB:.1f} GiB per GPU); global batch {args.global_batch} x "
          f"{args.seq_len} tokens")
    print(f"configuration: tensor {t} x pipeline {p} x context {c} x data {cluster.world_size // (t * p * c)}"
          + (f"; {named}" if named else ""))
    print(f"memory: {pred.memory_bytes / GIB:.1f} GiB per GPU reserved ({pred.allocated_bytes / GIB:.1f} allocated)"
          f" -> {'fits' if pred.fits else 'does NOT fit'}"
          + "".join(f" ({note})" for note in pred.notes if note.startswith("tight:")))
    for name, size in memory_breakdown(candidate, spec, cluster, work, facts).items():
        print(f"  {name:<62} {size / GIB:7.1f} GiB")
    print(f"step: {pred.step_time_s:.3f} s (compute {pred.compute_s:.3f} s, communication {pred.comm_s:.3f} s "
          f"before overlap); {pred.tokens_per_s_per_gpu:.0f} tokens/s per GPU, MFU {pred.mfu * 100:.1f}%"
          + "".join(f" ({note})" for note in pred.notes if not note.startswith("tight:")))
    _print_breakdown("where the step goes", step_breakdown(candidate, spec, cluster, work, facts))
    if work.expert > 1:
        nvlink, network = expert_copies(spec, work, expert_ranks_a_node(candidate, cluster, work))
        print(f"expert dispatch {work.expert_dispatch}: {network:.2f} copies of a token through the network and "
              f"{nvlink:.2f} over NVLink, each pass of each routed layer")


def _print_breakdown(heading: str, parts: dict[str, float]) -> None:
    print(f"{heading} (one GPU, seconds):")
    for name, seconds in parts.items():
        print(f"  {name:<42} {seconds:9.3f}")


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
    parser.add_argument("--estimate", action="store_true",
                        help="predict the one configuration the options below name (atorch.estimate) instead of "
                             "ranking the candidates")
    for name, kind in LAYOUT_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind, help=f"with --estimate: estimate()'s {name}")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="with --estimate: any other estimate() option, VALUE as JSON (true, 2, null) or text "
                             "(--set rank_order=tensor-data-pipeline --set tp_comm_overlap=true)")
    args = parser.parse_args(argv)
    given = [name for name in LAYOUT_FLAGS if getattr(args, name) is not None] + (["set"] if args.set else [])
    if given and not args.estimate:
        parser.error(f"--{given[0].replace('_', '-')} names one configuration: add --estimate (the ranked table "
                     "searches the layouts itself)")
    try:
        device = json.loads(open(args.device).read()) if args.device else None
        if args.estimate:
            _print_estimate(args, _estimate_options(args), device)
            return 0
        result = plan(args.model, args.cluster, args.global_batch, args.seq_len, args.exclude, device=device,
                      attention_span=args.attention_span, elementwise_bytes=args.elementwise_bytes)
    except (AtorchError, OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(result.table(args.top or None))
    top = result.applicable  # the plan the table's "top plan (load_strategy)" line names
    if top is not None:
        _print_breakdown(f"where the top plan's step goes ({plan_label(top)})", result.breakdown(top))
    if args.plot:
        print(f"plot: {plot_plan(result, args.plot) or 'not written (matplotlib is not installed)'}")
    if args.strategy_out and result.strategy is not None:
        result.strategy.save(args.strategy_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
