"""The states a unit moves through in a step, and the slice of OverlapConfig the schedule reads.

[Note: unit states]
Each unit moves through

    SHARDED --gather--> GATHERING --wait--> UNSHARDED --free--> SHARDED            (forward)
    SHARDED --gather--> GATHERING --wait--> UNSHARDED --grads ready--> REDUCING --reduced--> SHARDED
    SHARDED --no gradient this step--> REDUCING --reduced (zeros)--> SHARDED

and nothing else (`LEGAL_TRANSITIONS`, asserted on every move). A unit that is kept after forward
(reshard_after_forward=False, the last unit, which backward needs first, or one of the units
below) goes straight from UNSHARDED in forward to its backward. Gradient accumulation with
`set_reshard_after_backward(False)` adds one loop ([Note: retained across micro-batches]):

    UNSHARDED --grads ready, no sync--> RETAINED --next forward or backward--> UNSHARDED
    RETAINED --reshard() / not retained this backward--> SHARDED

[Note: retained across micro-batches]
Under no_sync (pipeline schedules, gradient accumulation) every micro-batch's backward frees a
unit and the next micro-batch gathers it again, twice (forward, backward): ZeRO-3 per
micro-batch, though the parameters cannot change before the backward that syncs. FSDP2's
`set_reshard_after_backward(False)` keeps them; so does ours: a unit whose backward ends while
gradients are not synced and the model asked not to reshard after backward goes to RETAINED
instead of SHARDED. It holds its full parameters (and the gradients accumulated on them) and
sits outside the prefetch budget (it is parked: [Note: units kept for backward] in
prefetch.py). The next forward or backward that reaches it moves it to UNSHARDED without a
gather; after that forward it goes back to RETAINED (not freed, whatever reshard_after_forward
says); the first backward that syncs reduces it and frees it (through UNSHARDED, as any unit),
and `model.reshard()`, or a forward without gradients, frees it at once. A unit is retained only
when every unit fits the cap on unsharded bytes (`max_inflight_allgather_bytes`; none: always,
as FSDP2), so the peak is the whole model's unsharded parameters, stated before training by
that setting; otherwise the backward frees as before. Unlike FSDP2, a backward that syncs always
reshards: the optimizer step that follows changes the shards, and a kept copy would be stale.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields

from overlap.config import OverlapConfig


class UnitState(enum.Enum):
    SHARDED = "sharded"  # only the 1/N shard exists; the unsharded buffer holds 0 bytes
    GATHERING = "gathering"  # all-gather issued, not waited; holds the gather buffers
    UNSHARDED = "unsharded"  # full parameters materialized and swapped into the modules
    REDUCING = "reducing"  # backward done, parameters freed; gradients queued or in flight
    # backward done without sync, reshard_after_backward=False: full parameters and accumulated
    # gradients kept for the next micro-batch ([Note: retained across micro-batches])
    RETAINED = "retained"


LEGAL_TRANSITIONS: dict[UnitState, frozenset[UnitState]] = {
    # SHARDED -> REDUCING: a unit that got no gradient this step is reduced (as zeros) anyway.
    UnitState.SHARDED: frozenset({UnitState.GATHERING, UnitState.REDUCING}),
    UnitState.GATHERING: frozenset({UnitState.UNSHARDED}),
    # UNSHARDED -> RETAINED: its backward ended, not synced, kept ([Note: retained across micro-batches]).
    UnitState.UNSHARDED: frozenset({UnitState.SHARDED, UnitState.REDUCING, UnitState.RETAINED}),
    UnitState.REDUCING: frozenset({UnitState.SHARDED}),
    # RETAINED -> UNSHARDED: used again, no gather; RETAINED -> SHARDED: freed (reshard()).
    UnitState.RETAINED: frozenset({UnitState.UNSHARDED, UnitState.SHARDED}),
}


_HELD = (UnitState.GATHERING, UnitState.UNSHARDED, UnitState.RETAINED)  # a tuple: `in` compares identities, no hash

# `_move` runs several times per unit and step; an Enum's __hash__ is Python code (several µs
# per set or dict lookup), so each state carries its legal successors as a tuple.
for _state, _successors in LEGAL_TRANSITIONS.items():
    _state.successors = tuple(_successors)  # type: ignore[attr-defined]


class Phase(enum.Enum):
    IDLE = "idle"  # between steps: every unit SHARDED, no collective in flight
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True)
class ScheduleConfig:
    """The slice of OverlapConfig the schedule needs, in unit terms, each field named as its
    OverlapConfig field."""

    prefetch_depth: int
    max_inflight_allgather_bytes: int | None
    reshard_after_forward: bool
    reduce_scatter_bucket_bytes: int
    max_reduce_inputs: int = 1
    keep_for_backward_bytes: int = 0  # [Note: units kept for backward]

    @classmethod
    def from_config(cls, config: OverlapConfig) -> ScheduleConfig:
        """The schedule's slice of an OverlapConfig: every field read by its own name there."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})
