"""``atorch.load_pretrained``: Hugging Face ``save_pretrained`` weights into a model under any strategy.

Numerics: a tiny Llama saved with ``save_pretrained`` in several shards (with an index) is loaded,
after ``auto_accelerate``, into a differently seeded model of the same config (every weight changes,
which each rank checks), then trained 3 SGD steps: the losses must equal those of ``from_pretrained``
trained the same way in one process (fp32, relative difference < 1e-5), under ddp, zero1, zero2,
DeepSpeed ZeRO-2 (when installed), fsdp, tensor_parallel, pipeline_parallel and fsdp with activation
checkpointing on 2 ranks (one launch), with tied embeddings under fsdp and pipeline_parallel (whose
two stages each hold a copy: both must equal the file's tensor), a GPT-2 under tensor_parallel (its
fused q|k|v kept in a permuted order), a Mixtral under fsdp, tensor_parallel and pipeline_parallel (its
experts held stacked in 3-D parameters, saved one tensor per expert: each fsdp rank reads only its own
experts), Qwen2-MoE, Qwen3-MoE and OLMoE in one process, and in one plain process; torch.compile and
checkpoint_wrapper names.

What is read: every rank counts the elements ``safe_open`` hands it and the files it opens; under fsdp
each rank reads half of the model's elements, under pipeline_parallel each stage opens only files
holding its own keys. Errors: a missing, unexpected, misshapen or wrongly typed key, a truncated shard,
an index naming a missing shard, an empty directory, a pickled-only directory and a path that does not
exist raise ``CheckpointError`` naming the key or file, before any weight changes (on two ranks as well:
a key and a file only one pipeline stage reads fail on both).
"""
from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import atorch
from atorch.auto.opt_lib.deepspeed_zero import deepspeed_unavailable_reason
from atorch.checkpoint import pretrained
from atorch.checkpoint.tensors import model_tensors
from atorch.errors import CheckpointError
from atorch.testing import run_distributed
from atorch.testing.hf_models import SEQ, VOCAB, hf_loss, token_dataset
from atorch.testing.training import relative_difference, train_returned

transformers = pytest.importorskip("transformers", reason="transformers is a test extra")

STEPS, BATCH, LR, TOL = 3, 8, 0.05, 1e-5
TP2 = ("parallel_mode", ([("tensor", 2)], None))
PP2 = [("parallel_mode", ([("pipeline", 2)], None)), ("pipeline_parallel", {"num_micro_batch": 4})]
CASES = {  # name -> (strategy, model: a key of FAMILIES)
    "ddp": (["parallel_mode"], "llama"),
    "fsdp": (["parallel_mode", "fsdp"], "llama"),
    "zero1": (["parallel_mode", "zero1"], "llama"),
    "zero2": (["parallel_mode", "zero2"], "llama"),
    "tp": ([TP2, "tensor_parallel"], "llama"),
    "pp": (PP2, "llama"),
    "fsdp_tied": (["parallel_mode", "fsdp"], "llama_tied"),
    "pp_tied": (PP2, "llama_tied"),
    # GPT-2's fused q|k|v (c_attn) is kept in a permuted order under tensor_parallel
    "tp_gpt2": ([TP2, "tensor_parallel"], "gpt2"),
    "fsdp_activation_checkpoint": (["parallel_mode", ("checkpoint", ("LlamaDecoderLayer",)), "fsdp"], "llama"),
    # Mixture of experts: each stacked expert parameter built from the per-expert tensors of the file
    "fsdp_mixtral": (["parallel_mode", "fsdp"], "mixtral"),
    "tp_mixtral": ([TP2, "tensor_parallel"], "mixtral"),
    "pp_mixtral": (PP2, "mixtral"),
}
if deepspeed_unavailable_reason() is None:  # DeepSpeed ZeRO steps from its fp32 copy, which loading must refresh
    CASES["ds_zero2"] = (["parallel_mode", ("zero2", {"use_ds_zero": True})], "llama")
LAST_LAYER_KEY = "model.layers.3.mlp.gate_proj.weight"  # held by the last pipeline stage only


# --- the model, the files, the reference ---------------------------------------------------------------
def llama(tied: bool, seed: int) -> torch.nn.Module:
    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def gpt2(seed: int) -> torch.nn.Module:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def mixtral(seed: int) -> torch.nn.Module:
    """Experts held stacked (``mlp.experts.gate_up_proj``: 4 x 2 ffn x hidden), saved one by one
    (``block_sparse_moe.experts.3.w1.weight``): transformers builds the first from the second on load."""
    config = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2,
                                        vocab_size=VOCAB, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
                                        pad_token_id=0)
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(config)


