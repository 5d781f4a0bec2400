"""The local-world launcher names the rank that failed first ([Note: first failure]), whichever
rank the parent happens to notice first."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessExitedException

from overlap.tools.worlds.launch import _RankFailed, _world_error, run_local_world

WORLD_DEADLINE_S = 120.0
"""Bound on one two-rank world here (seconds when the machine is not loaded)."""
DIED_CODE = 13


def _fallback(rank: int) -> ProcessExitedException:
    return ProcessExitedException(
        f"process {rank} terminated with exit code 1", error_index=rank, error_pid=0, exit_code=1
    )


def test_a_rank_that_died_silently_is_blamed_before_its_peers_collective_errors() -> None:
    """The parent saw rank 0's report of the broken connection (and rank 0's exit) first;
    rank 1 died without a report. Ordering by time alone blamed rank 0 (CI of 14557a8)."""
    echo = _RankFailed(0, time.time(), "CollectiveError: connection closed by peer", echo=True)
    err = _world_error(2, [echo], _fallback(0), exitcodes=[1, DIED_CODE])
    assert str(err).startswith("rank 1 of 2 failed (then ranks [0] failed too):")
    assert f"exit code {DIED_CODE}" in str(err)


def test_a_signal_is_named() -> None:
    err = _world_error(2, [], _fallback(0), exitcodes=[-6, None])
    assert str(err) == "rank 0 of 2 failed:\nprocess 0 terminated with signal SIGABRT"


def test_an_exception_of_its_own_is_blamed_before_a_silent_death_and_an_echo() -> None:
    """A rank that raised something other than a failed collective is the cause, even if a peer
    then died hard and another raised earlier on the broken connection."""
    now = time.time()
    cause = _RankFailed(2, now, "ValueError: bad batch")
    echo = _RankFailed(0, now - 1.0, "CollectiveError: peer died", echo=True)
    err = _world_error(3, [echo, cause], _fallback(0), exitcodes=[1, -6, 1])
    assert str(err).startswith("rank 2 of 3 failed (then ranks [0, 1] failed too):\nValueError")


def test_without_a_cause_the_earliest_echo_is_blamed() -> None:
    """Every rank raised a failed collective (a timeout, nobody died): the earliest is named."""
    now = time.time()
    late = _RankFailed(0, now, "CollectiveError: timed out (late)", echo=True)
    early = _RankFailed(1, now - 0.5, "CollectiveError: timed out (early)", echo=True)
    err = _world_error(2, [late, early], _fallback(0), exitcodes=[1, 1])
    assert str(err).startswith("rank 1 of 2 failed (then ranks [0] failed too):")
    assert "(early)" in str(err)


def _die_in_a_collective(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(DIED_CODE)  # like a lost node: no report, no cleanup
    from overlap.transport import collectives as comm

    x = torch.ones(4)
    work = dist.all_reduce(x, async_op=True)
    try:
        work.wait()
    except Exception as e:  # what overlap's runtime raises when a peer is gone
        raise comm.CollectiveError(f"peer gone: {e}") from e


def test_a_rank_that_dies_hard_is_named_end_to_end() -> None:
    """Rank 1 leaves with os._exit while rank 0 waits in an all-reduce: the world's error names
    rank 1 and its exit code, not rank 0's broken connection."""
    with pytest.raises(RuntimeError, match=rf"^rank 1 of 2 failed[\s\S]*exit code {DIED_CODE}"):
        run_local_world(_die_in_a_collective, 2, timeout_s=60.0, deadline_s=WORLD_DEADLINE_S)


def test_ranks_the_parent_terminated_are_not_blamed() -> None:
    """torch's join terminates the other ranks (SIGTERM) once it sees one exit: those did not
    fail, the one it saw did."""
    died = ProcessExitedException(
        f"process 1 terminated with exit code {DIED_CODE}", error_index=1, error_pid=0, exit_code=DIED_CODE
    )
    err = _world_error(2, [], died, exitcodes=[-15, DIED_CODE])
    assert str(err) == f"rank 1 of 2 failed:\nprocess 1 terminated with exit code {DIED_CODE}"


class _AbortWhenCollected:
    """Held in a reference cycle: collected by the rank's gc.collect() after its result was
    queued ([Note: rank exit]), it aborts the process the way a C++ thread does at teardown."""

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        time.sleep(3.0)  # the queue's feeder thread sends the result meanwhile
        os.abort()


def _return_then_abort(rank: int, world_size: int) -> int:
    if rank == 0:
        _AbortWhenCollected()
    return 10 + rank


def test_a_rank_that_aborts_after_its_result_keeps_the_results() -> None:
    """[Note: died after its result]: every rank returned; rank 0 then aborts while exiting.
    The results are complete, so they are returned, with a warning that names the rank."""
    with pytest.warns(RuntimeWarning, match=r"then rank 0 terminated with signal SIGABRT"):
        got = run_local_world(_return_then_abort, 2, timeout_s=60.0, deadline_s=WORLD_DEADLINE_S)
    assert got == [10, 11]


def _abort_before_returning(rank: int, world_size: int) -> int:
    if rank == 0:
        os.abort()
    return rank


def test_a_rank_that_aborts_before_its_result_fails_the_world() -> None:
    with pytest.raises(RuntimeError, match=r"^rank 0 of 2 failed[\s\S]*signal SIGABRT"):
        run_local_world(_abort_before_returning, 2, timeout_s=60.0, deadline_s=WORLD_DEADLINE_S)
