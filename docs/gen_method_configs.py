"""Each built-in method's config fields (name, type, default, doc) as a Markdown table.

    python docs/gen_method_configs.py            # refresh the tables in docs/methods.md (print them if it is absent)
    python docs/gen_method_configs.py --stdout   # print every table
    python docs/gen_method_configs.py --file F   # refresh the tables in F

In the Markdown file, the text between a line ``<!-- config:METHOD -->`` and a line
``<!-- /config:METHOD -->`` is replaced by METHOD's table; everything else is left as it is.
The tables come from the methods' config dataclasses (``atorch.utils.config``), so they cannot drift.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a checkout without installing atorch
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared marker helper beside this file

import markers  # noqa: E402

from atorch.auto.opt_lib import BUILTIN_METHODS  # noqa: E402

MARKERS = markers.marker_pattern("config")


def config_table(method) -> str:
    """The Markdown table of one method's config fields."""
    rows = method.config_class.field_docs()
    if not rows:
        return "No options.\n"
    cell = lambda text: str(text).replace("|", "\\|")  # noqa: E731  (Literal types read 'a' | 'b')
    lines = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    default = lambda row: row.default if row.default == "required" else f"`{cell(row.default)}`"  # noqa: E731
    lines += [f"| `{r.name}` | {cell(r.type)} | {default(r)} | {cell(r.doc)} |" for r in rows]
    return "\n".join(lines) + "\n"


def all_tables() -> dict[str, str]:
    return {method.name: config_table(method) for method in BUILTIN_METHODS}


def rewrite(text: str, tables: dict[str, str]) -> tuple[str, list[str], list[str]]:
    """(new text, methods whose table was written, marker names that are no built-in method)."""
    return markers.rewrite(text, tables, MARKERS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", type=Path, default=ROOT / "docs" / "methods.md", help="Markdown file with markers")
    parser.add_argument("--stdout", action="store_true", help="print every table instead of rewriting a file")
    args = parser.parse_args(argv)
    tables = all_tables()
    if not args.stdout and args.file.is_file():
        text, written, unknown = rewrite(args.file.read_text(), tables)
        args.file.write_text(text)
        print(f"{args.file}: wrote {len(written)} config table(s) {written}")
        if unknown:
            print(f"markers name no built-in method: {unknown}", file=sys.stderr)
        return 1 if unknown else 0
    for name, table in tables.items():
        print(f"### {name}\n\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
