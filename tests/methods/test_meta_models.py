"""Models built on the meta device: split and sharded on meta, each process allocating and
initialising only its own part (atorch/utils/meta_init.py), pretrained weights streamed in with
``atorch.load_pretrained``.

Numerics: an HF Llama built under ``torch.device("meta")``, accelerated, then loaded from a sharded
``save_pretrained`` directory trains exactly as ``from_pretrained`` in one plain process (fp32,
relative difference < 1e-5 on every step's loss) under ddp, zero1, zero2, fsdp, fsdp + activation
checkpointing, tensor parallel, tensor + sequence parallel and pipeline parallel on 2 processes,
mixed tensor 2 x pipeline 2 and fsdp on 4; with tied input and output embeddings under fsdp and
pipeline parallel. The RoPE buffer each process recomputed equals a normal build's, and the
export (``export_model``) reloads with ``from_pretrained`` to the trained weights.

Initialisation without a checkpoint: every strategy starts a meta Llama from the same weights as
one process does (each module draws from a seed of its own name), so its losses match the
one-process meta run; a torchtitan-style model (its own ``init_weights``) and an
``nn.TransformerEncoder`` model initialise on meta, sharded, to the distribution of a normal build
(per parameter: mean within 10 % of the std, std within 10 %, where the tensor is large enough to
say; within five standard errors below that). A module atorch cannot initialise is refused before
anything is allocated, naming it; an initialiser that leaves a tensor unset is refused, naming it.
"""
from __future__ import annotations

import math
import os
import time
from typing import Any

import pytest
import torch
from torch import nn

import atorch
from atorch.auto.dryrun import dry_run_copy
from atorch.errors import MetaModelError
from atorch.testing import run_distributed
from atorch.testing.community_models import TitanLlama, TorchEncoderLM
from atorch.testing.hf_models import SEQ, VOCAB, ZOO, hf_loss, token_dataset
from atorch.testing.training import relative_difference
from atorch.utils.meta_init import has_meta_tensors, meta_copy, plan_initialisation
from atorch.utils.modules import full_state_dict
from tests.checkpoint.test_pretrained import BATCH, LR, accelerate, reference_losses, save_model, train

transformers = pytest.importorskip("transformers", reason="transformers is a test extra")

TOL = 1e-5
TP2 = ("parallel_mode", ([("tensor", 2)], None))
PP2 = [("parallel_mode", ([("pipeline", 2)], None)), ("pipeline_parallel", {"num_micro_batch": 4})]
PRETRAINED_2 = {  # name -> (strategy, tied embeddings)
    "ddp": (["parallel_mode"], False),
    "zero1": (["parallel_mode", "zero1"], False),
    "zero2": (["parallel_mode", "zero2"], False),
    "fsdp": (["parallel_mode", "fsdp"], False),
    "fsdp_checkpoint": (["parallel_mode", ("checkpoint", ("LlamaDecoderLayer",)), "fsdp"], False),
    "tp": ([TP2, "tensor_parallel"], False),
    "tp_sp": ([TP2, "tensor_parallel", "sequence_parallel"], False),
    "pp": (PP2, False),
    "fsdp_tied": (["parallel_mode", "fsdp"], True),
    "pp_tied": (PP2, True),
}
PRETRAINED_4 = {
    "mixed": ([("parallel_mode", ([("tensor", 2), ("pipeline", 2)], None)), "mixed_parallel"], False),
    "fsdp": (["parallel_mode", "fsdp"], False),
    # the stage's gradients averaged over the data group once a step
    "pipeline_data": ([("parallel_mode", ([("pipeline", 2), ("data", 2)], None)),
                       ("pipeline_parallel", {"num_micro_batch": 2})], False),
}
EXPORTED = ("fsdp", "tp", "pp", "fsdp_tied", "mixed")  # cases whose trained weights are exported and reloaded
RANDOM_INIT_2 = {"fsdp": ["parallel_mode", "fsdp"], "tp": [TP2, "tensor_parallel"], "pp": PP2,
                 "pp_tied": PP2}  # each stage holds a copy of the tied embedding, initialised as one process does


