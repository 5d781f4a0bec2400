"""The actions the schedule hands the runtime (schedule.py decides them, runtime.py carries
them out): gather, wait for and free a unit; reduce, release and wait for a bucket; check that
every rank is about to exchange the same thing ([Note: collective order] in schedule.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


# Actions. The runtime carries them out in the order given. Frozen dataclasses (not NamedTuples,
# which compare equal to any tuple of the same values: Gather(0) == Free(0)).
@dataclass(frozen=True)
class Gather:
    unit: int
    for_backward: bool = False  # issued from the end of forward on: the unit's backward needs it


@dataclass(frozen=True)
class WaitGather:
    unit: int


@dataclass(frozen=True)
class Free:
    unit: int


@dataclass(frozen=True)
class Retain:
    """Keep the unit unsharded after a backward that does not sync ([Note: retained across
    micro-batches] in unit_state.py): its parameters stay; its gradients are treated as `Free`
    treats them under no_sync ([Note: no_sync in reduce_dtype] in reduction.py)."""

    unit: int


@dataclass(frozen=True)
class Reduce:
    bucket: int
    units: tuple[int, ...]


@dataclass(frozen=True)
class ReleaseReduce:
    """Finish with a bucket's reduce-scatter input before another bucket allocates one
    ([Note: reduce buffers]); its reduced shard stays pending until `WaitReduce`."""

    bucket: int
    units: tuple[int, ...]


@dataclass(frozen=True)
class WaitReduce:
    bucket: int
    units: tuple[int, ...]


@dataclass(frozen=True)
class CheckOrder:
    what: str  # "forward" or "backward"
    order_hash: int
    order: tuple[int, ...]


Action = Gather | WaitGather | Free | Retain | Reduce | ReleaseReduce | WaitReduce | CheckOrder


class UnitActions:
    """Every per-unit action, made once: the hooks run several times per unit and step, and
    the runtime only reads actions (they are frozen), so the schedule hands out these."""

    def __init__(self, num_units: int) -> None:
        units = range(num_units)
        self.gather = ([Gather(u, False) for u in units], [Gather(u, True) for u in units])
        self.wait = [WaitGather(u) for u in units]
        self.free = [Free(u) for u in units]
        self.retain = [Retain(u) for u in units]


def order_hash(order: tuple[int, ...]) -> int:
    digest = hashlib.blake2b(repr(order).encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")  # < 2**56: fits an int64 tensor
