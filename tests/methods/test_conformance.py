"""The conformance matrix (``atorch.testing.conformance``): every method and model-parallel layout on
every zoo model, each cell a parity pass or a designed refusal, never a crash; and docs/models.md is
the table this run generates (parity numbers aside, which move in the last digits between machines)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

from atorch.auto.search.layouts import layout_facts
from atorch.testing.conformance import META, META_FAMILIES, family, page, run_matrix, tensor_plan_share
from atorch.testing.hf_models import ZOO
from atorch.testing.training import call_model

# the whole matrix (22 columns x the zoo: a launch per world size, two side by side for single-process columns)
# runs in the first test: more than the default 600 s
pytestmark = [pytest.mark.multirank, pytest.mark.timeout(2700)]
pytest.importorskip("transformers", reason="transformers is a test extra")

PAGE = Path(__file__).resolve().parents[2] / "docs" / "models.md"
TRANSFORMERS = tuple(name for name, zoo in ZOO.items() if zoo.transformer)  # HF and non-HF families
MODEL_PARALLEL_FAMILIES = ("gpt2", "llama", "qwen2", "mistral", "bert", "mlp")
# what the issues that grew the matrix promised: these cells must pass, not merely be refused.
# tensor_parallel finds its plan from the traced forward, so every transformer (and both plain MLPs,
# whatever their layers are called) trains at parity under tp2 and tp2 + sp; mixed tp2 x pp2 on every
# family pipeline_parallel supports
TENSOR_FAMILIES = TRANSFORMERS + ("mlp", "mlp_updown")
MUST_PASS = {
    "tp2": TENSOR_FAMILIES,
    "tp2_sp": TENSOR_FAMILIES,
    "pp2_1f1b": MODEL_PARALLEL_FAMILIES,
    "pp2_gpipe": MODEL_PARALLEL_FAMILIES,
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


def test_mixed_tensor_pipeline_passes_wherever_pipeline_parallel_does(cells):
    """The MoE included: its routing is value-dependent, which the schedule's shape inference on
    unfilled tensors used to split between the tensor ranks (StageModule.agree_on_first_input)."""
    missing = {model: cells[("mixed_tp2_pp2", model)].detail for model in ZOO
               if cells[("pp2_1f1b", model)].status == "pass" and cells[("mixed_tp2_pp2", model)].status != "pass"}
    assert not missing, missing


def test_meta_builds_pass_wherever_their_family_does(cells):
    """Each ``<family>@meta`` row (built on the meta device, weights streamed in with
    load_pretrained) trains at parity in every column where the normally built family does."""
    missing = {f"{column} x {name}{META}": cells[(column, name + META)].detail
               for (column, name), cell in cells.items()
               if name in META_FAMILIES and cell.status == "pass" and cells[(column, name + META)].status != "pass"}
    assert not missing, "\n".join(f"{k}: {v}" for k, v in missing.items())
    assert all((column, family + META) in cells for column, _ in cells for family in META_FAMILIES)


def test_tensor_parallel_refusals_name_the_blocking_module(cells):
    """A model tensor_parallel declines is told which module blocks the plan and why (the CNN: its
    only Linear, whose output goes to the loss)."""
    for (column, model), cell in cells.items():
        if column in ("tp2", "tp2_sp") and cell.status == "refused":
            linears = [n for n, m in ZOO[family(model)].build().named_modules() if isinstance(m, torch.nn.Linear)]
            named = [n for n in linears if re.search(rf"(^|[ (;]){re.escape(n)}(: | has | computes )", cell.detail)]
            assert "tensor_parallel" in cell.detail and named, f"{column} x {model}: {cell.detail}"


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


def test_search_proposes_exactly_the_layouts_the_matrix_proves(cells):
    """The search's layout facts come from the methods' own planners: a tensor or pipeline size is
    offered for a model exactly when the matrix's cell for it passes (and the refusal it gives is the
    method's own)."""
    for name, zoo in ZOO.items():
        batch = default_collate([zoo.make_dataset(2, 0)[i] for i in range(2)])
        facts = layout_facts(zoo.build(), 2, lambda model: call_model(model, batch, zoo.input_format))
        for column, tensor, pipeline in (("tp2", 2, 1), ("pp2_1f1b", 1, 2)):
            cell = cells[(column, name)]
            offered = facts.reason(tensor, pipeline) is None
            assert offered == (cell.status == "pass"), (
                f"{name} {column}: search {'offers' if offered else 'leaves out'} the layout "
                f"({facts.reason(tensor, pipeline)}), matrix cell is {cell.status}: {cell.detail}")


