"""export_model: Hugging Face's save_pretrained layout, streamed to process 0 a tensor at a time.

One 2-process launch trains every case in turn (a tiny Llama under fsdp, tensor_parallel and
pipeline_parallel, a tied-embedding Llama under fsdp, a plain nn.Module with tied weights and
int64 / bf16 buffers under fsdp), exports it with ``max_shard_size="20KB"`` (the models are 6-8x
that) and reports the full trained weights (``full_state_dict``, gathered in the test only) and
each rank's ``last_export_record``. The parent process then loads each export with
``from_pretrained`` or ``load_exported``: the weights are exactly the trained ones (difference 0),
the layout is HF's (index, several shards, the tied weight once), and no rank held more than one
shard (or one larger tensor) beyond its own part of the model. Single-process tests cover
``max_shard_size`` parsing, the single-file layout and replacing a directory.
"""
from __future__ import annotations

import datetime
import json
import os
import pickle
import types

import pytest
import safetensors
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import atorch
from atorch.checkpoint.export import INDEX_FILE, SINGLE_FILE, last_export_record, load_exported, parse_size
from atorch.checkpoint.tensors import model_tensors
from atorch.errors import CheckpointError
from atorch.testing import run_distributed
from atorch.testing.hf_models import _decoder_config, hf_loss, tiny_llama, token_dataset
from atorch.testing.sequential import PairDataset, pair_loss
from atorch.utils.modules import full_state_dict

transformers = pytest.importorskip("transformers")

SHARD = "20KB"
SHARD_BYTES = 20_000
TP2 = ("parallel_mode", ([("tensor", 2)], None))
PP2 = ("parallel_mode", ([("pipeline", 2)], None))
PIPE = ("pipeline_parallel", {"num_micro_batch": 4})


def tied_llama() -> nn.Module:
    config = _decoder_config("LlamaConfig")
    config.tie_word_embeddings = True
    return transformers.LlamaForCausalLM._from_config(config)


class PlainTied(nn.Module):
    """Not a Hugging Face model: a tied weight, an int64 and a bf16 persistent buffer, a
    non-persistent one (not exported, as state_dict() leaves it out)."""

    def __init__(self):
        super().__init__()
        self.encode = nn.Linear(16, 64, bias=False)
        self.body = nn.Sequential(*[layer for _ in range(5) for layer in (nn.Linear(64, 64), nn.Tanh())],
                                  nn.Linear(64, 16))
        self.decode = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scale", torch.full((4,), 0.5, dtype=torch.bfloat16))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)
        self.tied = self.encode  # the same module under a second name: every weight of it is tied

    def forward(self, batch):
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        self.steps += 1
        return self.head(self.decode(self.body(self.encode(x)))) * self.scale.float()


# name: (builder, strategy)
CASES = {
    "llama-ddp": (tiny_llama, ["parallel_mode"]),
    "llama-fsdp": (tiny_llama, ["fsdp"]),
    "llama-tied-fsdp": (tied_llama, ["fsdp"]),
    "llama-tp": (tiny_llama, [TP2, "tensor_parallel"]),
    "llama-pp": (tiny_llama, [PP2, PIPE]),
    "plain-fsdp": (PlainTied, ["fsdp"]),
}
HF_CASES = [name for name in CASES if name.startswith("llama")]


def _train(build, strategy, steps: int = 2):
    torch.manual_seed(0)
    model = build()
    hf = hasattr(model, "config")
    dataset = token_dataset(8 * steps) if hf else PairDataset(8 * steps)
    status, result, _ = atorch.auto_accelerate(
        model, torch.optim.AdamW, dataset, hf_loss if hf else pair_loss, optim_args={"lr": 1e-2},
        model_input_format="unpack_dict" if hf else None, dataloader_args={"batch_size": 8}, load_strategy=strategy)
    assert status
    for batch in result.dataloader:
        batch = result.prepare_input(batch)
        output = result.model(**batch) if hf else result.model(batch)
        loss = result.loss_func(batch, output)
        result.optim.backward(loss) if result.args.use_optim_backward else loss.backward()
        result.optim.step()
        result.optim.zero_grad()
    return result


