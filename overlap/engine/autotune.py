"""Self-tuning while training (`OverlapConfig.autotune`): feeds the policy (autotune_policy.py) the
measurements of every rank at its decision steps and sets the knobs it decides on the schedule,
between steps. [Note: autotune] in autotune_policy.py says what moves and why the numbers do not.

At a decision step each rank contributes its own StepStats of the trial's steps (step time,
exposed all-gather and reduce-scatter waits, library memory peak) and its measured memory peak
to one all-gather of a few floats over every rank of the model; every rank then holds the same
values and runs the same policy on them, so all take the same decision at the same step without
a broadcast. Steps are
the training steps (a backward that reduced): evaluation forwards and no_sync micro-batches are
not counted. On CUDA a step's StepStats are final a few steps late (events are read without
waiting: StatsRecorder.max_lag_steps), so a decision comes that many steps after its trial; the
trial's knobs keep running meanwhile.

[Note: decisions between steps]
A decision's exchange is issued when its window's last StepStats are in, at the end of a
backward; the decision itself (the policy, the model's simulator at the baseline, the retune)
runs at the start of a later forward, between steps, outside the autograd callback that ends
backward, so the optimizer step is enqueued first. On CPU (gloo) that is the next forward. On
CUDA the exchange goes up from pinned memory and comes back into pinned memory behind the
all-gather on the stream (`gather_floats_later`), and is read at the forward after the next
training step: one step later, when the device has finished it, so the host never waits for
the device at a decision. Every rank takes it at the same training step either way. A trial
step's out-of-memory verdict is the exception: it is read in the step it concerns ([Note: out
of memory in a trial] in autotune_oom.py).

Each decision is logged (logger "overlap.autotune", rank 0). With `autotune_dir` (or
`trace_dir`), rank 0 writes there at each decision `autotune.json` (decisions and per-step knobs
and times, for `overlap report`) and `tuned_config.json` (the OverlapConfig with the best knobs
so far, autotune off, to reuse).

The policy's proposals come from the step model the tools use too ([Note: the model fitted
online] in overlap/step_model/online.py), imported here: it sits below autotune, and a model that
raises leaves the search to the coordinate moves alone.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, fields
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from overlap.config import OverlapConfig
from overlap.engine.autotune_memory import (
    MemoryBudget,
    device_key,
    knobs_config,
    local_limit_bytes,
    measured_peak_bytes,
    price_bytes,
)
from overlap.engine.autotune_oom import (
    InterruptedStep,
    StepScript,
    TrialOutOfMemoryError,
    backward_abandoned,
    finish_interrupted_step,
    out_of_memory_passing,
)
from overlap.engine.autotune_policy import TRIAL, Decision, Knobs, Measurement, Mode, Proposal, TunePolicy
from overlap.engine.schedule import Phase, Schedule, ScheduleConfig
from overlap.observe.stats import StatsRecorder, StepStats
from overlap.step_model.online import StepModel
from overlap.step_model.tuning import TunerView
from overlap.transport import collectives as comm
from overlap.transport.host_values import GatheredLater, gather_floats_later

log = logging.getLogger("overlap.autotune")

_FIELDS = 4  # per step: step_ms, exposed gather, exposed reduce, memory peak
_HEADER = 3  # per rank: its device's key, its own memory limit, its measured peak


class _Due(NamedTuple):
    """A decision whose exchange was issued at the end of a step ([Note: decisions between steps])."""

    recheck: bool  # settled: a look at the step, not a trial's end
    rows: GatheredLater
    read_after: int  # taken at the first forward after this training step ended


def knobs_of(config: ScheduleConfig) -> Knobs:
    """The tuned knobs of `config`: each is named as in OverlapConfig and ScheduleConfig."""
    return Knobs(**{f.name: getattr(config, f.name) for f in fields(Knobs)})


def with_knobs(config: OverlapConfig, knobs: Knobs) -> OverlapConfig:
    """`config` with `knobs` set, autotune off: the configuration to reuse."""
    return config.replace(
        **{f.name: getattr(knobs, f.name) for f in fields(Knobs)}, autotune=False, autotune_calibration=None
    )


class AutoTuner:
    """Drives a `TunePolicy` from one wrapped model's step statistics."""

    def __init__(
        self,
        schedule: Schedule,
        stats: StatsRecorder,
        config: OverlapConfig,
        group: dist.ProcessGroup,
        device: torch.device,
        timeout: timedelta | None,
        tune_buckets: bool,
        num_ranks: int = 1,
        num_replicas: int = 1,
        shared_memory: bool = False,
    ) -> None:
        self.schedule, self.stats, self.config = schedule, stats, config
        self.shared_memory = shared_memory  # the transport's: what the model's defaults price
        self.group, self.device, self.timeout = group, device, timeout
        self.rank = dist.get_rank(group)
        self.lag = stats.max_lag_steps if device.type == "cuda" else 0
        self.stream_ordered = device.type == "cuda"  # decisions read a step late: [Note: decisions between steps]
        self.num_ranks, self.num_replicas, self.tune_buckets = num_ranks, num_replicas, tune_buckets
        if config.autotune_calibration is not None and not os.path.isfile(config.autotune_calibration):
            raise ValueError(
                f"overlap.wrap: autotune_calibration={config.autotune_calibration!r}: no such file (write one "
                "with `overlap plan --calibrate FILE`, or use an earlier run's calibration.json)"
            )
        # the cap is read at the baseline, once the optimizer state exists ([Note: autotune memory])
        self.policy = TunePolicy(
            knobs_of(schedule.config), None, self._signature, tune_buckets, self._propose, self._price
        )
        self.memory: MemoryBudget | None = None
        """The cap and the baseline's measured peak, from the baseline decision on."""
        # [Note: out of memory in a trial] in autotune_oom.py; settled, no trial runs: nothing recorded
        self.script = StepScript(schedule, lambda: self.policy.mode is not Mode.SETTLED)
        self.interrupted: str | None = None
        """What interrupted this rank's trial step (finished at its next forward); None: nothing."""
        self._due: _Due | None = None  # a decision whose exchange is issued, not yet taken
        self._stats_step: dict[int, int] = {}  # training step -> StatsRecorder step
        self._knobs_at: dict[int, Knobs] = {}  # training step -> knobs it ran with
        self._published: dict[int, StepStats] = {}  # StatsRecorder step -> its stats
        self.history: list[dict[str, Any]] = []  # rank-local, per training step, for the report
        self.steps = 0  # training steps done
        self._recorded = 0  # training steps in `history`
        folder = config.autotune_dir or config.trace_dir
        self.folder = Path(folder) if folder and self.rank == 0 else None
        self._logged = 0

    # ------------------------------------------------------------ what a setting does
    def _signature(self, knobs: Knobs) -> tuple:
        """What `knobs` make the schedule do: settings that form the same buckets and keep the
        same units behave the same, and are measured once."""
        s = self.schedule
        config = self._schedule_config(knobs)
        kept = s.choose_kept(config) if s.forward_order is not None else None
        buckets, size = [], 0
        for unit in s.backward_units():
            if s.grad_bytes[unit] == 0:
                continue
            size += s.grad_bytes[unit]
            if size >= knobs.reduce_scatter_bucket_bytes:
                buckets.append(unit)
                size = 0
        return (knobs.prefetch_depth, knobs.max_inflight_allgather_bytes, tuple(buckets), kept, knobs.max_reduce_inputs)

    def _price(self, old: Knobs, new: Knobs) -> int:
        """The bytes a move adds to the peak ([Note: autotune memory])."""
        if self.schedule.forward_order is None:
            return 0
        return price_bytes(self.schedule, self._schedule_config(old), self._schedule_config(new))

    def _propose(self, knobs: Knobs, measured: Measurement) -> list[Proposal]:
        """The step model's proposals from the baseline `measured` under `knobs`."""
        s = self.schedule
        if s.forward_order is None:
            return []
        view = TunerView(
            tuple(s.unit_bytes), tuple(s.grad_bytes), tuple(s.forward_order), s.root,
            s.config.reshard_after_forward, "nccl" if self.device.type == "cuda" else "gloo",
            self.num_ranks, self.num_replicas, self.tune_buckets, self.config.autotune_calibration,
            None if self.folder is None else str(self.folder), self.shared_memory,
        )  # fmt: skip
        try:
            return StepModel(view).propose(knobs, measured)
        except Exception as e:
            log.warning(
                "overlap autotune: the model could not propose (%s: %s); coordinate moves only", type(e).__name__, e
            )
            return []

    def _schedule_config(self, knobs: Knobs) -> ScheduleConfig:
        return knobs_config(self.schedule.config, knobs)

    # ------------------------------------------------------------ a trial step interrupted
    def forward_raised(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """The root module's forward hook (always called): an out-of-memory error passing out of
        a trial step's forward interrupts it ([Note: out of memory in a trial])."""
        if output is not None or not self.policy.guarded or self.schedule.phase is not Phase.FORWARD:
            return
        error = out_of_memory_passing()
        if error is not None:
            self.interrupted = f"{type(error).__name__} in forward"

    def before_forward(self, state: InterruptedStep) -> None:
        """A forward starts: first finish a trial step this rank left unfinished."""
        if self.interrupted is None and self.policy.guarded and backward_abandoned(self.schedule):
            self.interrupted = "an error in backward"
        if self.interrupted is not None:
            log.warning(
                "overlap autotune: rank %d: %s in a trial step; finishing its collectives", self.rank, self.interrupted
            )
            finish_interrupted_step(state, self.script)
        if self._due is not None and self.steps > self._due.read_after and self.schedule.phase is Phase.IDLE:
            self._decide()

    def _trial_verdict(self, t: int) -> bool:
        """While a trial that adds memory is in force: whether any rank's step t was interrupted, one small
        all-gather; if so the trial is reverted on every rank, and the ranks that were not
        interrupted raise ([Note: out of memory in a trial]). True: reverted."""
        flags = comm.all_gather_int(int(self.interrupted is not None), self.group, self.device, self.timeout)
        failed = [r for r, flag in enumerate(flags) if flag]
        if not failed:
            return False
        mine, self.interrupted = self.interrupted, None
        why = f"out of memory on rank(s) {failed} at step {t}"
        self.schedule.retune(self._schedule_config(self.policy.fail_trial(t, why)))
        self._report()
        if mine is None:
            raise TrialOutOfMemoryError(
                f"overlap autotune: rank(s) {failed} of the model's group ran out of memory in the trial "
                f"at step {t} (reverted on every rank): skip this step (zero the gradients, no optimizer "
                "step), as for an out-of-memory error of this rank"
            )
        return True

    # ------------------------------------------------------------ events
    def observe(self, published: list[StepStats]) -> None:
        """StepStats the recorder published this step (possibly of earlier steps)."""
        for stats in published:
            self._published[stats.step] = stats
        self._catch_up()

    def _catch_up(self) -> None:
        """History rows for the training steps whose StepStats are in (CUDA: some steps late)."""
        while self._recorded < self.steps:
            stats = self._published.get(self._stats_step.get(self._recorded, -1))
            if stats is None:
                return
            self.history.append(
                {
                    "step": self._recorded,
                    "step_ms": stats.step_ms,
                    "gather_wait_ms": stats.allgather_wait_ms,
                    "reduce_wait_ms": stats.reduce_wait_ms,
                    "memory_peak_bytes": stats.memory_peak_bytes,
                    **asdict(self._knobs_at[self._recorded]),
                }
            )
            self._recorded += 1

    def end_training_step(self, stats_step: int) -> None:
        """A training step ended (the schedule is idle): a trial's verdict, and the exchange of a
        decision that is due, decided at a later forward ([Note: decisions between steps])."""
        t = self.steps
        self.steps += 1
        self._stats_step[t] = stats_step
        self._knobs_at[t] = self.policy.current
        self._catch_up()
        policy = self.policy
        if policy.guarded and self._trial_verdict(t):
            self._due = None  # issued for a trial that is gone: dropped on every rank
            return
        if self._due is not None:
            return
        if policy.mode is Mode.SETTLED:
            window = policy.recheck_window(t - self.lag)
        else:
            first, end = policy.window()
            window = (first, end) if t == end - 1 + self.lag else None
        if window is not None:
            rows = gather_floats_later(self._local_row(window), self.group, self.device, self.timeout)
            self._due = _Due(policy.mode is Mode.SETTLED, rows, t + int(self.stream_ordered))

    def _decide(self) -> None:
        """Between steps, before a forward: take the decision whose exchange is in, and apply it."""
        due, self._due = self._due, None
        assert due is not None
        step = self.steps - 1  # the last training step: the knobs apply from the next one
        trial, header = self._measurements(due.rows.rows())
        if due.recheck:
            knobs = self.policy.recheck(step, trial)
        else:
            if self.policy.mode is Mode.WARMUP:
                self._read_memory_limit(step, header)
            knobs = self.policy.decide(step, trial)
        self.schedule.retune(self._schedule_config(knobs))
        self._report()
        self._forget(step)

    def _read_memory_limit(self, step: int, header: list[list[float]]) -> None:
        """The cap, at the baseline: after WARMUP steps and a window, so the optimizer state and
        every buffer of a step are in the measured peak ([Note: autotune memory]). `header`: each
        rank's device key, its device's share for autotune (MEMORY_FRACTION of the total) and its
        measured peak; ranks with the same key share that device."""
        limit = self.config.autotune_memory_bytes
        if limit is None:
            keys = [row[0] for row in header]
            limit = min(int(row[1]) // keys.count(row[0]) for row in header)
        peak = int(max(row[2] for row in header))
        self.memory = MemoryBudget(limit, peak, step)
        self.policy.memory_cap = limit

    def _local_row(self, window: tuple[int, int]) -> list[float]:
        """This rank's part of a decision's exchange: _HEADER values (its device's key,
        MEMORY_FRACTION of the device's memory, its measured peak), then per step of the window
        its StepStats (NaN: not published)."""
        local = [
            float(device_key(self.device)),
            float(local_limit_bytes(None, self.device, 1)),
            float(measured_peak_bytes(self.device)),
        ]
        for t in range(*window):
            stats = self._published.get(self._stats_step.get(t, -1))
            if stats is None:
                local += [math.nan] * _FIELDS
            else:
                local += [stats.step_ms, stats.allgather_wait_ms, stats.reduce_wait_ms, float(stats.memory_peak_bytes)]
        return local

    @staticmethod
    def _measurements(rows: list[list[float]]) -> tuple[list[Measurement], list[list[float]]]:
        """Every rank's rows of a decision's exchange: per step the slowest rank's time, the largest
        exposed waits and memory peaks; and the ranks' headers."""
        header = [row[:_HEADER] for row in rows]
        device_peak = int(max(row[2] for row in header))
        trial = []
        for at in range(_HEADER, len(rows[0]), _FIELDS):
            seen = [r[at : at + _FIELDS] for r in rows if not math.isnan(r[at])]
            if seen:
                fields = (max(r[f] for r in seen) for f in range(3))
                trial.append(Measurement(*fields, int(max(r[3] for r in seen)), device_peak))
        return trial or [Measurement(math.inf, 0.0, 0.0, 0, device_peak)], header

    def _forget(self, t: int) -> None:
        oldest = min(t - TRIAL - self.lag - 1, self._recorded)  # nothing before this is read again
        for old in [k for k in self._stats_step if k < oldest]:
            self._published.pop(self._stats_step.pop(old), None)
            self._knobs_at.pop(old, None)

    # ------------------------------------------------------------ what is told
    def tuned_config(self) -> OverlapConfig:
        """The config with the best knobs measured so far (the settled ones once settled)."""
        return with_knobs(self.config, self.policy.best)

    def _report(self) -> None:
        new: list[Decision] = self.policy.decisions[self._logged :]
        self._logged = len(self.policy.decisions)
        if self.rank != 0:
            return
        for d in new:
            log.info("overlap autotune, step %d: %s %s", d.step, d.action, d.reason)
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        data = {
            "decisions": [asdict(d) for d in self.policy.decisions],
            "history": self.history,
            "settled": self.policy.mode is Mode.SETTLED,
            "knobs": asdict(self.policy.current),
        }
        (self.folder / "autotune.json").write_text(json.dumps(data, indent=1, default=str))
        try:
            self.tuned_config().save(self.folder / "tuned_config.json")  # the best so far, then the settled
        except ValueError as e:  # a unit_policy of classes or a callable has no JSON form
            log.warning("overlap autotune: tuned_config.json not written: %s", e)