FAMILIES = {"llama": lambda seed: llama(False, seed), "llama_tied": lambda seed: llama(True, seed), "gpt2": gpt2,
            "mixtral": mixtral}


def save_model(directory: str, family: str) -> None:
    """Seed 0, every weight (norms included) moved off its initial value, in shards of 20 KB."""
    model = FAMILIES[family](0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(directory, max_shard_size="20KB")


def train(result: Any, steps: int = STEPS) -> list[float]:
    """The seed's loop (as ``train_gpt``): global mean loss per step."""
    return train_returned(result, steps)


def reference_losses(directory: str, rows: int = BATCH * STEPS) -> list[float]:
    """``from_pretrained`` and plain torch: one process, the whole batch, SGD with momentum (the
    first STEPS batches of a dataset of ``rows`` rows)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    optim = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for batch in list(torch.utils.data.DataLoader(token_dataset(rows), batch_size=BATCH))[:STEPS]:
        loss = model(**batch).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def accelerate(model: torch.nn.Module, strategy: list) -> Any:
    status, result, _ = atorch.auto_accelerate(
        model, torch.optim.SGD, token_dataset(BATCH * STEPS), hf_loss, optim_args={"lr": LR, "momentum": 0.9},
        dataloader_args={"batch_size": BATCH}, model_input_format="unpack_dict", load_strategy=strategy)
    assert status
    return result


def local_weights(result: Any) -> dict[str, torch.Tensor]:
    """This rank's part of every tensor it holds, copied."""
    return {name: (t.to_local() if hasattr(t, "to_local") else t).detach().clone()
            for name, t in model_tensors(result.model).items()}


# --- what a rank reads ----------------------------------------------------------------------------------
class CountingOpen:
    """``safe_open`` that records the files opened and the elements each tensor read returned."""

    def __init__(self, real: Any):
        self.real, self.files, self.elements = real, set(), 0

    def __call__(self, file: str, framework: str) -> "CountingHandle":
        self.files.add(os.path.basename(file))
        return CountingHandle(self.real(file, framework=framework), self)


class CountingHandle:
    def __init__(self, handle: Any, counter: CountingOpen):
        self.handle, self.counter = handle, counter

    def __enter__(self) -> "CountingHandle":
        self.handle.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handle.__exit__(*exc)

    def keys(self) -> list[str]:
        return self.handle.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._count(self.handle.get_tensor(name))

    def get_slice(self, name: str) -> "CountingSlice":
        return CountingSlice(self.handle.get_slice(name), self)

    def _count(self, tensor: torch.Tensor) -> torch.Tensor:
        self.counter.elements += tensor.numel()
        return tensor


class CountingSlice:
    def __init__(self, part: Any, handle: CountingHandle):
        self.part, self.handle = part, handle

    def get_shape(self) -> list[int]:
        return self.part.get_shape()

    def get_dtype(self) -> str:
        return self.part.get_dtype()

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.handle._count(self.part[index])


# --- two ranks: every strategy in one launch -----------------------------------------------------------------
def rank_suite(dirs: dict[str, str], cases: dict) -> dict:
    real_open = pretrained.safe_open
    out = {}
    for name, (strategy, family) in cases.items():
        result = accelerate(FAMILIES[family](1), strategy)
        before = local_weights(result)
        pretrained.safe_open = counter = CountingOpen(real_open)
        try:
            loaded = atorch.load_pretrained(dirs[family], result)
        except CheckpointError as error:  # raised on every rank: report it for this case, go on
            out[name] = {"error": str(error)}
            continue
        finally:
            pretrained.safe_open = real_open
        after = local_weights(result)
        unchanged = sorted(k for k in after if after[k].numel() and torch.equal(after[k], before[k]))
        shared = result.model.shared.copies() if name.startswith("pp") else {}
        out[name] = {"loaded": tuple(loaded), "unchanged": unchanged, "keys": sorted(after),
                     "elements": counter.elements, "files": sorted(counter.files),
                     "shared": {k: [p.detach().clone() for p in v] for k, v in shared.items()},
                     "losses": train(result)}
        if name == "pp":
            out["pp_errors"] = bad_loads_on_two_ranks(result, dirs)
    return out


def bad_loads_on_two_ranks(result: Any, dirs: dict[str, str]) -> dict:
    """A key and a file that only the last stage reads: every rank raises, no weight changes."""
    errors = {}
    for case in ("misshapen_last_layer", "truncated_last_layer"):
        before = local_weights(result)
        try:
            atorch.load_pretrained(dirs[case], result)
            errors[case] = None
        except CheckpointError as error:
            errors[case] = (str(error), error.key)
        after = local_weights(result)
        errors[case + "_unchanged"] = all(torch.equal(after[k], before[k]) for k in after)
    return errors


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pretrained")
    dirs = {family: str(root / family) for family in FAMILIES}
    for family, directory in dirs.items():
        save_model(directory, family)
    index = read_index(dirs["llama"])
    last_file = index[LAST_LAYER_KEY]
    assert not any(v == last_file for k, v in index.items() if not k.startswith("model.layers.3.")), \
        "the shard split changed: pick a file only the last stage holds"
    dirs["truncated_last_layer"] = copy_dir(dirs["llama"], str(root / "truncated"))
    truncate(os.path.join(dirs["truncated_last_layer"], last_file))
    dirs["misshapen_last_layer"] = copy_dir(dirs["llama"], str(root / "misshapen"))
    rewrite_key(os.path.join(dirs["misshapen_last_layer"], last_file), LAST_LAYER_KEY, torch.zeros(3, 3))
    return dirs


def read_index(directory: str) -> dict[str, str]:
    with open(os.path.join(directory, "model.safetensors.index.json")) as handle:
        return json.load(handle)["weight_map"]


def copy_dir(source: str, target: str) -> str:
    shutil.copytree(source, target)
    return target


def truncate(file: str) -> None:
    with open(file, "r+b") as handle:
        handle.truncate(os.path.getsize(file) // 2)


def rewrite_key(file: str, key: str, value: torch.Tensor) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    tensors[key] = value
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def two_ranks(files) -> list[dict]:
    return run_distributed(rank_suite, 2, files, CASES, timeout_s=300)


@pytest.fixture(scope="module")
def references(files) -> dict[str, list[float]]:
    return {family: reference_losses(files[family]) for family in FAMILIES}


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(CASES))
def test_losses_after_loading_match_from_pretrained(two_ranks, references, case):
    reference = references[CASES[case][1]]
    for rank, runs in enumerate(two_ranks):
        run = runs[case]
        assert "error" not in run, (case, rank, run.get("error"))
        assert run["loaded"] == ([], []), (case, rank, run["loaded"])
        assert run["unchanged"] == [], f"{case}, rank {rank}: loading left {run['unchanged']} as they were"
        difference = relative_difference(run["losses"], reference)
        assert difference < TOL, f"{case}, rank {rank}: {run['losses']} vs {reference} ({difference:.2e})"


@pytest.mark.multirank
def test_each_fsdp_rank_reads_half_of_the_model(two_ranks, files):
    total = sum(p.numel() for p in transformers.LlamaForCausalLM.from_pretrained(files["llama"]).parameters())
    fsdp = [runs["fsdp"]["elements"] for runs in two_ranks]
    ddp = [runs["ddp"]["elements"] for runs in two_ranks]
    assert ddp == [total, total]  # the count sees whole reads
    assert sum(fsdp) == total and all(abs(n - total / 2) < 0.05 * total for n in fsdp), (fsdp, total)


@pytest.mark.multirank
def test_each_fsdp_rank_reads_only_its_experts(two_ranks, files):
    """A stacked expert parameter sharded on its experts' dimension: a rank reads its experts' saved
    tensors, not the others' (each rank about half of the model's elements)."""
    total = sum(p.numel() for p in transformers.MixtralForCausalLM.from_pretrained(files["mixtral"]).parameters())
    fsdp = [runs["fsdp_mixtral"]["elements"] for runs in two_ranks]
    assert sum(fsdp) == total and all(abs(n - total / 2) < 0.05 * total for n in fsdp), (fsdp, total)


@pytest.mark.multirank
def test_each_pipeline_stage_opens_only_the_files_of_its_keys(two_ranks, files):
    index = read_index(files["llama"])
    for runs in two_ranks:
        run = runs["pp"]
        assert run["files"] == sorted({index[k] for k in run["keys"]})
    first, last = (runs["pp"]["files"] for runs in two_ranks)
    assert index[LAST_LAYER_KEY] not in first and index["model.embed_tokens.weight"] not in last


@pytest.mark.multirank
def test_pipeline_stages_hold_equal_copies_of_the_tied_embedding(two_ranks, files):
    from safetensors.torch import load_file

    saved = load_file(os.path.join(files["llama_tied"], read_index(files["llama_tied"])["model.embed_tokens.weight"]))
    copies = [c for runs in two_ranks for c in runs["pp_tied"]["shared"].get("model.embed_tokens.weight", [])]
    assert len(copies) == 2  # one on each stage
    for copy in copies:
        assert torch.equal(copy, saved["model.embed_tokens.weight"])


@pytest.mark.multirank
def test_a_key_or_file_only_one_stage_reads_fails_on_every_rank(two_ranks, files):
    last_file = os.path.join(files["truncated_last_layer"], read_index(files["llama"])[LAST_LAYER_KEY])
    for rank, runs in enumerate(two_ranks):
        errors = runs["pp_errors"]
        message, key = errors["misshapen_last_layer"]
        assert key == LAST_LAYER_KEY and "[3, 3]" in message, (rank, message)
        message, key = errors["truncated_last_layer"]
        assert key == last_file and last_file in message, (rank, message)
        assert errors["misshapen_last_layer_unchanged"] and errors["truncated_last_layer_unchanged"], rank


# --- one plain process ---------------------------------------------------------------------------------------
def test_one_plain_process_trains_like_from_pretrained(files, references):
    result = accelerate(llama(False, seed=1), [])
    assert atorch.load_pretrained(files["llama"], result) == atorch.LoadResult([], [])
    assert relative_difference(train(result), references["llama"]) < TOL


def test_keys_transformers_renames_on_load_are_found(tmp_path):
    """transformers 5 saves a ViT's attention as ``attention.attention.query`` and names it
    ``attention.q_proj`` in the live model: load_pretrained reads what save_pretrained wrote."""
    from atorch.testing.hf_models import tiny_vit

    torch.manual_seed(0)
    saved = tiny_vit()
    saved.save_pretrained(tmp_path)
    torch.manual_seed(1)
    _, result, _ = atorch.auto_accelerate(tiny_vit(), torch.optim.SGD, optim_args={"lr": 0.1}, load_strategy=[])
    assert atorch.load_pretrained(tmp_path, result) == atorch.LoadResult([], [])
    expected = transformers.AutoModelForImageClassification.from_pretrained(tmp_path).state_dict()
    for name, value in result.model.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_stacked_experts_are_built_from_the_per_expert_tensors_saved(files):
    """Mixtral's checkpoint holds one tensor per expert and projection; the model one stacked tensor
    per layer (w1 | w3 concatenated): loaded, every tensor equals ``from_pretrained``'s."""
    result = accelerate(mixtral(1), [])
    assert atorch.load_pretrained(files["mixtral"], result) == atorch.LoadResult([], [])
    expected = transformers.MixtralForCausalLM.from_pretrained(files["mixtral"]).state_dict()
    assert any(value.dim() == 3 for value in expected.values())
    for name, value in result.model.state_dict().items():
        assert torch.equal(value, expected[name]), name


def _other_moe(kind: str, seed: int) -> torch.nn.Module:
    shape = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, vocab_size=VOCAB)
    torch.manual_seed(seed)
    if kind == "qwen2_moe":  # a shared expert beside the routed ones
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            moe_intermediate_size=24, shared_expert_intermediate_size=32, **shape))
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(moe_intermediate_size=24, head_dim=8,
                                                                            **shape))
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**shape))


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe", "olmoe"])
def test_other_moe_families_load_their_per_expert_checkpoints(kind, tmp_path):
    _other_moe(kind, 0).save_pretrained(tmp_path)
    expected = type(_other_moe(kind, 0)).from_pretrained(tmp_path).state_dict()
    _, result, _ = atorch.auto_accelerate(_other_moe(kind, 1), torch.optim.SGD, optim_args={"lr": 0.1},
                                          load_strategy=[])
    assert atorch.load_pretrained(tmp_path, result) == atorch.LoadResult([], [])
    for name, value in result.model.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_a_misshapen_expert_names_the_stacked_parameter(files, tmp_path):
    directory = copy_dir(files["mixtral"], str(tmp_path / "misshapen_expert"))
    key = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    rewrite_key(os.path.join(directory, read_index(directory)[key]), key, torch.zeros(3, 3))
    result = accelerate(mixtral(1), [])
    before = local_weights(result)
    with pytest.raises(CheckpointError, match=r"experts\.gate_up_proj.*\[3, 3\]") as raised:
        atorch.load_pretrained(directory, result)
    assert raised.value.key == "model.layers.1.mlp.experts.gate_up_proj"
    after = local_weights(result)
    assert all(torch.equal(after[k], before[k]) for k in after)