def _own_bytes(model) -> int:
    """Bytes of this rank's part of the model (its DTensor shards, its pipeline stages' tensors)."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in model_tensors(model).values())


def export_cases(root: str) -> dict:
    """On every rank: train each case, export it; every rank returns its export record, rank 0 the
    trained weights too. Last, an export process 0 cannot write."""
    rank0 = dist.get_rank() == 0
    out = {}
    for name, (build, strategy) in CASES.items():
        result = _train(build, strategy)
        weights = full_state_dict(result.model)
        written = atorch.export_model(result, os.path.join(root, name), max_shard_size=SHARD)
        record = last_export_record()
        out[name] = {"written": written, "peak": record.peak_bytes, "own": _own_bytes(result.model),
                     "total": record.total_bytes, "largest": record.largest_tensor_bytes,
                     "limit": record.max_shard_bytes, "weights": weights if rank0 else None}
        if name in HF_CASES:  # the HF script's own last line, on every process
            result.model.save_pretrained(os.path.join(root, f"{name}-save_pretrained"), is_main_process=rank0,
                                         max_shard_size=SHARD)
            out[name]["refused"] = _refusals(result)
    out["alone"] = _saved_by_process_0_alone(_train(tiny_llama, ["fsdp"]), root)
    blocker = os.path.join(root, "a-file")
    if rank0:
        open(blocker, "w").close()
    dist.barrier()
    try:  # process 0 cannot create the directory under a file: every process raises its error
        atorch.export_model(result, os.path.join(blocker, "export"), max_shard_size=SHARD)
        out["unwritable"] = "no error"
    except CheckpointError as error:
        out["unwritable"] = f"{type(error).__name__}: {error}"
    return out


def _refusals(result) -> dict:
    """What save_pretrained refuses over several processes, and what DDP reads through to the model."""
    out = {}
    try:
        result.model.save_pretrained("unused", push_to_hub=True)
    except CheckpointError as error:
        out["push_to_hub"] = f"{type(error).__name__}: {error}"
    try:  # a pickled copy of the model (torch.save(result.model)) cannot export: it says what to call
        pickle.loads(pickle.dumps(result.model.save_pretrained))("unused")
    except CheckpointError as error:
        out["copy"] = str(error)
    if isinstance(result.model, torch.nn.parallel.DistributedDataParallel):
        out["config"] = result.model.config is result.model.module.config
        try:
            result.model.generate
        except AttributeError as error:
            out["generate"] = str(error)
    return out


def _saved_by_process_0_alone(result, root: str) -> str:
    """``if rank == 0: model.save_pretrained(out)``: process 0 is told the call is collective instead of
    waiting out the collective timeout (here a 3 s wait for the others)."""
    from atorch.checkpoint import save_pretrained as module

    module.ARRIVAL_TIMEOUT, before = datetime.timedelta(seconds=3), module.ARRIVAL_TIMEOUT
    try:
        if dist.get_rank() == 0:
            result.model.save_pretrained(os.path.join(root, "alone"))
        return "saved"
    except CheckpointError as error:
        return f"{type(error).__name__}: {error}"
    finally:
        module.ARRIVAL_TIMEOUT = before
        dist.barrier()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("exports"))
    return root, run_distributed(export_cases, 2, root, timeout_s=600)


def _stored(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor in the export's safetensors files, as stored (no aliases added)."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safetensors.safe_open(os.path.join(directory, name), framework="pt") as handle:
                out.update({key: handle.get_tensor(key) for key in handle.keys()})
    return out


def _assert_equal(state: dict, reference: dict) -> None:
    assert state.keys() == reference.keys(), sorted(set(state) ^ set(reference))
    for name, tensor in state.items():
        assert tensor.dtype == reference[name].dtype, (name, tensor.dtype, reference[name].dtype)
        assert torch.equal(tensor, reference[name]), name


@pytest.mark.multirank
@pytest.mark.parametrize("name", HF_CASES)
def test_an_hf_export_loads_with_from_pretrained_as_trained(exported, name):
    root, ranks = exported
    directory = os.path.join(root, name)
    assert ranks[0][name]["written"] == ranks[1][name]["written"] == directory
    model, info = transformers.LlamaForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    trained = ranks[0][name]["weights"]
    _assert_equal({k: v.float() for k, v in model.state_dict().items()}, trained)
    assert os.path.exists(os.path.join(directory, "config.json"))
    assert os.path.exists(os.path.join(directory, "generation_config.json"))


@pytest.mark.multirank
@pytest.mark.parametrize("name", HF_CASES)
def test_the_model_s_own_save_pretrained_writes_the_export_on_every_strategy(exported, name):
    """``result.model.save_pretrained(out, is_main_process=rank == 0)`` on every process: transformers'
    own hung over DTensor shards (fsdp, tensor_parallel) and DDP or a pipeline stage had none; it writes
    what export_model writes, and loads with from_pretrained as trained."""
    root, ranks = exported
    directory = os.path.join(root, f"{name}-save_pretrained")
    assert _stored(directory).keys() == _stored(os.path.join(root, name)).keys()
    model = transformers.LlamaForCausalLM.from_pretrained(directory)
    _assert_equal({k: v.float() for k, v in model.state_dict().items()}, ranks[0][name]["weights"])
    for per_rank in ranks:
        refused = per_rank[name]["refused"]
        assert refused["push_to_hub"].startswith("CheckpointError: save_pretrained over several processes"), refused
        assert "['push_to_hub']" in refused["push_to_hub"]
        assert "type(model).save_pretrained(model, ...)" in refused["copy"], refused
        if name == "llama-ddp":  # values read through DDP; a method is refused with where to call it
            assert refused["config"] is True
            assert "result.model.module.generate(...)" in refused["generate"], refused


@pytest.mark.multirank
def test_save_pretrained_from_process_0_alone_says_it_is_collective(exported):
    _, ranks = exported
    assert ranks[0]["alone"].startswith("CheckpointError: save_pretrained is collective") and "[1]" in ranks[0]["alone"]
    assert ranks[1]["alone"] == "saved"  # process 1 never called it


@pytest.mark.multirank
@pytest.mark.parametrize("name", HF_CASES)
def test_an_hf_export_has_hf_sharded_layout(exported, name):
    root, _ = exported
    directory = os.path.join(root, name)
    with open(os.path.join(directory, INDEX_FILE)) as handle:
        index = json.load(handle)
    shards = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    assert len(shards) >= 4 and SINGLE_FILE not in shards
    assert set(index["weight_map"].values()) == set(shards)
    assert all(n == f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i, n in enumerate(shards, 1))
    stored = _stored(directory)
    assert set(index["weight_map"]) == set(stored)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in stored.values())
    for shard in shards:  # each shard within the limit, unless one tensor alone exceeds it
        with safetensors.safe_open(os.path.join(directory, shard), framework="pt") as handle:
            sizes = [handle.get_tensor(k).nbytes for k in handle.keys()]
        assert sum(sizes) <= SHARD_BYTES or len(sizes) == 1, (shard, sizes)
    tied = name == "llama-tied-fsdp"
    assert "model.embed_tokens.weight" in stored
    assert ("lm_head.weight" in stored) is not tied  # a tied weight is stored once, under HF's kept name


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(CASES))
def test_no_rank_holds_more_than_one_shard_beyond_its_part(exported, name):
    _, ranks = exported
    for rank, out in enumerate(r[name] for r in ranks):
        assert out["limit"] == SHARD_BYTES and out["total"] >= 4 * SHARD_BYTES, out
        bound = max(out["limit"], out["largest"])
        print(f"{name} rank {rank}: held at most {out['peak']} B beyond its own {out['own']} B; shard bound "
              f"{bound} B, whole model {out['total']} B")
        assert out["peak"] <= bound, (rank, out)
        if name != "llama-ddp":  # DDP holds the whole model on every process by design
            assert out["own"] + out["peak"] < out["total"], (rank, out)  # never the whole model
    assert ranks[0][name]["peak"] >= ranks[0][name]["largest"]  # process 0 did hold each tensor


@pytest.mark.multirank
def test_a_plain_model_export_reads_back_with_load_exported(exported):
    root, ranks = exported
    directory = os.path.join(root, "plain-fsdp")
    assert not os.path.exists(os.path.join(directory, "config.json"))
    assert os.path.exists(os.path.join(directory, INDEX_FILE))
    state = load_exported(directory)
    model = PlainTied()
    model.load_state_dict(state, strict=True)  # the tied names come back too
    assert "scratch" not in state and state["tied.weight"] is state["encode.weight"]
    assert state["steps"].dtype == torch.int64 and state["scale"].dtype == torch.bfloat16
    assert state["steps"].item() == 2  # persistent buffers as trained
    assert "tied.weight" not in _stored(directory)  # written once
    _assert_equal({k: v.float() for k, v in state.items()}, ranks[0]["plain-fsdp"]["weights"])


@pytest.mark.multirank
def test_a_write_failing_on_process_0_raises_on_every_process(exported):
    _, ranks = exported
    errors = [r["unwritable"] for r in ranks]
    assert errors[0] == errors[1] and errors[0].startswith("CheckpointError: export_model: writing"), errors


# --- one process -----------------------------------------------------------------------------------
def test_max_shard_size_reads_like_hugging_face():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 500 * 10**6 and parse_size("20KB") == 20_000
    assert parse_size("1GiB") == 2**30 and parse_size(1234) == 1234 and parse_size("2.5kb") == 2500
    for bad in ("5 parsecs", "", "-1GB", 0, -5, 1.5, None, True):
        with pytest.raises(CheckpointError, match="max_shard_size"):
            parse_size(bad)


def _plain_result() -> types.SimpleNamespace:
    torch.manual_seed(0)
    return types.SimpleNamespace(model=PlainTied())  # export_model reads result.model only


def test_a_model_that_fits_one_shard_is_one_file_with_its_tied_names(tmp_path):
    result = _plain_result()
    written = atorch.export_model(result, tmp_path / "export")
    assert sorted(os.listdir(written)) == [SINGLE_FILE]
    state = load_exported(written)
    _assert_equal(state, result.model.state_dict())
    assert state["tied.weight"] is state["encode.weight"]


def test_an_export_replaces_an_earlier_one_but_nothing_else(tmp_path):
    result = _plain_result()
    target = tmp_path / "export"
    atorch.export_model(result, target, max_shard_size="4KB")
    assert len(os.listdir(target)) > 2
    atorch.export_model(result, target)  # fewer, larger shards: the old files go
    assert sorted(os.listdir(target)) == [SINGLE_FILE]
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    with pytest.raises(CheckpointError, match="refusing to replace"):
        atorch.export_model(result, other)
    assert sorted(os.listdir(other)) == ["notes.txt"]
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]  # no temporary directory left