def llama_config(tied: bool) -> Any:
    return transformers.LlamaConfig(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
                                    bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=tied)


def meta_llama(tied: bool = False) -> nn.Module:
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(llama_config(tied))


def rope_buffers(result: Any) -> list[torch.Tensor]:
    return [b.detach().clone() for name, b in result.model.named_buffers() if name.endswith("inv_freq")]


# --- the ranks' work: one launch per world size -----------------------------------------------------
def pretrained_suite(dirs: dict[str, str], cases: dict, export_root: str) -> dict:
    out = {}
    for name, (strategy, tied) in cases.items():
        model = meta_llama(tied)
        result = accelerate(model, strategy)
        case = {"meta_left": has_meta_tensors(result.model), "rope": rope_buffers(result)}
        atorch.load_pretrained(dirs["llama_tied" if tied else "llama"], result)
        case["losses"] = train(result)
        if name in EXPORTED:
            case["weights"] = full_state_dict(result.model)
            case["export"] = atorch.export_model(result, os.path.join(export_root, name), max_shard_size="20KB")
        out[name] = case
    return out


def random_init_suite() -> dict:
    """Without a checkpoint: a meta Llama under each strategy (its losses), and the sharded
    initialisation of a torchtitan-style model and an nn.TransformerEncoder model (their weights)."""
    out = {}
    for name, strategy in RANDOM_INIT_2.items():
        torch.manual_seed(0)
        out[name] = train(accelerate(meta_llama(tied=name.endswith("_tied")), strategy))
    for family, build in (("titan", TitanLlama), ("encoder", wide_encoder)):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = build()
        _, result, _ = atorch.auto_accelerate(model, torch.optim.SGD, optim_args={"lr": 0.1},
                                              load_strategy=["parallel_mode", "fsdp"])
        out[family] = full_state_dict(result.model)
    return out


def wide_encoder() -> nn.Module:
    return TorchEncoderLM(vocab_size=512, d_model=128, num_layers=2, dim_feedforward=256)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("meta_pretrained")
    dirs = {"llama": str(root / "llama"), "llama_tied": str(root / "llama_tied")}
    for family, directory in dirs.items():
        save_model(directory, family)
    return dirs


@pytest.fixture(scope="module")
def two_ranks(files, tmp_path_factory) -> list[dict]:
    exports = str(tmp_path_factory.mktemp("meta_exports_2"))
    return run_distributed(_two_rank_work, 2, files, exports, timeout_s=600)


def _two_rank_work(files: dict, exports: str) -> dict:
    return {"pretrained": pretrained_suite(files, PRETRAINED_2, exports), "random": random_init_suite(),
            "automatic": automatic_on_meta(files["llama"]), "rank_local": initialiser_failing_on_rank_1()}


class FailsOnRank1(nn.Linear):
    """A layer whose initialiser raises on rank 1 once it has real storage (not while built on meta)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta and torch.distributed.get_rank() == 1:
            raise RuntimeError("injected initialiser fault on rank 1")
        super().reset_parameters()


def initialiser_failing_on_rank_1() -> dict:
    """Rank 1 raises while materialising; rank 0 is then in the application's closing collective.
    Both must end, within the collective timeout, with the cause; the group stays usable."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), FailsOnRank1(8, 8))
    started = time.monotonic()
    try:
        atorch.auto_accelerate(model, torch.optim.SGD, optim_args={"lr": 0.1}, load_strategy=["parallel_mode", "fsdp"])
        error = None
    except Exception as raised:  # the test reports what each rank raised
        error = f"{type(raised).__name__}: {raised}"
    seconds = time.monotonic() - started
    total = torch.ones(1)
    torch.distributed.all_reduce(total)
    return {"error": error, "seconds": seconds, "all_reduce": float(total)}


