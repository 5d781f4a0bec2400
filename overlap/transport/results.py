"""What a collective hands back, and how to wait on it: `CommResult` and the other typed values
the collectives take and return, the rule for a collective over one rank, and `wait`, which turns a
backend failure into a `CollectiveError` naming the timeout in force. No collective is issued here;
`collectives.py` issues them (and re-exports these names, its callers' one namespace).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

import torch


@functools.cache
def _force_collectives() -> bool:
    """`OVERLAP_FORCE_COLLECTIVES=1`: issue real collectives at world size 1 too, instead of the
    local copies below. For checks on one GPU (benchmarks/gpu_check.py): a single GPU cannot host
    two NCCL ranks, so this is the only way to run the library's own NCCL path there."""
    return os.environ.get("OVERLAP_FORCE_COLLECTIVES", "") not in ("", "0")


def runs_locally(world_size: int) -> bool:
    """A collective over one rank is a local copy, unless forced (`_force_collectives`)."""
    return world_size == 1 and not _force_collectives()


class CommResult(NamedTuple):
    output: torch.Tensor
    work: Any  # dist.Work, or None when the collective ran synchronously (world size 1)
    inputs: tuple[torch.Tensor, ...]  # kept alive until the wait
    finish: Callable[[torch.Tensor], Any] | None = None  # applied to output by `wait` (a tensor, or its rows)
    nbytes: int | None = None  # bytes its buffers hold in flight, where not those of output and inputs


class RecvSlack(NamedTuple):
    """Room an all-to-all leaves for a peer that sends more than expected ([Note: receive slack])."""

    rank: int  # this rank's index in the group
    floor_bytes: int  # each peer's part of the receive buffer holds at least this many bytes


class Divide(NamedTuple):
    """Divide the first `numel` elements of a reduction's sum by `divisor` (the average)."""

    numel: int
    divisor: int


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a peer rank died, is stuck, or issued another collective.

    [Note: collective failures]
    The backend's own error ("Connection closed by peer", "Timed out waiting ...") names neither
    the collective nor the setting that bounds the wait. `wait` turns it into this error (the
    backend's error chained as the cause); `Runtime.run` adds the rank and the unit or bucket.
    Every rank that takes part in the failed collective raises within the timeout, none hangs.
    On a stream-ordered backend (NCCL) the training collectives are waited on without a timeout
    ([Note: NCCL is not gloo] in backend.py): a hang there ends in the watchdog's abort after
    the process group's timeout, not in this error (`wrap` warns when collective_timeout_s is set).
    """


def wait(result: CommResult, timeout: timedelta | None = None) -> torch.Tensor:
    """Block until `result` is done (CPU) or enqueue the wait on the current stream (CUDA).

    Raises `CollectiveError` when the collective fails or does not finish within `timeout`
    (None: the process group's timeout)."""
    if result.work is not None:
        t0 = time.monotonic()
        try:
            if timeout is None:
                result.work.wait()
            else:
                result.work.wait(timeout)
        except RuntimeError as e:
            limit = (
                "the process group's timeout"
                if timeout is None
                else f"collective_timeout_s={timeout.total_seconds():g}"
            )
            raise CollectiveError(
                f"failed after {time.monotonic() - t0:.1f}s ({limit}): a peer rank died, is stuck "
                "or issued a different collective; the other ranks raise too, so look for the "
                f"first rank that failed in their logs. Backend error: {type(e).__name__}: {e}"
            ) from e
    if result.finish is not None:
        return result.finish(result.output)
    return result.output