def test_wrappers_keep_the_user_names(files):
    """torch.compile's ``_orig_mod.`` and checkpoint_wrapper's ``_checkpoint_wrapped_module.`` are
    not part of the names in the file."""
    from safetensors.torch import load_file
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = llama(False, seed=1)
    model.model.layers[0] = checkpoint_wrapper(model.model.layers[0])
    wrapped = SimpleNamespace(model=torch.compile(model, backend="eager"), optim=None)
    assert atorch.load_pretrained(files["llama"], wrapped) == atorch.LoadResult([], [])
    saved = {}
    for file in set(read_index(files["llama"]).values()):
        saved.update(load_file(os.path.join(files["llama"], file)))
    loaded = {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in model.state_dict().items()}
    assert sorted(loaded) == sorted(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)


@pytest.fixture
def plain(tmp_path) -> tuple[Any, dict[str, torch.Tensor]]:
    """A seed-1 model in one process, and the state of the seed-0 file as a dict."""
    from safetensors.torch import load_file

    directory = str(tmp_path / "saved")
    save_model(directory, "llama")
    state = {}
    for file in sorted(set(read_index(directory).values())):
        state.update(load_file(os.path.join(directory, file)))
    return accelerate(llama(False, seed=1), []), state


def single_file(directory: str, state: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file

    os.makedirs(directory)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(directory, "model.safetensors"))
    return directory