AUTO_ROWS = BATCH * 8  # the search's dry runs need more batches than the 3 steps trained


def automatic_on_meta(directory: str) -> dict:
    """The fully automatic mode on a meta Llama: the strategy it returns trains the loaded weights."""
    status, result, strategy = atorch.auto_accelerate(
        meta_llama(), torch.optim.SGD, token_dataset(AUTO_ROWS), hf_loss, optim_args={"lr": LR, "momentum": 0.9},
        dataloader_args={"batch_size": BATCH}, model_input_format="unpack_dict", use_profile_cache=False)
    if not status:
        return {"status": status}
    atorch.load_pretrained(directory, result)
    return {"status": status, "strategy": strategy.names(), "meta_left": has_meta_tensors(result.model),
            "losses": train(result)}


@pytest.fixture(scope="module")
def four_ranks(files, tmp_path_factory) -> list[dict]:
    exports = str(tmp_path_factory.mktemp("meta_exports_4"))
    return run_distributed(pretrained_suite, 4, files, PRETRAINED_4, exports, timeout_s=600)


@pytest.fixture(scope="module")
def references(files) -> dict[str, list[float]]:
    return {family: reference_losses(directory) for family, directory in files.items()}


# --- loaded from a checkpoint ---------------------------------------------------------------------
@pytest.mark.multirank
@pytest.mark.parametrize("case", list(PRETRAINED_2))
def test_meta_build_loaded_on_two_ranks_trains_like_from_pretrained(two_ranks, references, case):
    tied = PRETRAINED_2[case][1]
    expected = references["llama_tied" if tied else "llama"]
    for rank, result in enumerate(two_ranks):
        got = result["pretrained"][case]
        assert not got["meta_left"], f"{case}: tensors left on meta on rank {rank}"
        assert relative_difference(got["losses"], expected) < TOL, (case, rank, got["losses"], expected)


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(PRETRAINED_4))
def test_meta_build_loaded_on_four_ranks_trains_like_from_pretrained(four_ranks, references, case):
    for rank, result in enumerate(four_ranks):
        got = result[case]["losses"]
        assert relative_difference(got, references["llama"]) < TOL, (case, rank, got, references["llama"])


@pytest.mark.multirank
def test_recomputed_rope_buffers_equal_a_normal_build(two_ranks, four_ranks):
    normal = transformers.LlamaForCausalLM(llama_config(False))
    expected = [b for name, b in normal.named_buffers() if name.endswith("inv_freq")]
    seen = 0
    for per_rank in [r["pretrained"] for r in two_ranks] + four_ranks:
        for case, got in per_rank.items():
            for buffer in got["rope"]:
                assert torch.equal(buffer, expected[0]), case
                seen += 1
    assert seen >= len(PRETRAINED_2) * 2  # every case held at least one RoPE buffer on each rank


@pytest.mark.multirank
@pytest.mark.parametrize("case", EXPORTED)
def test_the_export_reloads_with_from_pretrained_to_the_trained_weights(two_ranks, four_ranks, case):
    got = (four_ranks[0] if case == "mixed" else two_ranks[0]["pretrained"])[case]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(got["export"])
    state = reloaded.state_dict()
    assert set(got["weights"]) <= set(state), set(got["weights"]) - set(state)
    for name, trained in got["weights"].items():
        assert torch.equal(state[name].float(), trained), (case, name)


@pytest.mark.multirank
def test_the_automatic_mode_returns_a_strategy_that_trains_a_meta_model(two_ranks, files):
    expected = reference_losses(files["llama"], AUTO_ROWS)
    for rank, result in enumerate(two_ranks):
        got = result["automatic"]
        assert got["status"], f"rank {rank}: the search found nothing"
        assert not got["meta_left"]
        # whatever it chose (data parallel here, possibly sharded or with amp), it trains the loaded weights
        tolerance = 2e-2 if "amp_native" in got["strategy"] or "half" in got["strategy"] else 1e-4
        assert relative_difference(got["losses"], expected) < tolerance, (got, expected)


