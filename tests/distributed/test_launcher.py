"""The test launcher (``atorch.testing.run_distributed``): ranks forked from its fork server must see
the caller's environment and working directory at launch, as spawned ranks do, and a rank's failure
must reach the caller with its traceback."""
from __future__ import annotations

import os

import pytest

from atorch.testing import DistributedRunError, run_distributed
from atorch.testing.launcher import START_METHODS

pytestmark = pytest.mark.multirank
NAME = "ATORCH_LAUNCHER_TEST_VALUE"


def _seen() -> tuple:
    import torch
    import torch.distributed as dist
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    return os.environ.get(NAME), os.getcwd(), os.environ["RANK"], total.item(), torch.get_num_threads()


def _raise_on_rank_1() -> None:
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise KeyError("raised on rank 1")
    dist.barrier()  # rank 0 waits here for a peer that never comes: the launcher must end it


@pytest.mark.parametrize("start_method", START_METHODS)
def test_ranks_see_the_environment_and_directory_of_each_launch(start_method, tmp_path, monkeypatch):
    for value in ("first", "second"):  # the second launch reuses the fork server started by the first
        monkeypatch.setenv(NAME, value)
        monkeypatch.chdir(tmp_path)
        seen = run_distributed(_seen, 2, start_method=start_method)
        assert seen == [(value, str(tmp_path), "0", 3.0, 1), (value, str(tmp_path), "1", 3.0, 1)]
    monkeypatch.delenv(NAME)
    assert run_distributed(_seen, 2, start_method=start_method)[0][0] is None  # a removed variable is gone


def test_a_rank_that_raises_ends_the_run_with_its_traceback():
    with pytest.raises(DistributedRunError, match=r"rank 1 failed:(.|\n)*KeyError: 'raised on rank 1'"):
        run_distributed(_raise_on_rank_1, 2, timeout_s=60)


def _raise_on_rank_0_after_rank_1_waits() -> None:
    import time

    import torch.distributed as dist
    if dist.get_rank() == 0:
        time.sleep(0.5)  # rank 1 is inside the barrier by now
        raise KeyError("raised on rank 0")
    dist.barrier()  # rank 1 fails too, once rank 0's process is gone: its report may arrive first


def test_the_error_carries_every_ranks_report_not_only_the_first_to_arrive():
    """The rank that failed first is named with its traceback whichever report reaches the launcher first
    (a peer's "connection closed" can win the race), and the other rank's outcome is listed beside it."""
    with pytest.raises(DistributedRunError) as raised:
        run_distributed(_raise_on_rank_0_after_rank_1_waits, 2, timeout_s=60)
    text = str(raised.value)
    assert "KeyError: 'raised on rank 0'" in text
    assert "rank 0 failed" in text and ("rank 1 failed" in text or "--- rank 1 " in text)


def _return_on_rank_0_then_raise_on_rank_1() -> int:
    import time

    import torch.distributed as dist
    if dist.get_rank() == 1:
        time.sleep(1.0)  # rank 0's value reaches the launcher first
        raise KeyError("raised on rank 1")
    return 7


def test_a_rank_that_returned_before_the_failure_is_listed_as_returned():
    with pytest.raises(DistributedRunError) as raised:
        run_distributed(_return_on_rank_0_then_raise_on_rank_1, 2, timeout_s=60)
    text = str(raised.value)
    assert "rank 1 failed" in text and "--- rank 0 returned" in text, text


def test_an_unknown_start_method_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"'fork'.*\('forkserver', 'spawn'\)"):
        run_distributed(_seen, 2, start_method="fork")


def _abort_on_rank_1_while_rank_0_waits(marker: str, times: int) -> int:
    """Rank 1 aborts (as glibc does on a corrupted heap) in the first ``times`` launches, counted in the
    ``marker`` file; rank 0 meanwhile waits in a collective."""
    import torch.distributed as dist
    if dist.get_rank() == 1:
        launches = int(open(marker).read()) if os.path.exists(marker) else 0
        with open(marker, "w") as file:
            file.write(str(launches + 1))
        if launches < times:
            os.abort()
    dist.barrier()
    return dist.get_rank()


def test_a_launch_whose_rank_crashed_in_native_code_runs_once_more_and_a_second_crash_fails(tmp_path, capfd):
    """A rank killed by SIGABRT without a report (a native crash: the suite saw glibc's heap check abort
    one rank inside gloo's collectives once in some tens of runs) relaunches once, saying so; a crash
    that recurs fails with both launches' errors, and a Python error is never relaunched."""
    marker = str(tmp_path / "launches")
    assert run_distributed(_abort_on_rank_1_while_rank_0_waits, 2, marker, 1) == [0, 1]
    assert "crashed in native code (launch 1)" in capfd.readouterr().err
    with pytest.raises(DistributedRunError, match=r"2 launches each crashed in native code") as error:
        run_distributed(_abort_on_rank_1_while_rank_0_waits, 2, str(tmp_path / "again"), 2)
    assert str(error.value).count(f"exited with code {-6}") + str(error.value).count("exit codes [-6]") == 2
    with pytest.raises(DistributedRunError, match="raised on rank 1") as error:
        run_distributed(_raise_on_rank_1, 2)
    assert not error.value.native_crash
