"""Shared by the docs generators: replace the text between ``<!-- KIND:NAME -->`` and
``<!-- /KIND:NAME -->`` marker lines with a generated table, leaving everything else as written."""
from __future__ import annotations

import re


def marker_pattern(kind: str) -> re.Pattern:
    return re.compile(rf"(<!-- {kind}:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /{kind}:(?P=name) -->)", re.DOTALL)


def rewrite(text: str, tables: dict[str, str], pattern: re.Pattern) -> tuple[str, list[str], list[str]]:
    """(new text, names whose table was written, marker names with no table)."""
    written, unknown = [], []

    def replace(match: re.Match) -> str:
        name = match.group("name")
        if name not in tables:
            unknown.append(name)
            return match.group(0)
        written.append(name)
        return match.group(1) + tables[name] + match.group(4)

    return pattern.sub(replace, text), written, unknown
