"""How a pipeline's evaluation call merges its micro-batches' outputs and reads through to them
(atorch/auto/opt_lib/eval_outputs.py, PipelineOutput); the two-rank runs are in test_model_parallel.py."""
import pytest
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from atorch.auto.opt_lib.eval_outputs import MicroOutputs, merge_micro_outputs
from atorch.auto.opt_lib.pipeline_parallel import PipelineOutput
from atorch.errors import MethodConfigError


def test_micro_batch_outputs_merge_into_the_whole_batch_s():
    """Rows concatenate in micro-batch order, a scalar is the micro-batches' mean weighted by their items,
    a tensor the rows share and a non-tensor leaf are the first micro-batch's."""
    mask = torch.ones(5, 5)
    outputs = [{"logits": torch.full((2, 3), 1.0), "loss": torch.tensor(1.0), "mask": mask, "note": None},
               {"logits": torch.full((2, 3), 2.0), "loss": torch.tensor(4.0), "mask": mask * 2, "note": None}]
    merged = merge_micro_outputs(outputs, rows=[2, 2], weights=[3.0, 1.0])
    assert torch.equal(merged["logits"], torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)]))
    assert merged["loss"].item() == pytest.approx((3 * 1.0 + 1 * 4.0) / 4)
    assert merged["mask"] is mask and merged["note"] is None


def test_micro_outputs_come_back_in_row_order_and_hf_outputs_keep_their_class():
    """Kept out of order (a schedule's last stage may run them so) and one kept twice (the later replaces
    it): merged by the micro-batch's first row; weighted by rows without loss items."""
    kept = MicroOutputs()
    kept.begin(collecting=True)
    for first, value, loss in ((2, 2.0, 3.0), (0, 0.0, 9.0), (0, 1.0, 1.0)):
        kept.keep(first, CausalLMOutputWithPast(loss=torch.tensor(loss), logits=torch.full((2, 4), value)), 2)
    merged = kept.merged()
    assert isinstance(merged, CausalLMOutputWithPast)
    assert merged.logits[:, 0].tolist() == [1.0, 1.0, 2.0, 2.0]
    assert merged.loss.item() == pytest.approx(2.0)
    idle = MicroOutputs()
    idle.begin(collecting=False)
    idle.keep(0, torch.ones(2), 2)
    assert idle.chunks == {}


def test_outputs_of_different_structure_are_refused_by_name():
    with pytest.raises(MethodConfigError, match="different structure.*eval_outputs=False"):
        merge_micro_outputs([{"a": torch.ones(1)}, {"b": torch.ones(1)}], rows=[1, 1], weights=[1.0, 1.0])


def test_a_pipeline_output_reads_through_to_the_model_s_output():
    logits = torch.tensor([[0.1, 2.0], [3.0, 0.5]])
    hf = PipelineOutput(torch.tensor(0.7), CausalLMOutputWithPast(loss=torch.tensor(0.5), logits=logits))
    assert hf.loss.item() == pytest.approx(0.7)  # the pipeline's loss, not the merged scalar
    assert hf.logits is logits and hf["logits"] is logits and list(hf.keys()) == ["loss", "logits"]
    plain = PipelineOutput(torch.tensor(0.0), logits)
    assert plain.argmax(-1).tolist() == [1, 0] and plain.shape == (2, 2)
    assert torch.equal(torch.softmax(plain, -1), torch.softmax(logits, -1))
    assert (plain.argmax(-1) == torch.tensor([1, 1])).tolist() == [True, False]
    assert torch.equal(torch.tensor([1, 1]) == plain.argmax(-1), torch.tensor([True, False]))
    tuple_output = PipelineOutput(torch.tensor(0.0), (logits, torch.tensor(0.25)))
    first, second = tuple_output
    assert first is logits and second.item() == 0.25 and len(tuple_output) == 2


def test_a_training_call_s_output_says_why_it_holds_the_loss_only():
    spent = PipelineOutput(torch.tensor(1.0))
    with pytest.raises(AttributeError, match="training call returns the step's loss only"):
        spent.logits
    with pytest.raises(TypeError, match="cannot be indexed"):
        spent["logits"]
    with pytest.raises(TypeError, match="cannot be unpacked"):
        logits, loss = spent
    with pytest.raises(TypeError, match="softmax takes tensors"):
        torch.softmax(PipelineOutput(torch.tensor(0.0), {"logits": torch.ones(2)}), -1)
