"""Strategy files import nothing and saves are atomic (issue 14, reproductions 2 and 3).

- Loading resolves a class name only against modules already in ``sys.modules`` (plus Strategy,
  torch dtypes and set / frozenset), never imports: checked in fresh processes, so that "the module
  is not in sys.modules afterwards" means something.
- The classic ``__reduce__`` payloads are refused and run nothing (a marker file proves it).
- Empty and truncated pickles are StrategyFileErrors that say so.
- ``Strategy.save`` serialises first and replaces the file atomically; ``save_strategy_to_file``
  fails before the model is wrapped, on every rank together (1 and 2 ranks), and leaves the
  previous file byte-identical.
"""
from __future__ import annotations

import collections
import json
import os
import pickle
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import atorch.auto.strategy as strategy_module
import atorch.checkpoint.files as files_module
from atorch.auto.accelerate import auto_accelerate
from atorch.auto.strategy import Strategy
from atorch.errors import StrategyFileError, UnsafeStrategyError
from atorch.models import GPTBlock, SyntheticTokenDataset, gpt_loss
from atorch.testing import run_distributed
from atorch.testing.training import SMALL_GPT, build_gpt

ROOT = Path(__file__).resolve().parents[2]

GOOD = Strategy([
    ("amp_native", {"dtype": torch.bfloat16, "skip_if_nonfinite": True}),
    ("checkpoint", {"wrap_class": (GPTBlock, "MLP"), "no_reentrant": False}),
])


class Placeholder(nn.Module):
    """A module-level class whose global, in a pickle, the tests rewrite to another name."""


def _local_module_class() -> type:
    class Local(nn.Module):  # qualname _local_module_class.<locals>.Local: no file can name it
        pass

    return Local


# --- crafted files ----------------------------------------------------------------------------
def _json_naming(module: str, name: str) -> str:
    """A JSON strategy whose checkpoint config names ``module:name``."""
    config = {"wrap_class": {"__tuple__": [{"__class__": f"{module}:{name}"}]}}
    return json.dumps({"format": "atorch-strategy", "version": 1,
                       "methods": [{"name": "checkpoint", "config": config, "tunable": False}]})


def _pickle_naming(module: str, name: str) -> bytes:
    """A pickled Strategy (protocol 2: GLOBAL opcodes) whose checkpoint config names ``module.name``."""
    data = pickle.dumps(Strategy([("checkpoint", {"wrap_class": (Placeholder,)})]), protocol=2)
    placeholder = f"c{Placeholder.__module__}\nPlaceholder\n".encode()
    assert data.count(placeholder) == 1
    return data.replace(placeholder, f"c{module}\n{name}\n".encode())


def _stack_global(module: str, name: str) -> bytes:
    """A protocol 4 pickle of a bare global (STACK_GLOBAL)."""
    encoded = [part.encode() for part in (module, name)]
    return b"\x80\x04" + b"".join(b"\x8c" + bytes([len(p)]) + p for p in encoded) + b"\x93."


def _stack_global_strategy(module: str, name: str) -> bytes:
    """A protocol 4 pickled Strategy naming ``module.name`` (a dotted qualname allowed) in its
    checkpoint config; written without framing, so the names can be rewritten."""
    data = pickle._dumps(Strategy([("checkpoint", {"wrap_class": (Placeholder,)})]), protocol=4)
    old = b"\x94".join(b"\x8c" + bytes([len(p)]) + p for p in (Placeholder.__module__.encode(), b"Placeholder"))
    assert data.count(old) == 1 and data[2:3] == b"\x95"
    new = b"\x94".join(b"\x8c" + bytes([len(p)]) + p for p in (module.encode(), name.encode()))
    return data[:2] + data[11:].replace(old, new)  # drop the FRAME opcode: the frame length would be stale


