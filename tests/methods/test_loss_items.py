"""loss_items: a loss averaged over labelled tokens trains as one process on the global batch does.

SFT rows of different lengths, padded, their prompts and pads labelled -100: HF Llama's loss is the
mean over the labelled tokens of the batch it sees. Under data parallelism and micro-batches each piece
averages its own tokens and the pieces are averaged alike, which is another objective: without
``loss_items`` the final weights after 3 steps differ from one process's by about 1e-2 (and atorch warns,
naming the option); with ``loss_items="next_token_labels"`` they match within 1e-6 (fp32) under fsdp,
a 2-stage pipeline, micro_batch under DDP, DeepSpeed ZeRO-2 and ds_3d_parallel, all in one 2-rank launch,
and on 4 ranks under pipeline 2 x data 2 and tensor 2 x data 2 with zero1.
A pipeline reports the item mean of its micro-batches, which is one process's loss on the same rows.
A loss summed over the batch (``reduction="sum"``) trains as one process's with ``loss_items="sum"``
(before: the averaging scaled its gradient by 1 / the pieces)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from atorch.auto.accelerate import auto_accelerate
from atorch.auto.loss_items import PRESETS, item_weighted, resolve_loss_items
from atorch.auto.opt_lib.deepspeed_zero import deepspeed_unavailable_reason
from atorch.errors import InputError
from atorch.testing import run_distributed
from atorch.testing.hf_models import tiny_llama
from atorch.testing.training import train_returned, weight_difference
from atorch.utils.modules import full_state_dict

STEPS, GLOBAL_BATCH, TOLERANCE = 3, 4, 1e-6
HAS_DEEPSPEED = deepspeed_unavailable_reason() is None
PIPELINE_2 = [["parallel_mode", [[["pipeline", 2]], None]], ["pipeline_parallel", None]]
CASES = {  # name: (strategy, loss_items)
    "fsdp": ([["parallel_mode", None], ["fsdp", None]], "next_token_labels"),
    "pipeline": (PIPELINE_2, "next_token_labels"),
    "micro_batch_ddp": ([["parallel_mode", None], ["micro_batch", 2]], "next_token_labels"),
    "fsdp_unweighted": ([["parallel_mode", None], ["fsdp", None]], None),
    "pipeline_unweighted": (PIPELINE_2, None),
    "fsdp_sum": ([["parallel_mode", None], ["fsdp", None]], "sum"),
    "pipeline_sum": (PIPELINE_2, "sum"),
    "micro_batch_ddp_sum": ([["parallel_mode", None], ["micro_batch", 2]], "sum"),
    "fsdp_sum_unweighted": ([["parallel_mode", None], ["fsdp", None]], None, "sum"),
}
if HAS_DEEPSPEED:
    CASES["ds_zero2"] = ([["parallel_mode", None], ["zero2", {"use_ds_zero": True}]], "next_token_labels")
    CASES["ds_3d_parallel"] = ([["parallel_mode", [[["pipeline", 2]], None]], ["ds_3d_parallel", None]],
                               "next_token_labels")


def sft_rows(count: int = STEPS * GLOBAL_BATCH) -> list[torch.Tensor]:
    """Token rows of 5 to 16 tokens (different lengths, as SFT samples are)."""
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(5, 17, (count,), generator=generator)
    return [torch.randint(1, 64, (int(length),), generator=generator) for length in lengths]


def pad_to_longest(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A collator's padding: pads and each row's first two tokens (its "prompt") labelled -100."""
    longest = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    labels = torch.full((len(rows), longest), -100)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
        labels[i, 2:len(row)] = row[2:]
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def hf_loss(batch: dict, output) -> torch.Tensor:
    return output.loss


def summed_loss(batch: dict, output) -> torch.Tensor:
    """The next-token cross-entropy summed over the batch's labelled tokens."""
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1), reduction="sum")


LOSSES = {"mean": (hf_loss, 0.5), "sum": (summed_loss, 0.01)}  # loss, learning rate


def accelerated(strategy, loss_items, loss: str = "mean"):
    torch.manual_seed(0)
    kwargs = {} if loss_items is None else {"loss_items": loss_items}
    loss_func, lr = LOSSES["sum" if loss_items == "sum" else loss]
    _, result, _ = auto_accelerate(tiny_llama(), torch.optim.SGD, sft_rows(), loss_func, optim_args={"lr": lr},
                                   dataloader_args={"batch_size": GLOBAL_BATCH, "collate_fn": pad_to_longest},
                                   model_input_format="unpack_dict", load_strategy=strategy, **kwargs)
    return result


def train_cases(cases: dict) -> dict:
    """On each rank: every case's losses, warnings and (rank 0) final weights."""
    out = {}
    for name, (strategy, loss_items, *loss) in cases.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = accelerated(strategy, loss_items, *loss)
            losses = train_returned(result, STEPS, "unpack_dict")
        model = result.model
        weights = model.full_state_dict() if hasattr(model, "full_state_dict") else full_state_dict(model)
        out[name] = {"losses": losses, "weights": {k: v.detach().float().cpu() for k, v in weights.items()},
                     "warned": [str(w.message) for w in caught if "loss_items" in str(w.message)]}
    return out


def one_process(loss: str = "mean") -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = tiny_llama()
    loss_func, lr = LOSSES[loss]
    optim = torch.optim.SGD(model.parameters(), lr=lr)
    rows, losses = sft_rows(), []
    for step in range(STEPS):
        batch = pad_to_longest(rows[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH])
        loss = loss_func(batch, model(**batch))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().float() for k, v in model.state_dict().items()}


