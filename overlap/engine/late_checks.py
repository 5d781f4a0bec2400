"""The checks a step reports late, read now: before a checkpoint or an export, and at exit.

[Note: final checks]
Three checks report what a step did only later, so that the hot path never waits for them:
- the all-gather tags on CUDA, compared on the host once their copies have completed
  ([Note: deferred tag check] in transport/fingerprint.py);
- the codecs' non-finite block counts on CUDA ([Note: deferred finite check] in
  compression/finite.py);
- the reduction trail, on every device: compared through the next step's first all-gather
  ([Note: reduction trail] in transport/fingerprint.py).
So a divergence, or a NaN block, in the last step before `checkpoint.save`, a full state-dict
export, or the end of the run would never be reported: the checkpoint would be written as if
nothing had happened. `check_deferred` reads all three at once, waiting
for the device (one sync; it runs between steps, never in the hot path). It is collective, as
`save` and `full_state_dict` are: the trail of the reductions not yet folded into a tag and
each rank's verdict travel in one small all-gather per group, then what any rank found is folded
over the whole job (the tensor-parallel peers, and the experts' states beside the dense one:
[Note: job-wide verdicts] in verdict.py), so every rank raises, the ranks that found a problem or
share a group with one with its detail, the others naming the first such rank, and none goes on
into the save alone.
At exit no collective can be relied on (the process group may be gone): `report_at_exit` reads
the local checks (tags and codec counts) and logs what it finds; on the CPU both were read in
their own step already, so it only finds what a CUDA run's last step left. It first lets the
comm streams finish, for at most `EXIT_DEVICE_WAIT_S`: a process leaving after a hung collective
would otherwise wait forever on an event behind it; then it says it could not read them.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from overlap.engine.verdict import first_flagged, job_groups
from overlap.transport import collectives as comm
from overlap.transport.fingerprint import TRAIL_MASK, CollectiveMismatchError

if TYPE_CHECKING:
    from overlap.engine.state import OverlapState

_TAGS_BIT = 1 << 32  # this rank's deferred tag check found a mismatch
_NONFINITE_BIT = 1 << 33  # a codec of this rank met Inf/NaN

EXIT_DEVICE_WAIT_S = 30.0
"""At exit, the longest `report_at_exit` waits for the device to finish the last step's work."""

logger = logging.getLogger("overlap")


def _read_local(state: OverlapState) -> tuple[CollectiveMismatchError | None, ValueError | None]:
    """This rank's deferred tag and non-finite checks, read now (one sync on CUDA)."""
    runtime = state.runtime
    tags = nonfinite = None
    try:
        runtime.fingerprints.check_pending(wait=True)
    except CollectiveMismatchError as e:
        tags = e
    for codec in (runtime.param_codec, runtime.grad_codec):
        if codec is None:
            continue
        try:
            codec.raise_if_nonfinite(wait=True)
        except ValueError as e:
            nonfinite = nonfinite or e
    return tags, nonfinite


def check_deferred(state: OverlapState, where: str) -> None:
    """Collective over every rank of the model (the dense state's grid, and the experts' states
    in it): raise on every rank what the last step's deferred checks found ([Note: final
    checks]); `where` names the caller in the messages."""
    found_here = _verdict(state, where)
    for expert in state.experts:  # each over its own groups ([Note: expert parallelism] in experts.py)
        expert_found = _verdict(expert, where)
        found_here = found_here or expert_found
    groups = job_groups(state.group, state.replicate_group, state.tensor_group)
    kind = found_here[0] if found_here else 0
    found = first_flagged(kind, groups, state.runtime.device, state.runtime.timeout)  # [Note: job-wide verdicts]
    if found_here:
        raise found_here[1]
    if found is None:
        return
    rank, kind = found
    message = (
        f"overlap: rank {state.rank}: {where}: global rank {rank} found a problem in the last steps, "
        "in another data- or tensor-parallel group than this rank's (its error says what)"
    )
    raise ValueError(message) if kind == _NONFINITE_KIND else CollectiveMismatchError(message)