def _unicode(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _reduce(module: str, name: str, args: bytes) -> bytes:
    """GLOBAL module.name, an argument tuple, REDUCE: the classic code-running pickle."""
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + args + b"R."


def _payloads(marker: str) -> dict[str, bytes]:
    """The five classic payloads; each would create ``marker`` if it ran."""
    command = _unicode(f"touch {marker}")
    code = _unicode(f"open({marker!r}, 'w').close()")
    return {
        "os.system": _reduce("os", "system", b"(" + command + b"t"),
        "subprocess.Popen": _reduce("subprocess", "Popen", b"((" + _unicode("touch") + _unicode(marker) + b"lt"),
        "builtins.eval": _reduce("builtins", "eval", b"(" + code + b"t"),
        "builtins.exec": _reduce("builtins", "exec", b"(" + code + b"t"),
        "posix.system": _reduce("posix", "system", b"(" + command + b"t"),
    }


class _Reduces:
    """An object whose pickle calls ``function(*args)`` when loaded."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


# --- loading imports nothing (fresh processes) ------------------------------------------------
_CHILD = r"""
import json, sys
import atorch
from atorch.auto.strategy import Strategy
from atorch.errors import UnsafeStrategyError
watched, directory = sys.argv[1], sys.argv[2]
report = {"before": watched in sys.modules, "outcomes": {}}
loads = {
    "json text": lambda: Strategy.from_json(open(directory + "/s.json").read()),
    "json file": lambda: Strategy.load(directory + "/s.json"),
    "pickle bytes": lambda: Strategy.from_bytes(open(directory + "/s.pkl", "rb").read()),
    "pickle file": lambda: Strategy.from_any(directory + "/s.pkl"),
    "bare global pickle": lambda: Strategy.from_bytes(open(directory + "/g.pkl", "rb").read()),
}
for label, load in loads.items():
    try:
        load()
        report["outcomes"][label] = ["loaded", ""]
    except UnsafeStrategyError as error:
        report["outcomes"][label] = ["UnsafeStrategyError", str(error)]
    except BaseException as error:  # SystemExit included: the module's main() ran
        report["outcomes"][label] = [type(error).__name__, str(error)]
report["after"] = watched in sys.modules
print("REPORT " + json.dumps(report))
"""


def _run_child(code: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, f"child exited with {done.returncode}:\n{done.stdout}\n{done.stderr}"
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, f"child printed no report:\n{done.stdout}\n{done.stderr}"
    return json.loads(lines[-1][len("REPORT "):])


@pytest.mark.parametrize("module, name, watched", [
    ("torch.utils.model_dump.__main__", "main", "torch.utils.model_dump.__main__"),  # sys.exit(main(sys.argv))
    ("torch.utils.bottleneck.__main__", "main", "torch.utils.bottleneck.__main__"),
    ("json.tool", "main", "json.tool"),
    # under the prefixes the loader used to import on its own
    ("atorch.testing.launcher", "DistributedRunError", "atorch.testing.launcher"),
    ("transformers.models.gpt2.modeling_gpt2", "GPT2Block", "transformers"),
])
def test_loading_never_imports_a_module_it_names(tmp_path, module, name, watched):
    (tmp_path / "s.json").write_text(_json_naming(module, name))
    (tmp_path / "s.pkl").write_bytes(_pickle_naming(module, name))
    (tmp_path / "g.pkl").write_bytes(_stack_global(module, name))
    report = _run_child(_CHILD, watched, str(tmp_path))
    if report["before"]:
        pytest.skip(f"{watched} is already imported by `import atorch` with this torch")
    for label, (outcome, message) in report["outcomes"].items():
        assert outcome == "UnsafeStrategyError", f"{label}: {outcome} {message}"
        assert f"{module}.{name}" in message, f"{label}: the error must name the global: {message}"
    assert not report["after"], f"loading imported {watched}"


_CHILD_ALLOWED = r"""
import json, sys
from atorch.auto.strategy import Strategy
from atorch.errors import UnsafeStrategyError
directory = sys.argv[1]
sys.path.insert(0, directory)  # where the user's model module lives
report = {"user_before": "usermodel" in sys.modules, "outcomes": {}}
def load(name):
    try:
        config = Strategy.load(directory + "/" + name).get("checkpoint")
        return ["loaded", [f"{c.__module__}.{c.__qualname__}" for c in config["wrap_class"]]]
    except UnsafeStrategyError as error:
        return ["UnsafeStrategyError", str(error)]
names = ("torch.json", "torch.pkl", "user.json", "user.pkl")
report["outcomes"]["before import"] = {name: load(name) for name in names}
report["user_after_refusal"] = "usermodel" in sys.modules
import usermodel  # the user imports the module that defines the model
report["outcomes"]["after import"] = {name: load(name) for name in names}
print("REPORT " + json.dumps(report))
"""


def test_already_imported_module_classes_still_load(tmp_path):
    # torch.nn.Linear and GPTBlock are imported with atorch; the user's module only once imported
    strategy = Strategy([("checkpoint", {"wrap_class": (nn.Linear, GPTBlock), "no_reentrant": False})])
    strategy.save(tmp_path / "torch.json")
    strategy.save(tmp_path / "torch.pkl")
    (tmp_path / "usermodel.py").write_text(
        "from torch import nn\nclass Outer:\n    class Block(nn.Module):\n        pass\n")
    (tmp_path / "user.json").write_text(_json_naming("usermodel", "Outer.Block"))
    (tmp_path / "user.pkl").write_bytes(_stack_global_strategy("usermodel", "Outer.Block"))
    report = _run_child(_CHILD_ALLOWED, str(tmp_path))
    assert not report["user_before"]
    torch_classes = ["loaded", ["torch.nn.modules.linear.Linear", "atorch.models.gpt.GPTBlock"]]
    before = report["outcomes"]["before import"]
    assert before["torch.json"] == before["torch.pkl"] == torch_classes
    for name in ("user.json", "user.pkl"):
        outcome, message = before[name]
        assert outcome == "UnsafeStrategyError" and "usermodel.Outer.Block" in message and "not imported" in message
    assert not report["user_after_refusal"], "the refused load imported the user's module"
    after = report["outcomes"]["after import"]
    assert after["torch.json"] == after["torch.pkl"] == torch_classes
    assert after["user.json"] == after["user.pkl"] == ["loaded", ["usermodel.Outer.Block"]]


def test_strategy_module_has_no_import_path():
    source = Path(strategy_module.__file__).read_text()
    assert "import_module" not in source and "__import__" not in source and "_IMPORTABLE_PREFIXES" not in source


# --- code-running payloads --------------------------------------------------------------------
def test_reduce_payloads_run_nothing(tmp_path):
    marker = tmp_path / "ran"
    executed, refused = [], []
    for label, data in _payloads(str(marker)).items():
        with pytest.raises(UnsafeStrategyError) as caught:
            Strategy.from_bytes(data)
        assert label in str(caught.value), str(caught.value)  # names the global
        refused.append(label)
        path = tmp_path / f"{label}.pkl"
        path.write_bytes(data)
        with pytest.raises(UnsafeStrategyError):
            Strategy.from_any(str(path))
        executed += [label] if marker.exists() else []
    import builtins
    import subprocess as subprocess_module
    code = f"open({str(marker)!r}, 'w').close()"
    nested = {
        "posix.system": _Reduces(os.system, f"touch {marker}"),
        "subprocess.Popen": _Reduces(subprocess_module.Popen, ["touch", str(marker)]),
        "builtins.eval": _Reduces(builtins.eval, code),
        "builtins.exec": _Reduces(builtins.exec, code),
    }
    for label, payload in nested.items():  # hidden inside a strategy's config
        data = pickle.dumps(Strategy([("amp_native", {"dtype": payload})]), protocol=4)
        with pytest.raises(UnsafeStrategyError, match=label.replace(".", r"\.")):
            Strategy.from_bytes(data)
        executed += [f"nested {label}"] if marker.exists() else []
    for module, name in (("os", "system"), ("builtins", "eval"), ("builtins", "exec"), ("subprocess", "Popen")):
        with pytest.raises(UnsafeStrategyError, match=f"{module}.{name}"):
            Strategy.from_json(_json_naming(module, name))
    assert len(refused) == 5
    assert executed == [] and not marker.exists(), f"code ran while loading: {executed}"


def test_lazy_torch_attributes_are_not_looked_up_dynamically():
    for bad in ("_inductor", "onnx", "set_vital", "float_nonexistent"):
        with pytest.raises(UnsafeStrategyError, match=f"torch.{bad}"):
            Strategy.from_json(json.dumps([["amp_native", {"dtype": {"__dtype__": bad}}]]))
        with pytest.raises(UnsafeStrategyError, match=f"torch.{bad}"):
            Strategy.from_bytes(_stack_global("torch", bad))
    assert Strategy.from_json(json.dumps([["half", {"__dtype__": "bfloat16"}]])).get("half") is torch.bfloat16


# --- empty, truncated and malformed data --------------------------------------------------------
def test_empty_and_truncated_pickles_say_what_is_wrong(tmp_path):
    with pytest.raises(StrategyFileError, match="empty file"):
        Strategy.from_bytes(b"")
    for suffix in (".pkl", ".json", ".strategy"):
        (tmp_path / f"e{suffix}").write_bytes(b"")
        with pytest.raises(StrategyFileError, match="empty file") as caught:
            Strategy.load(tmp_path / f"e{suffix}")
        assert f"e{suffix}" in str(caught.value)
    data = GOOD.to_bytes()
    for size in range(1, len(data)):
        with pytest.raises(StrategyFileError, match="truncated pickle data") as caught:
            Strategy.from_bytes(data[:size])
        assert str(caught.value).strip()
    (tmp_path / "t.pkl").write_bytes(data[: len(data) // 2])
    with pytest.raises(StrategyFileError, match="truncated pickle data"):
        Strategy.from_any(str(tmp_path / "t.pkl"))
    with pytest.raises(StrategyFileError, match="not a strategy pickle.*invalid opcode"):
        Strategy.from_bytes(b"not a pickle")


@pytest.mark.parametrize("text, match", [
    ('{"format": "atorch-strategy", "methods": 3}', "'methods' must be a list"),
    ('[["half", {"__tuple__": 5}]]', "__tuple__ must hold a list"),
    ('[["half", {"__class__": 3}]]', "__class__ must hold a string"),
    ('[["half", {"__dict__": [[1]]}]]', r"\[key, value\] pairs"),
    ('[["half", {"__set__": [[1]]}]]', "unhashable"),
    ('[["half", {"__dtype__": ["bf16"]}]]', "__dtype__ must hold a string"),
    ('[[1, 2]]', "malformed method entry"),
    ("[" * 100000, "not valid JSON|nested too deeply"),
])
def test_malformed_json_is_a_file_error(text, match):
    with pytest.raises(StrategyFileError, match=match):
        Strategy.from_json(text)


def test_round_trips_keep_sets_frozensets_and_dtypes(tmp_path):
    strategy = Strategy([("amp_native", {"dtype": torch.float16}),
                         ("x", {"s": {1, 2}, "f": frozenset({"a"}), "nested": {frozenset({1}), 3}, (1, 2): None})])
    for suffix in (".json", ".pkl"):
        strategy.save(tmp_path / f"s{suffix}")
        assert Strategy.load(tmp_path / f"s{suffix}") == strategy
    assert Strategy.from_json(strategy.to_json()).get("x")["f"] == frozenset({"a"})


# --- atomic saves -----------------------------------------------------------------------------
UNSAVABLE = {
    "local class": ("checkpoint", {"wrap_class": (_local_module_class(),)}, "inside a function"),
    "lambda": ("native_dynamo", {"backend": lambda model, inputs: model}, "a lambda"),
    "object": ("amp_native", {"dtype": object()}, "object of type builtins.object"),
    "non-module class": ("checkpoint", {"wrap_class": (collections.OrderedDict,)}, "not an nn.Module class"),
    "dict subclass": ("half", collections.OrderedDict(dtype="bf16"), "subclass of dict"),
    "function": ("native_dynamo", {"backend": print}, "a function"),
}


def test_self_referential_config_is_a_file_error():
    loop = []
    loop.append(loop)
    with pytest.raises(StrategyFileError, match="contains itself"):
        Strategy([("half", loop)]).to_bytes()


@pytest.mark.parametrize("suffix", [".pkl", ".json"])
@pytest.mark.parametrize("case", sorted(UNSAVABLE))
def test_failed_save_leaves_previous_file_byte_identical(tmp_path, suffix, case):
    method, config, reason = UNSAVABLE[case]
    path = tmp_path / f"strategy{suffix}"
    GOOD.save(path)
    before = path.read_bytes()
    bad = Strategy([("half", None), (method, config)])
    with pytest.raises(StrategyFileError) as caught:
        bad.save(path)
    message = str(caught.value)
    assert f"item 1 ({method!r})" in message and reason in message, message
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == [path.name], "a temporary file was left behind"
    with pytest.raises(StrategyFileError, match=reason):  # serialising in memory fails the same way
        bad.to_json() if suffix == ".json" else bad.to_bytes()
    assert Strategy.load(path) == GOOD


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names the synced file through /proc")
def test_save_writes_a_temporary_file_fsyncs_it_then_replaces(tmp_path, monkeypatch):
    path = tmp_path / "s.pkl"
    GOOD.save(path)
    os.chmod(path, 0o600)
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(source, target):
        calls.append(("replace", str(source), str(target)))
        assert path.read_bytes() == before  # the old file is intact until the replace
        return real_replace(source, target)

    before = path.read_bytes()
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    new = Strategy([("half", "bf16")])
    new.save(path)
    replaces = [c for c in calls if c[0] == "replace"]
    assert len(replaces) == 1 and replaces[0][2] == str(path)
    temporary = replaces[0][1]
    assert os.path.dirname(temporary) == str(tmp_path) and temporary != str(path)
    assert calls[0] == ("fsync", temporary)  # the data was synced before the rename
    assert calls.index(("fsync", temporary)) < calls.index(replaces[0])
    assert Strategy.load(path) == new and os.listdir(tmp_path) == ["s.pkl"]
    assert (os.stat(path).st_mode & 0o777) == 0o600  # the previous file's permissions are kept


@pytest.mark.parametrize("failing", ["replace", "fsync", "write"])
def test_write_failures_keep_the_previous_file(tmp_path, monkeypatch, failing):
    path = tmp_path / "s.json"
    GOOD.save(path)
    before = path.read_bytes()

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    if failing == "write":
        # the open that write_atomic calls
        monkeypatch.setattr(files_module, "open", lambda *a, **k: _FailingWriter(*a, **k), raising=False)
    else:
        monkeypatch.setattr(os, failing, fail)
    with pytest.raises(StrategyFileError, match="cannot write strategy file.*No space left"):
        Strategy([("half", "bf16")]).save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["s.json"]


class _FailingWriter:
    def __init__(self, descriptor, mode="r", *args, **kwargs):
        self.handle = open(descriptor, mode, *args, **kwargs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.close()

    def write(self, data):
        self.handle.write(data[: len(data) // 2])
        raise OSError(28, "No space left on device")


def test_save_paths(tmp_path):
    nested = tmp_path / "a" / "b" / "s.json"
    GOOD.save(nested)  # missing directories are created
    assert Strategy.load(nested) == GOOD
    (tmp_path / "afile").write_text("x")
    with pytest.raises(StrategyFileError, match="cannot write strategy file"):
        GOOD.save(tmp_path / "afile" / "s.pkl")
    (tmp_path / "adir").mkdir()
    (tmp_path / "adir" / "keep").write_text("keep")
    with pytest.raises(StrategyFileError, match="is a directory"):
        GOOD.save(tmp_path / "adir")
    assert (tmp_path / "adir" / "keep").read_text() == "keep"
    with pytest.raises(StrategyFileError, match="str or os.PathLike"):
        GOOD.save(3)
    # through a symlink: the target is replaced, the link stays a link
    target = tmp_path / "real.pkl"
    GOOD.save(target)
    link = tmp_path / "link.pkl"
    link.symlink_to(target)
    Strategy([("half", "bf16")]).save(link)
    assert link.is_symlink() and Strategy.load(target) == Strategy([("half", "bf16")])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


# --- save_strategy_to_file: 1 rank and 2 ranks ----------------------------------------------------
def _accelerate(strategy, path):
    model = build_gpt(0, SMALL_GPT)
    shape = repr(model)
    try:
        auto_accelerate(
            model, optim_func=torch.optim.SGD, dataset=SyntheticTokenDataset(32, 16, 64), loss_func=gpt_loss,
            optim_args={"lr": 0.1}, dataloader_args={"batch_size": 4}, model_input_format="unpack_dict",
            load_strategy=strategy, save_strategy_to_file=path,
        )
        return None, repr(model) == shape
    except StrategyFileError as error:
        return str(error), repr(model) == shape


def _unsavable_strategy():
    return [("amp_native", "bf16"), ("checkpoint", {"wrap_class": (_local_module_class(),)})]


def test_save_strategy_to_file_fails_before_wrapping_on_one_rank(tmp_path):
    path = tmp_path / "strategy.pkl"
    GOOD.save(path)
    before = path.read_bytes()
    start = time.monotonic()
    error, unchanged = _accelerate(_unsavable_strategy(), str(path))
    assert error is not None and "save_strategy_to_file" in error and "checkpoint" in error
    assert "inside a function" in error
    assert unchanged, "the model was changed although the strategy could not be saved"
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["strategy.pkl"]
    assert time.monotonic() - start < 30


def _save_on_ranks(directory: str) -> dict:
    """Module level so spawned ranks can import it: a good save, an unsavable config, a bad path."""
    results = {}
    for label, strategy, path in (
        ("good", [("amp_native", "bf16")], os.path.join(directory, "good.json")),
        ("unsavable", _unsavable_strategy(), os.path.join(directory, "strategy.pkl")),
        ("bad path", [("amp_native", "bf16")], os.path.join(directory, "afile", "s.json")),
    ):
        start = time.monotonic()
        error, unchanged = _accelerate(strategy, path)
        results[label] = {"error": error, "unchanged": unchanged, "seconds": time.monotonic() - start}
    alive = torch.ones(1)
    dist.all_reduce(alive)  # the process group is still usable after the failures
    results["alive"] = alive.item()
    return results


@pytest.mark.multirank
def test_save_strategy_to_file_fails_together_on_two_ranks(tmp_path):
    path = tmp_path / "strategy.pkl"
    GOOD.save(path)
    before = path.read_bytes()
    (tmp_path / "afile").write_text("not a directory")
    start = time.monotonic()
    results = run_distributed(_save_on_ranks, 2, str(tmp_path), timeout_s=120)
    print(f"two-rank save run: {time.monotonic() - start:.1f}s; per rank: "
          + "; ".join(", ".join(f"{k} {v['seconds']:.1f}s" for k, v in r.items() if k != "alive") for r in results))
    assert Strategy.load(tmp_path / "good.json").names() == ["parallel_mode", "amp_native"]
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["afile", "good.json", "strategy.pkl"]
    for rank, result in enumerate(results):
        assert result["alive"] == 2.0
        assert result["good"]["error"] is None
        for label, reason in (("unsavable", "inside a function"), ("bad path", "cannot write strategy file")):
            assert result[label]["error"] == results[0][label]["error"], f"rank {rank} raised another error"
            assert reason in result[label]["error"] and "save_strategy_to_file" in result[label]["error"]
            assert result[label]["unchanged"], f"rank {rank}: the model was wrapped before the save failed"
            assert result[label]["seconds"] < 30, f"rank {rank}: {label} took {result[label]['seconds']:.1f}s"