FOUR_RANK_CASES = {  # the data dimension beside a pipeline and tensor parallelism
    "pipeline_x_data": ([["parallel_mode", [[["pipeline", 2], ["data", 2]], None]], ["pipeline_parallel", None]],
                        "next_token_labels"),
    "tensor_x_data_zero1": ([["parallel_mode", [[["tensor", 2], ["data", 2]], None]], ["tensor_parallel", None],
                             ["zero1", None]], "next_token_labels"),
}


@pytest.fixture(scope="module")
def four_rank_runs() -> dict:
    return run_distributed(train_cases, 4, FOUR_RANK_CASES, timeout_s=420)[0]


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(FOUR_RANK_CASES))
def test_weighted_by_items_beside_model_parallelism_trains_as_one_process(four_rank_runs, reference, name):
    run = four_rank_runs[name]
    difference = _difference(run, reference[1])
    assert difference < TOLERANCE, f"{name}: final weights differ from one process's by {difference:.2e}"


@pytest.fixture(scope="module")
def two_rank_runs() -> dict:
    return run_distributed(train_cases, 2, CASES, timeout_s=420)[0]


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict]:
    return one_process()


@pytest.fixture(scope="module")
def summed_reference() -> tuple[list[float], dict]:
    return one_process("sum")


def _difference(run: dict, reference: dict) -> float:
    return weight_difference({k: run["weights"][k] for k in reference}, reference)


@pytest.mark.multirank
@pytest.mark.parametrize("name", [n for n, (_, items, *_) in CASES.items() if items is not None])
def test_weighted_by_items_trains_as_one_process(two_rank_runs, reference, summed_reference, name):
    run = two_rank_runs[name]
    difference = _difference(run, (summed_reference if CASES[name][1] == "sum" else reference)[1])
    assert difference < TOLERANCE, f"{name}: final weights differ from one process's by {difference:.2e}"
    assert not run["warned"], run["warned"]


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["fsdp_unweighted", "pipeline_unweighted"])
def test_without_loss_items_the_pieces_weigh_alike_and_atorch_warns(two_rank_runs, reference, name):
    run = two_rank_runs[name]
    difference = _difference(run, reference[1])
    assert difference > 1e-3, f"{name}: the unweighted run matched one process ({difference:.2e}): no test"
    assert len(run["warned"]) == 1 and "loss_items='next_token_labels'" in run["warned"][0], run["warned"]


@pytest.mark.multirank
def test_a_pipeline_reports_one_process_loss(two_rank_runs, reference, summed_reference):
    """No data dimension: the rank's rows are the global batch, so the item mean of its micro-batches (a
    sum's: their sum) is one process's loss; the weights match, so every step's does."""
    assert two_rank_runs["pipeline"]["losses"] == pytest.approx(reference[0], rel=1e-5, abs=0)
    assert two_rank_runs["pipeline_sum"]["losses"] == pytest.approx(summed_reference[0], rel=1e-5, abs=0)


@pytest.mark.multirank
def test_a_summed_loss_without_loss_items_is_scaled_by_the_averaging(two_rank_runs, summed_reference):
    """DDP's behaviour: the ranks' sums averaged, half one process's gradient on 2 ranks (no warning: a
    sum's pieces are not told from a mean's)."""
    difference = _difference(two_rank_runs["fsdp_sum_unweighted"], summed_reference[1])
    assert difference > 1e-3, f"the unweighted summed run matched one process ({difference:.2e}): no test"


def test_bad_loss_items_are_input_errors():
    with pytest.raises(InputError, match=r"loss_items='tokens' is not valid; choose one of \['labels', "
                                         r"'next_token_labels', 'sum'\]"):
        resolve_loss_items("tokens")
    with pytest.raises(InputError, match="loss_items must be one of"):
        resolve_loss_items(3)
    with pytest.raises(InputError, match="non-negative number, got -1"):
        resolve_loss_items(lambda batch: -1).count({}, torch.device("cpu"))
    with pytest.raises(InputError, match="raised KeyError"):
        resolve_loss_items(lambda batch: batch["mask"].sum()).count({}, torch.device("cpu"))


def test_a_preset_finds_no_labels_before_anything_is_applied():
    rows = [torch.randint(1, 64, (12,)) for _ in range(4)]
    with pytest.raises(InputError, match="'labels' tensor, but the batch"):
        auto_accelerate(tiny_llama(), torch.optim.SGD, rows, lambda batch, output: output.logits.mean(),
                        optim_args={"lr": 0.1}, dataloader_args={"batch_size": 2}, load_strategy=["parallel_mode"],
                        loss_items="labels")


def test_the_presets_count_labelled_tokens():
    batch = pad_to_longest([torch.arange(1, 6), torch.arange(1, 9)])  # labelled: 3 and 6 tokens
    assert PRESETS["labels"](batch) == 9
    assert PRESETS["next_token_labels"](batch) == 9  # the first label is -100 anyway: the shift drops nothing
    batch["labels"][:, 0] = 1
    assert PRESETS["labels"](batch) == 11 and PRESETS["next_token_labels"](batch) == 9


def test_item_weighted_keeps_the_value_and_scales_the_gradient():
    weight = torch.tensor(2.0, requires_grad=True)
    loss = weight * 3
    weighted = item_weighted(loss, 0.25)
    weighted.backward()
    assert float(weighted) == 6.0 and float(weight.grad) == pytest.approx(0.75)


def test_one_process_with_loss_items_trains_unchanged():
    """One process has no pieces: loss_items changes nothing (no wrapper, no warning)."""
    result = accelerated(["parallel_mode"], "next_token_labels")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        losses = train_returned(result, STEPS, "unpack_dict")
    assert losses == pytest.approx(one_process()[0], rel=1e-6)
