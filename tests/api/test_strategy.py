"""Strategy: the sequence API, pickle / JSON / bytes / path round trips, and the safe unpickler."""
import os
import pickle

import pytest
import torch

from atorch.auto.strategy import Strategy
from atorch.errors import StrategyError, StrategyFileError, UnsafeStrategyError
from atorch.models.gpt import GPTBlock

STRATEGY = Strategy([
    ("parallel_mode", ([("tensor", 2), ("data", 2)], None)),
    ("amp_native", {"dtype": torch.bfloat16, "skip_if_nonfinite": True}),
    "half",
    ("checkpoint", {"wrap_class": (GPTBlock, "MLP"), "no_reentrant": False}),
])


def test_sequence_api_and_readable_str():
    assert len(STRATEGY) == 4
    assert STRATEGY[0].name == "parallel_mode" and STRATEGY[2].config is None and STRATEGY[2].tunable
    assert not STRATEGY[1].tunable  # a given config is not tunable unless said so
    assert [item.name for item in STRATEGY] == ["parallel_mode", "amp_native", "half", "checkpoint"]
    assert "amp_native" in STRATEGY and "fsdp" not in STRATEGY
    text = str(STRATEGY)
    assert ("1. amp_native: {'dtype': torch.bfloat16" in text and "GPTBlock" in text
            and "2. half: default (tunable)" in text)
    assert Strategy(["half"]) != Strategy([("half", "bf16")])


@pytest.mark.parametrize("suffix", [".pkl", ".strategy", ".json"])
def test_round_trip_through_files(tmp_path, suffix):
    path = tmp_path / f"s{suffix}"
    STRATEGY.save(path)
    assert Strategy.load(path) == STRATEGY
    assert Strategy.from_any(str(path)) == STRATEGY
    if suffix == ".json":
        assert '"__dtype__": "bfloat16"' in path.read_text()
    else:  # the seed's format: a plain pickle a user can read with pickle.loads
        assert pickle.loads(path.read_bytes()) == STRATEGY


def test_round_trip_bytes_and_lists():
    assert Strategy.from_any(STRATEGY.to_bytes()) == STRATEGY
    assert Strategy.from_any(STRATEGY) == STRATEGY
    assert Strategy.from_any([tuple(i) for i in STRATEGY]) == STRATEGY
    assert Strategy.from_json(STRATEGY.to_json()) == STRATEGY


def test_a_strategy_equals_the_list_it_was_loaded_from_normalised_as_loading_does():
    """ATorch's tests assert ``best_strategy == strategy``: the returned strategy holds each
    method's config dataclass, the list the user's forms (short forms, dicts, the seed's tuples)."""
    from atorch.auto.apply import resolve_strategy  # registers the methods' normalisation

    given = [("half", "bf16"), ("amp_native", {"dtype": torch.bfloat16}), ("checkpoint", ("GPTBlock",)), "micro_batch"]
    resolved = resolve_strategy(Strategy(given))  # one process: no distributed-only method to drop
    assert resolved[0].config != "bf16"  # a HalfConfig
    assert resolved == given and given == resolved and resolved == tuple(given) and resolved == Strategy(given)
    assert resolved == [("half", {"dtype": torch.bfloat16}), ("amp_native", {"dtype": torch.bfloat16}),
                        ("checkpoint", {"wrap_class": ("GPTBlock",)}), "micro_batch"]
    assert resolved != [("half", "fp16"), *given[1:]]                # another config
    assert resolved != given[::-1] and resolved != given[:-1]        # another order, a method fewer
    assert resolved != [*given[:-1], ("micro_batch", None, False)]         # another tunable flag
    assert Strategy(["half"]) == ["half"] and Strategy(["half"]) != "half" and Strategy(["half"]) != [3]
    assert Strategy([("no_such_method", {"a": 1})]) == [("no_such_method", {"a": 1})]  # compared as given


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo should-never-run > /dev/null",))


def test_pickle_that_would_run_code_is_refused(tmp_path):
    with pytest.raises(UnsafeStrategyError, match="posix.system"):
        Strategy.from_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(UnsafeStrategyError):
        Strategy.from_bytes(pickle.dumps(Strategy([("amp_native", {"dtype": _RunsCode()})])))
    # a REDUCE of an allowed class (calling a Module constructor) is refused too
    with pytest.raises(UnsafeStrategyError, match="call code"):
        Strategy.from_bytes(pickle.dumps(torch.nn.Identity, protocol=4)[:-1] + b"(tR.")
    evil = tmp_path / "evil.pkl"
    evil.write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(UnsafeStrategyError):
        Strategy.from_any(str(evil))


def test_bad_inputs_are_typed_errors(tmp_path):
    with pytest.raises(StrategyFileError, match="not found"):
        Strategy.from_any(str(tmp_path / "missing.pkl"))
    with pytest.raises(StrategyFileError):
        Strategy.from_bytes(b"not a pickle")
    with pytest.raises(StrategyError, match="must be a method name"):
        Strategy([42])
    with pytest.raises(StrategyError, match="load_strategy must be"):
        Strategy.from_any(3.5)
