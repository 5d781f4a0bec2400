"""The prefetch policy: which units to gather ahead of the computation, and which to keep from
their forward to their backward. Pure functions of the schedule's state; the schedule
(schedule.py) calls them after every event and turns their answer into Gather actions.

[Note: prefetch budget]
Outside the root unit (which stays unsharded for the whole step, as FSDP2 keeps its root), at
most `prefetch_depth + 1` units are GATHERING or UNSHARDED at once: the unit computing now and the
ones prefetched for it. Prefetch tops up after every event, so a freed unit is replaced at once.
In backward one more may linger: the unit whose gradients are still being accumulated while the
next unit's backward has already begun ("the unit being reduced"). The unit needed *now* is always
gathered, even past the budget. `max_inflight_allgather_bytes` caps the same set by bytes.
Units kept for backward wait outside this budget ([Note: units kept for backward]).

[Note: units kept for backward]
ZeRO-3 gathers every unit twice a step: for its forward, and again for its backward, after
freeing it in between. For the last units of the forward that round trip buys little: their
backward comes first, so they are freed only to be gathered again moments later. Once the
forward order is known, the schedule keeps the last unit and then the units before it, from
the end, while their unsharded bytes add up to at most `keep_for_backward_bytes`; each saves one all-gather (a third of its traffic)
per step. Between their forward and their backward they are *parked*: held, counted in the
memory peak, but outside the prefetch budget, so the forward prefetch goes on past them (it
stopped at the first kept unit before, which made reshard_after_forward=False slower than
ZeRO-3: benchmarks/RESULTS.md, planner table). So at most `prefetch_depth + 1` unparked units
are held, plus the parked ones, plus the unit being reduced: the kept bytes are a budget of
their own. The last unit is kept but not parked: its backward is the next computation. A cap
on gathered bytes (`max_inflight_allgather_bytes`) turns the keeping off beyond the last unit: the cap
is the user's bound on every unsharded byte. Why a byte budget and what it is by default (a
fixed amount, not a share of the model): OverlapConfig.keep_for_backward_bytes.
Another forward before that backward (a pipeline's warm-up micro-batches) keeps them too, parked:
it uses them again and the first backward still needs them; what was prefetched for backward
and not kept is freed (Schedule.begin_forward).

[Note: a finished unit is not prefetched again]
A unit runs backward once per step, so one whose backward finished is never gathered
again in that backward. Its state alone does not say so under no_sync (it goes back to
SHARDED, not REDUCING), and the cursor can move back: when a unit's output is also the
root's (a rank whose data skipped the root's own layers), the root's gradient hook runs
after the unit's and sets the cursor to the root, first in the order. Without this
check that rank alone would gather the finished unit again, and its collectives would
no longer pair with the other ranks'.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from overlap.engine.unit_state import ScheduleConfig, UnitState

# Held already, or done with this step (a tuple: `in` compares identities, no Enum hash).
_NOT_TO_GATHER = (UnitState.GATHERING, UnitState.UNSHARDED, UnitState.REDUCING, UnitState.RETAINED)


def units_to_prefetch(
    ahead: Sequence[int],
    states: Sequence[UnitState],
    unit_bytes: Sequence[int],
    held: tuple[int, int],
    root: int | None,
    finished: Collection[int],
    config: ScheduleConfig,
) -> list[int]:
    """The units to gather now, in order, from `ahead` (the expected order after the computing
    unit), given `held` = (units, bytes) already held inside the budget ([Note: prefetch
    budget]). Never the root (held for the whole step) nor a unit in `finished`, whose backward
    finished this step ([Note: a finished unit is not prefetched again])."""
    num_held, held_bytes = held
    out: list[int] = []
    for unit in ahead:
        if num_held >= config.prefetch_depth + 1:
            break
        state = states[unit]
        if state in _NOT_TO_GATHER or unit == root or unit in finished:
            continue
        size = unit_bytes[unit]
        if config.max_inflight_allgather_bytes is not None and held_bytes + size > config.max_inflight_allgather_bytes:
            break
        out.append(unit)
        num_held += 1
        held_bytes += size
    return out


def units_kept(forward: Sequence[int], unit_bytes: Sequence[int], config: ScheduleConfig) -> frozenset[int]:
    """The units kept from their forward to their backward ([Note: units kept for backward]):
    the last of `forward` (the root excluded), then the ones before it while their bytes fit
    `keep_for_backward_bytes`; only the last under a cap on gathered bytes."""
    if not forward:
        return frozenset()
    kept, total = {forward[-1]}, unit_bytes[forward[-1]]
    if config.max_inflight_allgather_bytes is None:
        for unit in reversed(forward[:-1]):
            total += unit_bytes[unit]
            if total > config.keep_for_backward_bytes:
                break
            kept.add(unit)
    return frozenset(kept)


def retention_fits(unit_bytes: Sequence[int], config: ScheduleConfig) -> bool:
    """Whether units may be retained across micro-batches ([Note: retained across micro-batches]
    in unit_state.py): every unit's unsharded bytes together within `max_inflight_allgather_bytes`
    (no cap: always, as FSDP2 keeps every unit when asked)."""
    cap = config.max_inflight_allgather_bytes
    return cap is None or sum(unit_bytes) <= cap
