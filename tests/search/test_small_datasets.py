"""The fully automatic mode on a dataset of fewer batches than its measurements take steps (a small
fine-tuning set): every dry run and every piece measurement reads the dataset again when an epoch ends,
so the search completes and picks a measured candidate instead of failing every one of them."""
from __future__ import annotations

import torch

from atorch.auto.accelerate import auto_accelerate
from atorch.models import GPTConfig, SyntheticTokenDataset, gpt_loss
from atorch.testing.training import build_gpt


def test_a_dataset_of_two_batches_is_read_again_by_every_measurement(tmp_path):
    config = GPTConfig(vocab_size=256, block_size=32, n_layer=3, n_head=2, n_embd=32)
    dataset = SyntheticTokenDataset(16, config.block_size, config.vocab_size)  # two batches of 8
    status, result, strategy = auto_accelerate(
        build_gpt(0, config), torch.optim.AdamW, dataset, gpt_loss, optim_args={"lr": 1e-3},
        dataloader_args={"batch_size": 8}, model_input_format="unpack_dict", report_dir=str(tmp_path),
        use_profile_cache=False, excluded=["native_dynamo"])
    assert status, "the search failed on a two-batch dataset"
    search = result.args.extras["search"]
    dry_runs = [row for row in search.rows if row.measured_memory]
    assert dry_runs and all(row.status.startswith("ok") for row in dry_runs), search.table
    assert "(failed)" not in search.table, search.table  # the block pieces were measured, not given up
    batch = next(iter(result.dataloader))
    loss = gpt_loss(batch, result.model(**batch))
    loss.backward()
    assert torch.isfinite(loss)


def test_rows_of_different_lengths_are_batched_by_the_user_s_collate_fn(tmp_path):
    """SFT rows of 5-16 tokens padded by the script's collate_fn: the search's own sample batch (its model
    analysis) is collated as training batches are (before: default_collate, "stack expects each tensor to be
    equal size", raised out of auto_accelerate)."""
    from atorch.testing.hf_models import tiny_llama
    from tests.methods.test_loss_items import hf_loss, pad_to_longest, sft_rows

    torch.manual_seed(0)
    status, result, _ = auto_accelerate(
        tiny_llama(), torch.optim.SGD, sft_rows(), hf_loss, optim_args={"lr": 0.1},
        dataloader_args={"batch_size": 4, "collate_fn": pad_to_longest}, model_input_format="unpack_dict",
        report_dir=str(tmp_path), use_profile_cache=False, excluded=["native_dynamo"], loss_items="next_token_labels")
    assert status, "the search failed on padded rows"
    batch = next(iter(result.dataloader))
    loss = result.loss_func(batch, result.model(**batch))
    loss.backward()
    assert torch.isfinite(loss)