@pytest.mark.multirank
def test_an_initialiser_failing_on_one_rank_ends_every_rank(two_ranks):
    got = [result["rank_local"] for result in two_ranks]
    assert got[1]["error"].startswith("RuntimeError: injected initialiser fault on rank 1"), got
    assert got[0]["error"].startswith("PeerRankError") and "injected initialiser fault" in got[0]["error"], got
    assert all(r["seconds"] < 60 for r in got), got  # the collective timeout, not a hang
    assert [r["all_reduce"] for r in got] == [2.0, 2.0]  # the process group survives


# --- initialised on meta, no checkpoint -----------------------------------------------------------
@pytest.mark.multirank
@pytest.mark.parametrize("case", list(RANDOM_INIT_2))
def test_every_strategy_initialises_a_meta_model_as_one_process_does(two_ranks, case):
    torch.manual_seed(0)
    reference = train(accelerate(meta_llama(tied=case.endswith("_tied")), []))
    for rank, result in enumerate(two_ranks):
        got = result["random"][case]
        assert relative_difference(got, reference) < TOL, (case, rank, got, reference)


def _normal_titan() -> nn.Module:
    model = TitanLlama()
    model.init_weights()  # torchtitan initialises after the build, on a real device as on meta
    return model


@pytest.mark.multirank
@pytest.mark.parametrize("family, build", [("titan", _normal_titan), ("encoder", wide_encoder)])
def test_sharded_meta_initialisation_has_a_normal_builds_distribution(two_ranks, family, build):
    torch.manual_seed(1)
    normal = {k: v.detach().float() for k, v in build().state_dict().items()}
    for rank, result in enumerate(two_ranks):
        got = result["random"][family]
        assert set(got) == set(normal)
        for name, value in got.items():
            assert_same_distribution(name, value, normal[name], f"{family}, rank {rank}")
    first, second = (two_ranks[r]["random"][family] for r in range(2))
    assert all(torch.equal(first[k], second[k]) for k in first), "ranks disagree on the gathered weights"
    assert _distinct_halves(first), "the two shards of a weight hold the same values"


def assert_same_distribution(name: str, got: torch.Tensor, expected: torch.Tensor, where: str) -> None:
    """Mean within 10 % of the std and std within 10 % where a tensor has enough elements for that
    to be a test of the distribution, else within five standard errors; constants exactly."""
    got, expected = got.flatten().double(), expected.flatten().double()
    assert got.shape == expected.shape, (where, name)
    std = expected.std().item() if expected.numel() > 1 else 0.0
    if std == 0:
        assert torch.equal(got, expected), (where, name, "a constant tensor differs")
        return
    n = expected.numel()
    mean_tol = max(0.1 * std, 5 * std * math.sqrt(2 / n))
    std_tol = max(0.1 * std, 5 * std * math.sqrt(2 / n))  # the std's standard error is ~ std / sqrt(2n) or more
    assert abs(got.mean().item() - expected.mean().item()) <= mean_tol, (where, name, got.mean(), expected.mean())
    assert abs(got.std().item() - std) <= std_tol, (where, name, got.std(), std)


def _distinct_halves(weights: dict[str, torch.Tensor]) -> bool:
    """The largest weight's two row halves (each rank's FSDP shard) differ."""
    largest = max(weights.values(), key=lambda t: t.numel())
    half = largest.shape[0] // 2
    return not torch.equal(largest[:half], largest[half: 2 * half])


# --- refusals (one process) -----------------------------------------------------------------------
class Scaled(nn.Module):
    """A module with its own parameter and no initialiser."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class HalfReset(nn.Linear):
    """An initialiser that sets the weight and forgets the bias."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)


