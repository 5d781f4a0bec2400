"""The schedule: the one place that decides what happens next.

Hooks report events (a unit's forward starts, its gradients are ready, backward ended); the
schedule answers with *actions* (gather unit k, wait for unit k, free unit k, reduce a bucket,
wait for a bucket). It never touches a tensor or a process group, so the same code drives the
real runtime and, later, the planner's virtual clock. The unit states are in unit_state.py
([Note: unit states]); which units to gather ahead and which to keep for backward is the
prefetch policy in prefetch.py ([Note: prefetch budget], [Note: units kept for backward]).

[Note: collective order]
Every rank must issue the same collectives in the same order. Gathers follow the unit order
recorded on the first step. Until the first forward has completed, every forward gather is
preceded by a `CheckOrder`: a tiny all-gather of what this rank is about to exchange (a host
round trip, a device sync on CUDA). Gathers for backward are checked until the first backward has
completed (one under no_sync counts), reductions until the first backward that reduces. Each
phase stops on its own: an evaluation before training, an inference-only job or leading no_sync
micro-batches pay the checks once, not on every gather. Checks pair with checks on every rank, so a rank whose model runs differently raises
a ValueError on all ranks at the first divergent collective, instead of exchanging the wrong
units (or, with gloo, aborting on a size mismatch). After that the recorded orders are trusted
and the checks cost nothing. Units whose parameters got no gradient are reduced all the same, in
a fixed order, when backward ends.

[Note: pinned units]
`model.unshard()` (generation, evaluation loops) gathers every unit between steps and pins them:
forwards then free nothing and gather nothing (every unit is held, so the prefetch budget does
not apply) until `model.reshard()` frees them all. A backward unpins: it frees each unit as its
gradients are reduced, as FSDP2's backward reshards, and the next step gathers as usual.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The actions are re-exported: the schedule's vocabulary (the planner and tests import them here).
from overlap.engine.actions import (  # noqa: F401
    Action,
    CheckOrder,
    Free,
    Gather,
    Reduce,
    ReleaseReduce,
    Retain,
    UnitActions,
    WaitGather,
    WaitReduce,
    order_hash,
)
from overlap.engine.prefetch import retention_fits, units_kept, units_to_prefetch

# The unit states and the schedule's config are re-exported with the actions.
from overlap.engine.unit_state import _HELD, LEGAL_TRANSITIONS, Phase, ScheduleConfig, UnitState  # noqa: F401


@dataclass
class Schedule:
    """Per-unit state machine plus the prefetch and bucketing policy. See the module notes.

    `unit_bytes[u]`: unsharded bytes of unit u (in the gather dtype); `grad_bytes[u]`: bytes its
    gradients add to a reduce-scatter bucket. `root` is the unit of parameters outside every
    block (or None when there are none).
    """

    unit_bytes: list[int]
    grad_bytes: list[int]
    config: ScheduleConfig
    root: int | None = None
    states: list[UnitState] = field(init=False)
    phase: Phase = field(init=False, default=Phase.IDLE)
    forward_order: tuple[int, ...] | None = field(init=False, default=None)
    backward_order: tuple[int, ...] | None = field(init=False, default=None)
    sync_grads: bool = field(init=False, default=True)  # False inside overlap.no_sync
    pinned: bool = field(init=False, default=False)  # [Note: pinned units]
    # False: units are retained across backwards that do not sync ([Note: retained across micro-batches])
    reshard_after_backward: bool = field(init=False, default=True)
    _retain_allowed: bool = field(init=False, default=False)  # reshard_after_backward off and it fits
    _retain_now: bool = field(init=False, default=False)  # this backward retains its units
    _retaining: bool = field(init=False, default=False)  # units are retained: forwards keep them
    _seen_forward: list[int] = field(init=False, default_factory=list)
    _seen_backward: list[int] = field(init=False, default_factory=list)
    _finished_backward: set[int] = field(init=False, default_factory=set)  # this backward's, as a set
    _forward_checked: bool = field(init=False, default=False)
    _backward_checked: bool = field(init=False, default=False)  # reductions checked
    _backward_gathers_checked: bool = field(init=False, default=False)
    _cursor: int = field(init=False, default=-1)  # position of the computing unit in the order
    _gathering_for_backward: bool = field(init=False, default=False)  # after end_forward
    _started_backward: set[int] = field(init=False, default_factory=set)
    _bucket: list[int] = field(init=False, default_factory=list)
    _bucket_bytes: int = field(init=False, default=0)
    _num_buckets: int = field(init=False, default=0)
    _in_flight: list[Reduce] = field(init=False, default_factory=list)
    _inputs_alive: list[Reduce] = field(init=False, default_factory=list)  # [Note: reduce buffers]
    _max_unsharded: int = field(init=False, default=0)
    _max_unsharded_bytes: int = field(init=False, default=0)
    _held: set[int] = field(init=False, default_factory=set)  # GATHERING or UNSHARDED, root excluded
    _held_bytes: int = field(init=False, default=0)
    _kept: frozenset[int] = field(init=False, default=frozenset())  # [Note: units kept for backward]
    _parked: set[int] = field(init=False, default_factory=set)
    _backward_cache: tuple[int, ...] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.states = [UnitState.SHARDED] * len(self.unit_bytes)
        self._actions = UnitActions(len(self.unit_bytes))

    # ---------------------------------------------------------------- queries
    @property
    def num_units(self) -> int:
        return len(self.unit_bytes)

    def held_units(self) -> list[int]:
        """Units (root excluded) whose unsharded parameters exist or are being gathered."""
        return sorted(self._held)

    def max_unsharded(self) -> tuple[int, int]:
        """Most non-root units (and their bytes) held at once since the last `reset_peak()`."""
        return self._max_unsharded, self._max_unsharded_bytes

    def kept_units(self) -> frozenset[int]:
        """Units kept from their forward to their backward, known once the first forward ended
        ([Note: units kept for backward]; reshard_after_forward=False keeps every unit besides)."""
        return self._kept

    def reset_peak(self) -> None:
        self._max_unsharded = len(self._held)
        self._max_unsharded_bytes = self._held_bytes

    def _predicted_forward(self) -> tuple[int, ...]:
        if self.forward_order is not None:
            return self.forward_order
        return tuple(range(self.num_units))  # first step: registration order (root first)

    def backward_units(self) -> tuple[int, ...]:
        """The units in the order their gradients are expected (the first step: predicted)."""
        if self.forward_order is not None and self._backward_cache is not None:
            return self._backward_cache
        forward = self.forward_order or tuple(self._seen_forward)
        rest = tuple(u for u in reversed(forward) if u != self.root)
        order = ((self.root,) if self.root is not None else ()) + rest
        if self.forward_order is not None:  # fixed from now on: computed once
            self._backward_cache = order
        return order

    # ---------------------------------------------------------------- moves
    def _move(self, unit: int, new: UnitState) -> None:
        old = self.states[unit]
        assert new in old.successors, f"unit {unit}: illegal transition {old} -> {new}"  # type: ignore[attr-defined]
        self.states[unit] = new
        if unit == self.root:
            return
        was, now = old in _HELD, new in _HELD
        if now and not was:
            self._held.add(unit)
            self._held_bytes += self.unit_bytes[unit]
            self._max_unsharded = max(self._max_unsharded, len(self._held))
            self._max_unsharded_bytes = max(self._max_unsharded_bytes, self._held_bytes)
        elif was and not now:
            self._held.discard(unit)
            self._parked.discard(unit)
            self._held_bytes -= self.unit_bytes[unit]

    def _gather(self, unit: int, out: list[Action]) -> None:
        self._move(unit, UnitState.GATHERING)
        checked = self._backward_gathers_checked if self._gathering_for_backward else self._forward_checked
        if not checked:  # [Note: collective order]
            key = ("gather", unit)
            out.append(CheckOrder("gather", order_hash(key), (unit,)))
        out.append(self._actions.gather[self._gathering_for_backward][unit])

    def _ensure_unsharded(self, unit: int, out: list[Action]) -> None:
        if self.states[unit] is UnitState.REDUCING:
            raise RuntimeError(
                f"unit {unit} is needed again after its backward finished in this step; "
                "a unit may run forward several times but backward through it only once per step"
            )
        state = self.states[unit]
        if state is UnitState.SHARDED:
            self._gather(unit, out)
        elif state is UnitState.RETAINED:  # no gather: [Note: retained across micro-batches]
            self._move(unit, UnitState.UNSHARDED)

    def _wait(self, unit: int, out: list[Action]) -> None:
        if self.states[unit] is UnitState.GATHERING:
            self._move(unit, UnitState.UNSHARDED)
            out.append(self._actions.wait[unit])

    def _prefetch(self, order: tuple[int, ...], out: list[Action]) -> None:
        """Top up prefetch along `order` after the cursor, within the budget (prefetch.py)."""
        # parked units wait for their backward outside the depth budget: [Note: units kept for backward]
        held = (len(self._held) - len(self._parked), self._held_bytes)
        ahead = order[self._cursor + 1 :]
        for unit in units_to_prefetch(
            ahead, self.states, self.unit_bytes, held, self.root, self._finished_backward, self.config
        ):
            self._gather(unit, out)

    # ---------------------------------------------------------------- forward events
    def begin_forward(self) -> list[Action]:
        """The root module's forward starts."""
        out: list[Action] = []
        if self.phase is Phase.BACKWARD:
            raise RuntimeError("forward started while the previous backward has not finished")
        if self.phase is Phase.IDLE:
            self._seen_forward = []
            self.reset_peak()
        elif not self.pinned:
            # Another forward before backward (a pipeline's warm-up micro-batches): what
            # end_forward gathered for backward is not needed yet, and keeping it would break the
            # prefetch budget. Free it. A unit kept from its forward for its backward stays (this
            # forward uses it again, the first backward needs it), parked as it was.
            for unit in self.held_units():
                state = self.states[unit]
                if state is UnitState.RETAINED:
                    continue  # kept until a backward syncs: [Note: retained across micro-batches]
                if state is UnitState.UNSHARDED and (not self.config.reshard_after_forward or unit in self._kept):
                    self._parked.add(unit)  # [Note: units kept for backward]
                    continue
                self._wait(unit, out)
                self._move(unit, UnitState.SHARDED)
                out.append(self._actions.free[unit])
        self._cursor = -1
        self._gathering_for_backward = False
        self.phase = Phase.FORWARD
        if self.root is not None:
            out += self.pre_forward(self.root)
        return out

    def pre_forward(self, unit: int) -> list[Action]:
        out: list[Action] = []
        if unit not in self._seen_forward:
            self._seen_forward.append(unit)
        self._parked.discard(unit)  # computing again
        order = self._predicted_forward()
        if unit in order:
            self._cursor = order.index(unit)
        self._ensure_unsharded(unit, out)
        self._prefetch(order, out)
        self._wait(unit, out)
        return out

    def post_forward(self, unit: int, grad_enabled: bool) -> list[Action]:
        out: list[Action] = []
        if unit == self.root or self.pinned:
            return out  # the root stays unsharded until the step ends; [Note: pinned units]
        if self.states[unit] is not UnitState.UNSHARDED:
            return out
        if self._retaining:  # back to RETAINED, not freed: [Note: retained across micro-batches]
            self._move(unit, UnitState.RETAINED)
            self._parked.add(unit)
            return out
        keep = grad_enabled and (not self.config.reshard_after_forward or unit in self._kept)
        if not keep:
            self._move(unit, UnitState.SHARDED)
            out.append(self._actions.free[unit])
        elif self.forward_order is not None and unit != self.forward_order[-1]:
            self._parked.add(unit)  # it leaves the prefetch budget: [Note: units kept for backward]
        else:
            return out  # the last unit (its backward is next), or ZeRO-2 before the order is known
        self._prefetch(self._predicted_forward(), out)
        return out

    def choose_kept(self, config: ScheduleConfig | None = None) -> frozenset[int]:
        """The units kept from their forward to their backward under `config` (default: the
        schedule's own) ([Note: units kept for backward])."""
        forward = [u for u in self.forward_order or () if u != self.root]
        return units_kept(forward, self.unit_bytes, config or self.config)

    def end_forward(self, grad_enabled: bool) -> list[Action]:
        """The root module's forward returned."""
        out: list[Action] = []
        if self.forward_order is None:
            self.forward_order = tuple(self._seen_forward)
            self._kept = self.choose_kept()
        if not self._forward_checked:
            self._forward_checked = True
            out.append(CheckOrder("forward", order_hash(self.forward_order), self.forward_order))
        if not grad_enabled:
            if not self.pinned:
                out += self._release_all()
            self.phase = Phase.IDLE
            return out
        # Backward comes next: start gathering the first units it needs.
        self._cursor = -1
        self._gathering_for_backward = True
        self._prefetch(self.backward_units(), out)
        return out

    def _release_all(self) -> list[Action]:
        out: list[Action] = []
        for unit, state in enumerate(self.states):
            if state is UnitState.GATHERING:
                self._wait(unit, out)
            if self.states[unit] is UnitState.UNSHARDED or self.states[unit] is UnitState.RETAINED:
                self._move(unit, UnitState.SHARDED)
                out.append(self._actions.free[unit])
        self._retaining = False
        return out

    def retune(self, config: ScheduleConfig) -> None:
        """New knobs, between steps (engine/autotune.py): they change when collectives are
        issued and what is held, never what they carry ([Note: autotune])."""
        assert self.phase is Phase.IDLE, f"retune in phase {self.phase}"
        self.config = config
        self._kept = self.choose_kept()
        self.set_reshard_after_backward(self.reshard_after_backward)  # the cap may have changed

    def set_grad_bytes(self, unit: int, num_bytes: int) -> None:
        """The unit's trainable parameters changed between steps: new bucket sizes. (Ranks that
        changed different parameters are caught by the next forward all-gathers, whose tags carry
        the trainable pattern: [Note: collective fingerprints] in fingerprint.py. A check of its
        own here would run on the ranks that changed something only, and pair with the others'
        all-gathers.)"""
        assert self.phase is Phase.IDLE, f"grad bytes changed in phase {self.phase}"
        self.grad_bytes[unit] = num_bytes

    # ---------------------------------------------------------------- retention
    def set_reshard_after_backward(self, reshard_after_backward: bool) -> None:
        """`model.set_reshard_after_backward(b)`: with False, the backwards that do not sync
        keep their units unsharded when they fit ([Note: retained across micro-batches])."""
        self.reshard_after_backward = reshard_after_backward
        self._retain_allowed = not reshard_after_backward and retention_fits(self.unit_bytes, self.config)

    def _retain(self, unit: int, out: list[Action]) -> None:
        """The unit's backward ended without sync: keep it (`Retain`) instead of freeing it."""
        self._move(unit, UnitState.RETAINED)
        if unit != self.root:  # the root is outside the budget anyway
            self._parked.add(unit)  # outside the prefetch budget until it computes again
        out.append(self._actions.retain[unit])

    # ---------------------------------------------------------------- pinning
    def unshard_all(self) -> list[Action]:
        """`model.unshard()`, between steps: gather every unit and pin it ([Note: pinned units])."""
        assert self.phase is Phase.IDLE, f"unshard_all in phase {self.phase}"
        out: list[Action] = []
        self._gathering_for_backward = False  # forward gathers (hpZ: from the shards)
        for unit in range(self.num_units):
            if self.states[unit] is UnitState.SHARDED:
                self._gather(unit, out)
        for unit in range(self.num_units):
            self._wait(unit, out)
        self.pinned = True
        return out

    def reshard_all(self) -> list[Action]:
        """`model.reshard()`, between steps: free every unit ([Note: pinned units])."""
        assert self.phase is Phase.IDLE, f"reshard_all in phase {self.phase}"
        self.pinned = False
        return self._release_all()

    # ---------------------------------------------------------------- backward events
    def begin_backward(self) -> None:
        """The first gradient of this backward pass arrived (idempotent)."""
        if self.phase is not Phase.BACKWARD:
            self.phase = Phase.BACKWARD
            self._seen_backward = []
            self._finished_backward = set()
            self._started_backward = set()
            self._retain_now = not self.sync_grads and self._retain_allowed

    def pre_backward(self, unit: int) -> list[Action]:
        """The gradient of one of the unit's forward outputs arrived."""
        out: list[Action] = []
        self.begin_backward()
        if unit in self._started_backward:
            return out
        self._started_backward.add(unit)
        self._parked.discard(unit)  # its backward is the one computing now
        order = self.backward_units()
        if unit in order:
            self._cursor = order.index(unit)
        self._ensure_unsharded(unit, out)
        self._prefetch(order, out)
        self._wait(unit, out)
        return out

    def post_backward(self, unit: int) -> list[Action]:
        """All gradients of the unit are accumulated: free it and queue its gradients."""
        out: list[Action] = []
        if self.states[unit] is not UnitState.UNSHARDED:
            return out  # already handled (e.g. flushed at the end of backward)
        self._finish_unit(unit, out)
        self._prefetch(self.backward_units(), out)
        return out

    def _finish_unit(self, unit: int, out: list[Action]) -> None:
        """Free the unit's parameters; queue its gradients for reduction unless in no_sync."""
        self._seen_backward.append(unit)
        self._finished_backward.add(unit)
        reduce = self.sync_grads and self.grad_bytes[unit] > 0
        if self.states[unit] is UnitState.UNSHARDED:
            if self._retain_now:  # not synced: [Note: retained across micro-batches]
                self._retain(unit, out)
                return
            self._move(unit, UnitState.REDUCING if reduce else UnitState.SHARDED)
            out.append(self._actions.free[unit])
        elif reduce:  # no gradient reached this unit: it is reduced (as zeros) all the same
            self._move(unit, UnitState.REDUCING)
        if reduce:
            self._bucket.append(unit)
            self._bucket_bytes += self.grad_bytes[unit]
            if self._bucket_bytes >= self.config.reduce_scatter_bucket_bytes:
                out += self._issue_bucket()

    def _issue_bucket(self) -> list[Action]:
        """Reduce the open bucket.

        [Note: reduce buffers]
        A bucket's reduce-scatter input (its unsharded gradients, rank-major) is as large as the
        bucket's unsharded parameters. Holding every bucket's until the end of backward would
        hold one full unsharded gradient of the model. So at most `max_reduce_inputs` (K) are
        alive: before a new bucket allocates its input, the oldest one still alive is released
        (`ReleaseReduce`: on CUDA the compute stream waits for that reduce-scatter's event and
        drops the buffer, as FSDP2 recycles its inputs; on CPU the training thread waits for the
        work, sums what all-to-all received and drops both buffers). The reduced shards, 1/N of
        the size, stay pending until `WaitReduce` at the end of backward.
        """
        if not self._bucket:
            return []
        out: list[Action] = []
        while len(self._inputs_alive) >= self.config.max_reduce_inputs:
            oldest = self._inputs_alive.pop(0)
            out.append(ReleaseReduce(oldest.bucket, oldest.units))
        action = Reduce(self._num_buckets, tuple(self._bucket))
        self._num_buckets += 1
        self._bucket, self._bucket_bytes = [], 0
        self._in_flight.append(action)
        self._inputs_alive.append(action)
        if not self._backward_checked:  # units and sizes: a rank that froze other parameters differs
            key = ("reduce", action.units, tuple(self.grad_bytes[u] for u in action.units))
            out.append(CheckOrder("reduce", order_hash(key), action.units))
        out.append(action)
        return out

    def end_backward(self) -> list[Action]:
        """Autograd finished: flush what is left, wait for every reduction, end the step."""
        out: list[Action] = []
        order = self.backward_units()
        order += tuple(u for u in range(self.num_units) if u not in order)
        for unit in order:  # prefetched for a backward that did not come
            self._wait(unit, out)
            if self.states[unit] is UnitState.RETAINED and not self._retain_now:
                self._move(unit, UnitState.UNSHARDED)  # not reached: reduced or freed below
        # Units that did not see all their gradients (unused parameters, or no gradient at all)
        # are reduced anyway, in a fixed order, so every rank issues the same collectives.
        for unit in order:
            if self.states[unit] is not UnitState.REDUCING and (
                self.states[unit] is UnitState.UNSHARDED or self.sync_grads
            ):
                self._finish_unit(unit, out)
        out += self._issue_bucket()
        for reduce in self._in_flight:
            out.append(WaitReduce(reduce.bucket, reduce.units))
            for unit in reduce.units:
                self._move(unit, UnitState.SHARDED)
        self._in_flight = []
        self._inputs_alive = []
        retained = UnitState.RETAINED
        assert all(self.states[u] is retained for u in self._held), (
            f"units still unsharded after backward: {self.held_units()}"
        )
        self._retaining = self._retain_now
        self._backward_gathers_checked = True
        if not self._backward_checked and self.sync_grads:
            self._backward_checked = True
            self.backward_order = tuple(self._seen_backward)
            out.append(CheckOrder("backward", order_hash(self.backward_order), self.backward_order))
        self._finished_backward = set()
        self.pinned = False  # every unit was freed above: [Note: pinned units]
        self.phase = Phase.IDLE
        return out