_MISMATCH_KIND, _NONFINITE_KIND = 1, 2  # what a rank found, folded over the job


def _verdict(state: OverlapState, where: str) -> tuple[int, Exception] | None:
    """What this rank's last steps left, judged with the other ranks of `state`'s groups (one
    small all-gather per group, on every rank): (its kind, the error to raise here), or None."""
    runtime = state.runtime
    tags, nonfinite = _read_local(state)
    trail = runtime.reduce_trail & TRAIL_MASK
    verdict = trail | (_TAGS_BIT if tags else 0) | (_NONFINITE_BIT if nonfinite else 0)
    groups = [state.group] if state.replicate_group is None else [state.group, state.replicate_group]
    seen = [comm.all_gather_int(verdict, group, runtime.device, runtime.timeout) for group in groups]
    if tags is not None:
        return _MISMATCH_KIND, _caused(CollectiveMismatchError(f"{tags} (found by {where})"), tags)
    if nonfinite is not None:
        return _NONFINITE_KIND, _caused(ValueError(f"overlap: rank {state.rank}: {where}: {nonfinite}"), nonfinite)
    for values in seen:
        flagged = [r for r, v in enumerate(values) if v & _TAGS_BIT]
        if flagged:
            return _MISMATCH_KIND, CollectiveMismatchError(
                f"overlap: rank {state.rank}: {where}: the ranks' collectives diverged in the last "
                f"steps: rank(s) {flagged} found all-gather tags of other steps, phases or units "
                "(their error names each rank's tag)"
            )
        flagged = [r for r, v in enumerate(values) if v & _NONFINITE_BIT]
        if flagged:
            return _NONFINITE_KIND, ValueError(
                f"overlap: rank {state.rank}: {where}: rank(s) {flagged} encoded Inf or NaN "
                "that a quantizing codec cannot carry in the last steps (their error says where)"
            )
        trails = [v & TRAIL_MASK for v in values]
        if len(set(trails)) != 1:
            return _MISMATCH_KIND, CollectiveMismatchError(
                f"overlap: rank {state.rank}: {where}: the ranks reduced the gradients of "
                "different units, or in a different order, in their last backward (reduction "
                f"trails by rank: {[hex(t) for t in trails]}): a unit skipped on some ranks "
                "only, so its gradients were summed with another unit's ([Note: reduction "
                "trail] in overlap/transport/fingerprint.py). Every rank must run the same "
                "units in the same order."
            )
    return None


def _caused(error: Exception, cause: Exception) -> Exception:
    """`error`, raised later as `raise error from cause` would."""
    error.__cause__ = cause
    return error


def _device_done(state: OverlapState, timeout_s: float, poll_s: float = 0.01) -> bool:
    """Whether the work queued on the transport's streams (and the current one) finishes within
    `timeout_s`: polled through events, never a wait that could hang. True on the host."""
    executor = state.runtime.transport.executor
    streams = [s for s in (executor.gather_stream, executor.reduce_stream, executor.all_reduce_stream) if s]
    if not streams:
        return True
    events = [s.record_event() for s in (*streams, torch.cuda.current_stream(state.runtime.device))]
    deadline = time.monotonic() + timeout_s
    while not all(e.query() for e in events):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def report_at_exit(states: list[OverlapState], timeout_s: float = EXIT_DEVICE_WAIT_S) -> list[str]:
    """Read the local deferred checks of `states` at exit and log what they found (no
    collective: [Note: final checks]). Returns the messages logged."""
    found = []
    for state in states:
        try:
            if _device_done(state, timeout_s):
                problems = [e for e in _read_local(state) if e is not None]
            else:
                problems = [f"not read: the device did not finish the last step within {timeout_s:g} s"]
        except Exception as e:
            problems = [e]
        for problem in problems:
            message = f"overlap: rank {state.rank}: at exit, the last step's deferred checks: {problem}"
            logger.error(message)
            found.append(message)
    return found