@pytest.mark.parametrize("change, key", [
    ("missing", "model.norm.weight"),
    ("unexpected", "model.extra.weight"),
    ("misshapen", "model.norm.weight"),
    ("integer", "model.norm.weight"),
])
def test_a_key_that_does_not_fit_is_refused_before_any_weight_changes(plain, tmp_path, change, key):
    result, state = plain
    state = dict(state)
    if change == "missing":
        del state[key]
    else:
        state[key] = {"unexpected": torch.ones(2), "misshapen": torch.ones(31),
                      "integer": torch.ones(32, dtype=torch.int64)}[change]
    before = local_weights(result)
    with pytest.raises(CheckpointError) as caught:
        atorch.load_pretrained(single_file(str(tmp_path / change), state), result)
    assert caught.value.key == key and key in str(caught.value)
    after = local_weights(result)
    assert all(torch.equal(after[k], before[k]) for k in after)


def test_not_strict_loads_what_fits_and_returns_the_rest(plain, tmp_path):
    result, state = plain
    state = dict(state)
    del state["model.norm.weight"]
    state["model.extra.weight"] = torch.ones(2)
    before = local_weights(result)
    loaded = atorch.load_pretrained(single_file(str(tmp_path / "partial"), state), result, strict=False)
    assert loaded == atorch.LoadResult(missing_keys=["model.norm.weight"], unexpected_keys=["model.extra.weight"])
    after = local_weights(result)
    assert torch.equal(after["model.norm.weight"], before["model.norm.weight"])
    assert all(torch.equal(after[k], state[k]) for k in after if k != "model.norm.weight")