def _meta(build) -> nn.Module:
    with torch.device("meta"):
        return build()


def test_a_module_without_initialiser_is_refused_before_anything_is_allocated():
    model = _meta(lambda: nn.Sequential(nn.Linear(4, 4), Scaled()))
    with pytest.raises(MetaModelError, match=r"'1' \(Scaled\).*\['scale'\].*no initialiser") as caught:
        plan_initialisation(model)
    assert caught.value.module == "1"
    with pytest.raises(MetaModelError, match="Scaled"):
        atorch.auto_accelerate(model, torch.optim.SGD, optim_args={"lr": 0.1}, load_strategy=["fsdp"])
    assert all(p.is_meta for p in model.parameters())  # refused before any storage was given


def test_an_initialiser_that_leaves_a_tensor_unset_is_refused_naming_it():
    model = _meta(lambda: nn.Sequential(nn.Linear(4, 4), HalfReset(4, 2)))
    with pytest.raises(MetaModelError, match=r"'1.bias'.*left it \(partly\) unset"):
        atorch.auto_accelerate(model, torch.optim.SGD, optim_args={"lr": 0.1}, load_strategy=[])


def test_a_dry_run_copies_a_real_model_whose_initialiser_leaves_a_tensor_unset():
    """Dry runs apply each candidate to a meta copy of the user's real model, materialised by the model's
    own initialisers; where one leaves a tensor unset (HalfReset here; Hugging Face CLIP's _init_weights
    skips logit_scale) that copy could never be materialised and every dry run failed, so the real model
    is copied instead. Trying the initialisers leaves the user's RNG state as it was."""
    model = nn.Sequential(nn.Linear(4, 4), HalfReset(4, 2))
    state = torch.random.get_rng_state()
    assert meta_copy(model) is None
    assert torch.equal(state, torch.random.get_rng_state())
    copied = dry_run_copy(model)
    assert not has_meta_tensors(copied) and torch.equal(copied[1].bias, model[1].bias)
    assert meta_copy(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))) is not None


def test_the_automatic_mode_trains_clip_whose_hf_initialiser_skips_logit_scale(tmp_path):
    clip = ZOO["clip"]
    status, result, _ = atorch.auto_accelerate(
        clip.build(), torch.optim.AdamW, clip.make_dataset(16), clip.loss_func, optim_args={"lr": 1e-3},
        dataloader_args={"batch_size": 8}, model_input_format=clip.input_format, excluded=["native_dynamo"],
        report_dir=str(tmp_path))
    assert status, "every dry run failed on the meta copy"
    rows = result.args.extras["search"].rows
    assert any(row.status == "ok" for row in rows)


def test_real_buffers_of_an_init_empty_weights_model_are_kept():
    """accelerate's init_empty_weights leaves buffers real: materialising must not reset them."""
    model = TitanLlama()
    expected = model.rope_cos.clone()
    model.rope_cos.mul_(2)  # a value no initialiser computes
    with torch.device("meta"):
        fresh = TitanLlama()
    fresh.rope_cos, fresh.rope_sin = model.rope_cos, model.rope_sin
    assert plan_initialisation(fresh).whole_model  # the torchtitan-style root
    _, result, _ = atorch.auto_accelerate(fresh, torch.optim.SGD, optim_args={"lr": 0.1}, load_strategy=[])
    # the whole-model initialiser (torchtitan's) recomputes the tables: its own choice, kept
    assert torch.equal(result.model.rope_cos, expected)
    encoder = _meta(lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    encoder[1].running_mean = torch.full((4,), 3.0)  # real, set by the user
    _, result, _ = atorch.auto_accelerate(encoder, torch.optim.SGD, optim_args={"lr": 0.1}, load_strategy=[])
    assert torch.equal(result.model[1].running_mean, torch.full((4,), 3.0))
    assert not has_meta_tensors(result.model)
