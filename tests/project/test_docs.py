"""The docs stay true to the code: the example of docs/extending.md runs as written, the generated
tables (method configs, stage contract) are up to date, the layer table matches the layering test,
every search option is documented with its default, relative links point at files that exist, and
tests/README.md maps every registered method and every test file to tests that exist."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from atorch.auto.accelerate import KARGS
from atorch.auto.search.options import SEARCH_KARGS, SearchOptions
from tests.project.test_layering import LAYER_OF_PREFIX, LAYERS, layer_of

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
TESTS_README = ROOT / "tests" / "README.md"
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", TESTS_README, *sorted(DOCS.glob("*.md"))]


def first_python_block(text: str) -> str:
    match = re.search(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert match, "no ```python block"
    return match.group(1)


def run_script(source: str, cwd: Path) -> subprocess.CompletedProcess:
    """``source`` in a fresh plain process on the CPU, with this checkout importable."""
    script = cwd / "example.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}  # one plain process
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=180)


# --- docs/extending.md ------------------------------------------------------------------------------
def test_extending_example_runs_as_written(tmp_path):
    text = (DOCS / "extending.md").read_text()
    check = (
        "\nfrom atorch.auto.opt_lib import get_optimization\n"
        "try:\n"
        "    get_optimization('freeze').normalize({'pattern': 'body.*'})\n"
        "except MethodConfigError as error:\n"
        "    print('ERROR ' + type(error).__name__ + ': ' + str(error))\n"
    )
    done = run_script(first_python_block(text) + check, tmp_path)
    assert done.returncode == 0, f"the extending.md example failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    printed = re.search(r"^It prints:\n\n```\n(.*?)^```", text, re.S | re.M)
    assert printed, "extending.md should show what the example prints"
    assert printed.group(1) in done.stdout, f"the example printed something else:\n{done.stdout}"
    error = re.search(r"^ERROR (.*)$", done.stdout, re.M)
    assert error and f"`{error.group(1)}`" in text, f"extending.md should quote the typo's error: {error}"


# --- generated tables -------------------------------------------------------------------------------
@pytest.mark.parametrize("generator, page", [
    ("gen_method_configs.py", "methods.md"),
    ("gen_architecture_tables.py", "architecture.md"),
])
def test_generated_tables_are_up_to_date(tmp_path, generator, page):
    copy = tmp_path / page
    shutil.copy(DOCS / page, copy)
    done = subprocess.run([sys.executable, str(DOCS / generator), "--file", str(copy)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert copy.read_text() == (DOCS / page).read_text(), (
        f"docs/{page} is out of date: run `.venv/bin/python docs/{generator}`")


def test_architecture_generator_fills_every_marker(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A\n<!-- table:stages -->\nold\n<!-- /table:stages -->\nkept\n"
                    "<!-- table:record-time -->\n<!-- /table:record-time -->\n"
                    "<!-- table:facts -->\n<!-- /table:facts -->\n")
    subprocess.run([sys.executable, str(DOCS / "gen_architecture_tables.py"), "--file", str(page)], check=True,
                   capture_output=True, timeout=120)
    text = page.read_text()
    assert "old" not in text and "kept\n" in text
    assert "| `parallel_mode` | parallel_mode, context |" in text and "| `amp_dtype` | amp_native |" in text
    assert "| `sequence_parallel` | - | `tensor` | `tensor_parallel`, `mixed_parallel` | - | - |" in text


# --- docs/architecture.md: layers ------------------------------------------------------------------
def _layer_table() -> dict[str, str]:
    """{dotted module or package named in the table's modules column: its layer}; the paths exist."""
    section = (DOCS / "architecture.md").read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    named = {}
    for line in section.splitlines():
        match = re.match(r"\| \d+\. (\w+) \| (.*?) \|", line)
        if not match:
            continue
        for path in re.findall(r"`(atorch/[^`]*)`", match.group(2)):
            assert (ROOT / path).exists(), f"docs/architecture.md names {path}, which does not exist"
            module = re.sub(r"(/__init__\.py|\.py|/)$", "", path).replace("/", ".")
            named[module] = match.group(1)
    return named


def test_layer_table_matches_the_layering_test():
    table = _layer_table()
    assert list(dict.fromkeys(table.values())) == LAYERS, "the table lists the layers in order"
    assert set(table) == set(LAYER_OF_PREFIX), (
        f"missing from docs/architecture.md: {sorted(set(LAYER_OF_PREFIX) - set(table))}; "
        f"not in tests/project/test_layering.py: {sorted(set(table) - set(LAYER_OF_PREFIX))}")
    wrong = {m: (layer, LAYER_OF_PREFIX[m]) for m, layer in table.items() if LAYER_OF_PREFIX[m] != layer}
    assert not wrong, f"(docs layer, test layer): {wrong}"
    assert all(layer_of(m) == layer for m, layer in table.items())


# --- options -----------------------------------------------------------------------------------------
def _option_rows(page: str) -> dict[str, str]:
    """{option: default cell} of the Markdown tables on ``page``."""
    rows = {}
    for line in (DOCS / page).read_text().splitlines():
        match = re.match(r"\| `(\w+)` \| ([^|]*) \|", line)
        if match:
            rows[match.group(1)] = match.group(2).strip()
    return rows


def _shown(value) -> str:
    if value is None or isinstance(value, bool):
        return f"`{value}`"
    return f"`{value:g}`"


def test_every_search_option_is_documented_with_its_default():
    rows = _option_rows("search.md")
    defaults = SearchOptions()
    for karg, field in SEARCH_KARGS.items():
        assert karg in rows, f"docs/search.md has no row for {karg}"
        if karg in ("time_limit", "memory_limit"):
            continue  # None there means 'no limit' / 'the device's memory', said in words
        value = getattr(defaults, field)
        assert rows[karg] == _shown(value), f"docs/search.md: {karg} defaults to {value!r}, the page says {rows[karg]}"
    semi = _option_rows("semi-automatic.md")
    for karg in ("dryrun_steps", "dryrun_collective_timeout", "verbose"):
        assert semi[karg] == _shown(getattr(defaults, SEARCH_KARGS[karg])), f"docs/semi-automatic.md: {karg}"


def test_every_karg_is_documented_in_semi_automatic_mode():
    text = (DOCS / "semi-automatic.md").read_text()
    missing = [karg for karg in KARGS if f"`{karg}`" not in text]
    assert not missing, f"docs/semi-automatic.md does not mention {missing}"


# --- links -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_existing_files(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


# --- tests/README.md ---------------------------------------------------------------------------------
def test_tests_readme_maps_every_method_and_test_file():
    from atorch.auto import opt_lib

    text = TESTS_README.read_text()
    methods = text.split("### Methods", 1)[1].split("\n### ", 1)[0]
    rows = set(re.findall(r"^\| `(\w+)`", methods, re.M))
    missing = [name for name in opt_lib.registered_names() if name not in rows]
    assert not missing, f"tests/README.md has no row for the method(s) {missing}"
    files = {path.name for path in (ROOT / "tests").rglob("test_*.py")}
    named = set(re.findall(r"`(test_\w+\.py)`", text))
    assert not named - files, f"tests/README.md names test files that do not exist: {sorted(named - files)}"
    assert not files - named, f"tests/README.md does not map {sorted(files - named)}"
    defined = {name for path in (ROOT / "tests").rglob("test_*.py")
               for name in re.findall(r"^\s*def (test_\w+)\(", path.read_text(), re.M)}
    tests = set(re.findall(r"`(test_\w+)`", text)) - {name[:-3] for name in named}
    assert not tests - defined, f"tests/README.md names tests that do not exist: {sorted(tests - defined)}"


def test_methods_page_states_every_declared_clash_rule():
    """docs/methods.md's list of methods that cannot be combined covers the rules the methods declare."""
    from atorch.auto import opt_lib

    section = (DOCS / "methods.md").read_text().split("Methods that cannot be combined:", 1)[1].split("A clash", 1)[0]
    bullets = section.split("\n- ")
    rules = [members for _, members, _ in opt_lib.exclusive_groups()]
    rules += [(m.name, *m.requires_one_of) for m in opt_lib.registered_methods() if m.requires_one_of]
    missing = [rule for rule in rules if not any(all(f"`{name}`" in b for name in rule) for b in bullets)]
    assert not missing, f"docs/methods.md does not state the rule(s) over {missing}"