def test_a_narrower_float_is_cast(plain, tmp_path):
    result, state = plain
    half = {k: v.to(torch.bfloat16) for k, v in state.items()}
    atorch.load_pretrained(single_file(str(tmp_path / "bf16"), half), result)
    after = local_weights(result)
    assert all(after[k].dtype == torch.float32 and torch.equal(after[k], half[k].float()) for k in after)


def test_broken_files_name_the_file(tmp_path, files):
    result = accelerate(llama(False, seed=1), [])
    index = read_index(files["llama"])
    truncated = copy_dir(files["llama"], str(tmp_path / "truncated"))
    truncate(os.path.join(truncated, index[LAST_LAYER_KEY]))
    lost = copy_dir(files["llama"], str(tmp_path / "lost"))
    os.remove(os.path.join(lost, index[LAST_LAYER_KEY]))
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    pickled = str(tmp_path / "pickled")
    os.makedirs(pickled)
    with open(os.path.join(pickled, "pytorch_model.bin"), "wb") as handle:
        handle.write(b"never unpickled")
    expected = {  # path -> what the error names
        truncated: os.path.join(truncated, index[LAST_LAYER_KEY]),
        lost: os.path.join(lost, index[LAST_LAYER_KEY]),
        empty: empty,
        pickled: pickled,
        str(tmp_path / "nowhere"): str(tmp_path / "nowhere"),
    }
    before, messages = local_weights(result), {}
    for path, named in expected.items():
        with pytest.raises(CheckpointError) as caught:
            atorch.load_pretrained(path, result)
        assert caught.value.key == named and named in str(caught.value), (path, str(caught.value))
        messages[path] = str(caught.value)
    assert "pytorch_model.bin, a pickle" in messages[pickled] and "truncated" in messages[truncated]
    after = local_weights(result)
    assert all(torch.equal(after[k], before[k]) for k in after)