@pytest.mark.parametrize("name", [m for m, z in ZOO.items() if z.transformer])
def test_tensor_plan_splits_what_megatron_splits(name):
    """On every transformer family the plan found from the structure splits at least 90% of what a
    Megatron-style scheme splits (counted from module types, independently of the plan)."""
    ours, megatron, found_by = tensor_plan_share(name)
    assert found_by == "structure"
    assert ours >= 0.9 * megatron, (f"{name}: the plan splits {ours:.1%} of the parameters, "
                                      f"Megatron-style {megatron:.1%}")


# transformers' families beyond the zoo (atorch.testing.hf_models.MORE_FAMILIES) under the columns whose plan
# is derived from the model's structure; the tensor-parallel refusals are designed: CodeGen's qkv_proj is laid
# out in 4 blocks of [q | v | k] (its mp_num, a local constant of its forward), refused at the plan check with
# the reason. StableLM 2's per-head norms (a ModuleList of one LayerNorm a head) run on the gathered heads.
MORE_COLUMNS = ("checkpoint", "fsdp", "tp2", "tp2_sp", "pp2_1f1b")
MORE_REFUSED = {("tp2", "codegen"): "does not reproduce the unsplit model",
                ("tp2_sp", "codegen"): "does not reproduce the unsplit model"}


def test_transformers_further_families_train_at_parity_or_are_refused_with_the_reason():
    """Falcon (7B's multi-query and 40B's grouped fused projections, parallel attention and MLP), GPT-J,
    CodeGen, Gemma 2 (soft-capping, sliding windows), StableLM 2, StarCoder2, Phi-2, GPT-Neo and Granite
    (multipliers): every cell passes at parity but the designed refusals, which say why."""
    from atorch.testing.hf_models import MORE_FAMILIES

    cells = run_matrix(columns=list(MORE_COLUMNS), models=list(MORE_FAMILIES), verbose=False)
    assert len(cells) == len(MORE_COLUMNS) * len(MORE_FAMILIES)
    for (column, model), cell in cells.items():
        if (column, model) in MORE_REFUSED:
            assert cell.status == "refused" and MORE_REFUSED[column, model] in cell.detail, (column, model, cell)
        else:
            assert cell.status == "pass", (column, model, cell.detail)


# the share table's families (atorch.testing.family_configs) that no other test trains: under tensor
# parallelism at parity with one process (every other family there is trained by the tests above or in
# tests/methods/test_model_parallel.py under its zoo name)
TRAINED_ELSEWHERE = {"falcon (new decoder)", "falcon (multi-query)", "gptj", "codegen", "gemma2", "stablelm",
                     "starcoder2", "phi", "gpt_neo", "granite", "apertus", "bitnet", "cohere", "deepseek_v3",
                     "gemma (multi-query)", "gpt_oss", "jamba", "llama4_text", "mpt", "olmo2", "phi3", "gpt_bigcode"}


def test_the_share_table_s_other_families_train_under_tensor_parallelism_at_parity():
    """Two dozen transformers families whose tensor-parallel plan was read but never trained (OLMo, OLMo 3,
    Persimmon, GLM, DeepSeek-V2, JetMoE, GraniteMoE, PhiMoE, SmolLM3, ERNIE 4.5, XGLM, Helium, EXAONE 4,
    Seed-OSS, Nemotron, GLM-4-MoE, LFM2, MiniMax, Qwen3-Next, Zamba, Nemotron-H, RecurrentGemma, Gemma,
    Gemma 3): two steps on 2 processes, losses and weights as one process's. JetMoE's expert bank, called
    with its per-expert counts as a Python list, was refused before 2026-11-30."""
    from atorch.testing.family_configs import FAMILIES

    names = [f"family:{name}" for name in FAMILIES if name not in TRAINED_ELSEWHERE]
    assert len(names) == 24
    cells = run_matrix(columns=["tp2"], models=names, verbose=False)
    failed = {model: cell.detail for (_, model), cell in cells.items() if cell.status != "pass"}
    assert not failed, failed
