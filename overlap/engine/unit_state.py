"""The states a unit moves through in a step, and the slice of OverlapConfig the schedule reads.

[Note: unit states]
Each unit moves through

    SHARDED --gather--> GATHERING --wait--> UNSHARDED --free--> SHARDED            (forward)
    SHARDED --gather--> GATHERING --wait--> UNSHARDED --grads ready--> REDUCING --reduced--> SHARDED
    SHARDED --no gradient this step--> REDUCING --reduced (zeros)--> SHARDED

and nothing else (`LEGAL_TRANSITIONS`, asserted on every move). A unit that is kept after forward
(reshard_after_forward=False, the last unit, which backward needs first, or one of the units
below) goes straight from UNSHARDED in forward to its backward.
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


LEGAL_TRANSITIONS: dict[UnitState, frozenset[UnitState]] = {
    # SHARDED -> REDUCING: a unit that got no gradient this step is reduced (as zeros) anyway.
    UnitState.SHARDED: frozenset({UnitState.GATHERING, UnitState.REDUCING}),
    UnitState.GATHERING: frozenset({UnitState.UNSHARDED}),
    UnitState.UNSHARDED: frozenset({UnitState.SHARDED, UnitState.REDUCING}),
    UnitState.REDUCING: frozenset({UnitState.SHARDED}),
}


_HELD = (UnitState.GATHERING, UnitState.UNSHARDED)  # a tuple: `in` compares identities, no hash

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
