"""The stage tables of docs/architecture.md, from the facts the registered methods declare.

    python docs/gen_architecture_tables.py            # refresh the tables in docs/architecture.md
    python docs/gen_architecture_tables.py --stdout   # print them
    python docs/gen_architecture_tables.py --file F   # refresh the tables in F

In the Markdown file, the text between a line ``<!-- table:NAME -->`` and a line
``<!-- /table:NAME -->`` is replaced by table NAME (``stages``, ``record-time``, ``facts``); everything
else is left as it is. The tables come from ``atorch.auto.opt_lib.stage_contract()`` and
``record_time_facts()``, assembled from each method's declarations (``opt_lib/base.py``) and the
context's own work per stage (``atorch/auto/stages.py``), so they cannot drift.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a checkout without installing atorch
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared marker helper beside this file

import markers  # noqa: E402

from atorch.auto.opt_lib import BUILTIN_METHODS, Optimization, record_time_facts, stage_contract  # noqa: E402

MARKERS = markers.marker_pattern("table")


def _code(names) -> str:
    return ", ".join(f"`{name}`" for name in names) or "-"


def stages_table() -> str:
    lines = ["| stage | methods | reads | writes |", "| --- | --- | --- | --- |"]
    lines += [f"| `{row.stage}` | {', '.join(row.methods)} | {_code(row.reads)} | {_code(row.writes)} |"
              for row in stage_contract()]
    return "\n".join(lines) + "\n"


def record_time_table() -> str:
    lines = ["| fact | written by the `transform` of |", "| --- | --- |"]
    lines += [f"| `{fact}` | {', '.join(writers)} |" for fact, writers in record_time_facts().items()]
    return "\n".join(lines) + "\n"


def facts_table() -> str:
    """Per built-in method, the facts the registry derives its checks from."""
    lines = ["| method | stages | mesh dimensions | needs one of | exclusive groups | precision | parameters |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for method in BUILTIN_METHODS:
        groups = ", ".join(method.excludes) or "-"
        precision = "its `dtype`" if method.precision is not Optimization.precision else "-"
        lines.append(f"| `{method.name}` | {_code(method.stages)} | {_code(method.mesh_dims)} | "
                     f"{_code(method.requires_one_of)} | {groups} | {precision} | {_parameters_fact(method)} |")
    return "\n".join(lines) + "\n"


def _parameters_fact(method: type[Optimization]) -> str:
    """What the method declares about the parameters' dtype (``stores_weights_in``, ``needs_fp32_weights``)."""
    facts = []
    if method.stores_weights_in is not Optimization.stores_weights_in:
        facts.append("stored in its `dtype`")
    if method.needs_fp32_weights is not Optimization.needs_fp32_weights:
        facts.append("needs fp32 (by config)")
    return ", ".join(facts) or "-"


def all_tables() -> dict[str, str]:
    return {"stages": stages_table(), "record-time": record_time_table(), "facts": facts_table()}


def rewrite(text: str, tables: dict[str, str]) -> tuple[str, list[str], list[str]]:
    """(new text, tables written, marker names that are no table)."""
    return markers.rewrite(text, tables, MARKERS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", type=Path, default=ROOT / "docs" / "architecture.md",
                        help="Markdown file with markers")
    parser.add_argument("--stdout", action="store_true", help="print the tables instead of rewriting a file")
    args = parser.parse_args(argv)
    tables = all_tables()
    if args.stdout:
        for name, table in tables.items():
            print(f"### {name}\n\n{table}")
        return 0
    text, written, unknown = rewrite(args.file.read_text(), tables)
    args.file.write_text(text)
    print(f"{args.file}: wrote {len(written)} table(s) {written}")
    missing = sorted(set(tables) - set(written))
    if unknown or missing:
        print(f"markers name no table: {unknown}; tables without markers: {missing}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
