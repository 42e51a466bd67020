"""The conformance matrix (``atorch.testing.conformance``): every method and model-parallel layout on
every zoo model, each cell a parity pass or a designed refusal, never a crash; and docs/models.md is
the table this run generates (parity numbers aside, which move in the last digits between machines)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from atorch.testing.conformance import page, run_matrix

pytestmark = pytest.mark.multirank
pytest.importorskip("transformers", reason="transformers is a test extra")

PAGE = Path(__file__).resolve().parent.parent / "docs" / "models.md"
TRANSFORMERS = ("gpt2", "gpt2_untied", "llama", "qwen2", "mistral", "bert", "t5", "vit", "clip")
MODEL_PARALLEL_FAMILIES = ("gpt2", "llama", "qwen2", "mistral", "bert", "mlp")
# what the issue that introduced the matrix promised: these cells must pass, not merely be refused
MUST_PASS = {
    "tp2": TRANSFORMERS,
    "tp2_sp": MODEL_PARALLEL_FAMILIES,
    "pp2_1f1b": MODEL_PARALLEL_FAMILIES,
    "pp2_gpipe": MODEL_PARALLEL_FAMILIES,
    "mixed_tp2_pp2": MODEL_PARALLEL_FAMILIES,
}


@pytest.fixture(scope="module")
def cells():
    return run_matrix(verbose=True)


def test_no_cell_fails(cells):
    failures = {f"{column} x {model}": cell.detail for (column, model), cell in cells.items() if cell.status == "fail"}
    assert not failures, "\n".join(f"{k}: {v}" for k, v in failures.items())


def test_promised_cells_pass(cells):
    missing = {f"{column} x {model}": cells[(column, model)].detail
               for column, models in MUST_PASS.items() for model in models if cells[(column, model)].status != "pass"}
    assert not missing, "\n".join(f"{k}: {v}" for k, v in missing.items())


def test_refusals_name_a_reason(cells):
    for (column, model), cell in cells.items():
        if cell.status == "refused":
            assert len(cell.detail) > 40, f"{column} x {model}: refusal without a reason: {cell.detail!r}"


def _without_numbers(text: str) -> str:
    return re.sub(r"✔ \d(\.\d+)?e[-+]\d+", "✔", text)


@pytest.mark.skipif(__import__("torch").cuda.is_available(),
                    reason="docs/models.md records the CPU matrix; on a GPU machine fp8 and the devices differ")
def test_models_page_is_the_generated_table(cells):
    generated = page(cells)
    assert _without_numbers(PAGE.read_text()) == _without_numbers(generated), (
        "docs/models.md is not what this run generates: run `make conformance`")
