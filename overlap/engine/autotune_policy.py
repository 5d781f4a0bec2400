"""The self-tuning policy (`OverlapConfig.autotune`): which schedule knobs to try next, and whether a
trial is kept. Pure: no tensors, no process groups, no clocks. Every rank runs one with the same
inputs (the measurements of every rank, gathered), so every rank takes the same decision at the
same step; `engine/autotune.py` feeds it and applies what it decides.

[Note: autotune]
The knobs are the schedule's (`Knobs`): prefetch depth, the cap on gathered bytes, the
reduce-scatter bucket size, the bytes kept from forward to backward and the reduce-scatter
inputs alive at once. They decide when a collective is issued and how long a buffer lives,
never what is summed: the gathered parameters are the same bytes whenever they arrive. Whether
the order of a sum stays the same depends on the backend. gloo's reduce-scatter (and the host
transports) sums each element over the ranks in rank order whatever the bucket around it, so on
gloo a tuned run is bitwise the run that had its final knobs from the start
(tests/engine/test_autotune.py). NCCL chooses its algorithm, protocol and channel split by message
size, so a bucket move changes the order in which an element's contributions are added and the
gradients may differ in the last bit from that run; prefetch, keep, in-flight and
reduce-input moves change no number there either. The bucket size is not moved under a
gradient codec: its blocks and error-feedback residuals follow the buckets.

The search starts from the configured knobs and the model's proposals, then descends one
coordinate at a time:

    WARMUP steps (first step's checks and allocations) -> a window of the configured knobs
    the model's proposals (`Ranker`, at most MODEL_TRIALS): joint moves of several knobs at once
        that the simulator, fitted to this window, predicts at least HYSTERESIS faster; each
        tried as a move is (below)
    for each knob, each move (up, then down): refused untried when its predicted peak crosses
        the memory cap ([Note: autotune memory] in autotune_memory.py); else a window of the
        move, then one of the best knobs; keep the move when its step is at least HYSTERESIS
        faster than the best's windows just before and after it, and its memory stays under
        the cap; a kept move is tried again in the same direction, else reverted (at once, when
        it ran a rank out of memory: [Note: out of memory in a trial] in autotune_oom.py)
        a prefetch depth one deeper that was flat (within HYSTERESIS either way) is followed,
        at the end of the pass, by the deepest one: gathers that already arrive in time one
        unit ahead can still be late in backward, where a deeper queue starts them earlier
    a pass over every knob without a kept move -> settled

The model proposes, measurement decides: a proposal is kept only as any move is, so a model
that is wrong costs its trial windows and never the run's speed. It is the one the tools use
(overlap/step_model/online.py: the simulator of `overlap plan` and `overlap tune`, its compute
and links fitted to the baseline window's step and exposed waits), which `engine/autotune.py`
imports: the step model sits below the engine's autotune, the tools above both.

A window is SETTLE steps under its knobs (not measured: the first step after a change allocates
differently) and TRIAL measured steps; its score is the median over those steps of the slowest
rank's step time (the slowest rank sets everyone's pace). A move is compared with the best knobs
measured on both sides of it, not with a score from minutes ago: on a shared machine the step
drifts while the search runs, and the drift must not decide (how RESULTS.md measures too). Settled, the policy looks
again every RECHECK steps (one small collective, nothing per step) and searches again from the
settled knobs when the step has moved by more than DRIFT from the settled score (a slower link,
a longer sequence); within DRIFT it stays (hysteresis).
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, replace

# the vocabulary the online model speaks too, defined below both (re-exported: the tuner's names)
from overlap.step_model.tuning import MAX_PREFETCH_DEPTH, MAX_REDUCE_INPUTS, Knobs, Measurement, Proposal

WARMUP = 3
SETTLE = 1
TRIAL = 4
HYSTERESIS = 0.02
RECHECK = 50
DRIFT = 0.10
MODEL_TRIALS = 2


@dataclass(frozen=True)
class Decision:
    """One decision, with its reason, as logged."""

    step: int
    knob: str
    old: object
    new: object
    action: str  # "baseline", "model", "try", "refuse", "keep", "revert", "settle", "retune"
    reason: str


Pricer = Callable[[Knobs, Knobs], int]
"""(from, to) -> the bytes the move adds to the peak (negative: frees); [Note: autotune memory]."""

Ranker = Callable[[Knobs, Measurement], list[Proposal]]
"""(the baseline knobs, the baseline window's score as a Measurement) -> proposals, fastest
predicted first. Called at every baseline (the first and each re-tune's); deterministic, so
every rank proposes the same."""


class Mode(enum.Enum):
    WARMUP = "warmup"
    TRIAL = "trial"
    SETTLED = "settled"


def score(trial: list[Measurement]) -> float:
    return statistics.median(m.step_ms for m in trial)


class TunePolicy:
    """Decides the knobs step by step; see [Note: autotune].

    `signature(knobs)` names what a setting does (the units kept, the buckets formed, ...): a
    move whose signature was already measured, or equals the current one, is skipped.
    `moves(knobs)` yields (knob name, new knobs) in the order to try them.

    `memory_cap` is the limit on the measured peak (`Measurement.device_peak_bytes`); the tuner
    sets it at the baseline when it was not configured (None: no limit). `price(a, b)` says what
    a move adds to the peak; a move predicted to cross the cap is refused untried."""

    def __init__(
        self,
        start: Knobs,
        memory_cap: int | None,
        signature: Callable[[Knobs], Hashable],
        tune_buckets: bool = True,
        ranker: Ranker | None = None,
        price: Pricer | None = None,
    ) -> None:
        self.best = self.current = self._baseline_knobs = start
        self.best_score = math.inf
        self.memory_cap = memory_cap
        self.price = price
        self.signature = signature
        self.tune_buckets = tune_buckets
        self.ranker = ranker
        self.mode = Mode.WARMUP
        self.decisions: list[Decision] = []
        self._trial_start = WARMUP  # step at which the current trial's measured steps begin
        self._pending: Iterator[tuple[str, Knobs]] | None = None
        self._knob: str | None = None
        self._tried: set[Hashable] = set()
        self._kept_this_pass = False
        self._trying = start  # the knobs of the trial under way
        self._candidate: tuple[float, int, str] | None = None  # its score, peak, exposed: measured, not yet compared
        self._reference = math.inf  # the best knobs' latest score
        self._flat: set[Hashable] = set()  # signatures of reverted moves within HYSTERESIS
        self._baseline_peak = 0  # the baseline window's library memory peak
        self._best_peak = 0  # the best knobs' library memory peak, as last measured
        self.baseline_device_peak = 0  # the measured peak at the baseline ([Note: autotune memory])
        self._device_peak = 0  # the measured peak at the latest decision
        self._peak_before_trial = 0  # ... at the decision that started the trial under way
        self._extra: dict[Knobs, int] = {}  # the model's own price of each proposal
        self._trial_grows = False  # the move in force adds memory
        self._model_reason: dict[Knobs, str] = {}  # why the model proposed each proposal

    @property
    def trialing(self) -> bool:
        """A move is in force (the same on every rank at the same step)."""
        return self.mode is Mode.TRIAL and self.current != self.best

    @property
    def guarded(self) -> bool:
        """A move that adds memory is in force: its steps are watched for an out-of-memory error
        ([Note: out of memory in a trial] in autotune_oom.py). A move that holds less cannot
        run a rank out of memory the configured or best knobs did not."""
        return self.trialing and self._trial_grows

    def fail_trial(self, step: int, reason: str) -> Knobs:
        """The move in force ran a rank out of memory: revert it at once, and refuse from now on
        any move predicted to hold as much ([Note: out of memory in a trial] in autotune_oom.py)."""
        assert self.guarded, f"fail_trial at step {step} without a trial that adds memory in force"
        knob, failed = self._knob or "-", self._trying
        self._log(step, knob, _value(failed, knob), _value(self.best, knob), "revert", reason)
        ceiling = self.predicted_peak(self.best, failed) - 1
        self.memory_cap = ceiling if self.memory_cap is None else min(self.memory_cap, ceiling)
        self._candidate = None
        self.current = self.best
        return self._next_trial(step)

    # ------------------------------------------------------------ when
    def window(self) -> tuple[int, int] | None:
        """The steps [first, end) whose measurements the next decision needs (None: settled and
        not due for a look yet: `recheck_window`)."""
        if self.mode is Mode.SETTLED:
            return None
        return self._trial_start, self._trial_start + TRIAL

    def recheck_window(self, step: int) -> tuple[int, int] | None:
        """Settled: every RECHECK steps, the last TRIAL steps."""
        since = step + 1 - self._trial_start  # steps run since it settled
        if self.mode is not Mode.SETTLED or since < RECHECK or since % RECHECK:
            return None
        return step - TRIAL + 1, step + 1

    # ------------------------------------------------------------ what
    def moves(self, knobs: Knobs) -> Iterator[tuple[str, Knobs]]:
        """Each knob's moves from `knobs`, up before down."""
        depth = knobs.prefetch_depth
        if depth < MAX_PREFETCH_DEPTH:
            yield "prefetch_depth", replace(knobs, prefetch_depth=depth + 1)
        if depth > 0:
            yield "prefetch_depth", replace(knobs, prefetch_depth=depth - 1)
        if knobs.max_inflight_allgather_bytes is not None:  # a cap the user set: never lifted, only moved
            yield (
                "max_inflight_allgather_bytes",
                replace(knobs, max_inflight_allgather_bytes=knobs.max_inflight_allgather_bytes * 2),
            )
            yield (
                "max_inflight_allgather_bytes",
                replace(knobs, max_inflight_allgather_bytes=max(1, knobs.max_inflight_allgather_bytes // 2)),
            )
        if self.tune_buckets:
            bucket = knobs.reduce_scatter_bucket_bytes
            yield "reduce_scatter_bucket_bytes", replace(knobs, reduce_scatter_bucket_bytes=max(2 * bucket, 1 << 20))
            if bucket:
                yield (
                    "reduce_scatter_bucket_bytes",
                    replace(knobs, reduce_scatter_bucket_bytes=bucket // 2 if bucket >= 2 << 20 else 0),
                )
        if knobs.max_inflight_allgather_bytes is None:  # the cap turns keeping off ([Note: units kept for backward])
            yield (
                "keep_for_backward_bytes",
                replace(knobs, keep_for_backward_bytes=max(2 * knobs.keep_for_backward_bytes, 1 << 20)),
            )
            if knobs.keep_for_backward_bytes:
                yield (
                    "keep_for_backward_bytes",
                    replace(knobs, keep_for_backward_bytes=knobs.keep_for_backward_bytes // 2),
                )
        inputs = knobs.max_reduce_inputs
        if inputs < MAX_REDUCE_INPUTS:
            yield "max_reduce_inputs", replace(knobs, max_reduce_inputs=inputs + 1)
        if inputs > 1:
            yield "max_reduce_inputs", replace(knobs, max_reduce_inputs=inputs - 1)
        if depth + 1 < MAX_PREFETCH_DEPTH and self.signature(replace(knobs, prefetch_depth=depth + 1)) in self._flat:
            yield "prefetch_depth", replace(knobs, prefetch_depth=MAX_PREFETCH_DEPTH)  # one deeper was flat

    def _proposals(self, proposals: list[Proposal]) -> Iterator[tuple[str, Knobs]]:
        """The model's proposals (at most MODEL_TRIALS: predicted HYSTERESIS faster, under the
        memory cap, not measured yet), then the coordinate moves from the best knobs."""
        taken = 0
        for p in proposals:
            if taken == MODEL_TRIALS:
                break
            faster = p.predicted_ms <= p.baseline_predicted_ms * (1 - HYSTERESIS)
            if not faster or self.signature(p.knobs) in self._tried:
                continue
            self._extra[p.knobs] = p.extra_bytes
            if self._refused(self.best, p.knobs) is not None:
                continue  # refused untried, and does not take a model trial's place
            taken += 1
            self._model_reason[p.knobs] = (
                f"model predicts {p.predicted_ms:.2f} ms vs {p.baseline_predicted_ms:.2f} ms{p.reason}"
            )
            yield "model", p.knobs
        yield from self.moves(self.best)

    def _next_trial(self, step: int) -> Knobs:
        """The next untried move from the best knobs; settles when a pass kept nothing."""
        while True:
            if self._pending is None:
                self._pending = self.moves(self.best)
            for knob, knobs in self._pending:
                key = self.signature(knobs)
                if key in self._tried:
                    continue
                self._tried.add(key)
                refused = self._refused(self.best, knobs)
                if refused is not None:
                    self._log(step, knob, _value(self.best, knob), _value(knobs, knob), "refuse", refused)
                    continue
                self._knob = knob
                if knob == "model":
                    why = f"{_changes(self.best, knobs)}: {self._model_reason.get(knobs, '')}"
                else:
                    why = f"{knob}: {getattr(self.best, knob)} -> {getattr(knobs, knob)}"
                return self._start(step, knob, knobs, "try", why)
            if not self._kept_this_pass:
                self.mode = Mode.SETTLED
                self._trial_start = step + 1
                self._log(
                    step,
                    "-",
                    None,
                    None,
                    "settle",
                    f"no move faster by {HYSTERESIS:.0%}: {self.best}, step {self.best_score:.2f} ms",
                )
                self.current = self.best
                return self.best
            self._pending, self._kept_this_pass = None, False  # another pass from the new best

    def predicted_peak(self, start: Knobs, knobs: Knobs) -> int:
        """The measured peak predicted for `knobs`, moved to from `start` (the best knobs): the
        baseline's plus the most of: the move's price from the baseline's knobs, what `start`
        measured above the baseline in the library's account plus the move's price from
        `start`, and the model's own price."""
        price = self.price or (lambda a, b: 0)
        measured = max(0, self._best_peak - self._baseline_peak) + price(start, knobs)
        extra = max(price(self._baseline_knobs, knobs), measured, self._extra.get(knobs, 0))
        return self.baseline_device_peak + extra

    def _refused(self, start: Knobs, knobs: Knobs) -> str | None:
        """Why a move may not be tried (None: it may): predicted over the cap, or the measured
        peak is over it already and the move would add more."""
        if self.memory_cap is None:
            return None
        predicted = self.predicted_peak(start, knobs)
        if predicted <= max(self.memory_cap, self.baseline_device_peak):
            return None  # within the cap, or adds nothing to a peak that is over it already
        if self._device_peak > self.memory_cap:
            return f"not tried: the measured peak {self._device_peak} B is over the cap {self.memory_cap} B already"
        return (
            f"not tried: predicted peak {predicted} B (baseline {self.baseline_device_peak} B, "
            f"+{predicted - self.baseline_device_peak} B) over the cap {self.memory_cap} B"
        )

    def _start(self, step: int, knob: str, knobs: Knobs, action: str, reason: str) -> Knobs:
        self._log(step, knob, _value(self.current, knob), _value(knobs, knob), action, reason)
        self._peak_before_trial = self._device_peak
        price = self.price(self.best, knobs) if self.price is not None else 1  # unpriced: may grow
        self._trial_grows = max(price, self._extra.get(knobs, 0)) > 0
        self.current = self._trying = knobs
        self._trial_start = step + 1 + SETTLE
        return knobs

    def _log(self, step: int, knob: str, old: object, new: object, action: str, reason: str) -> None:
        self.decisions.append(Decision(step, knob, old, new, action, reason))

    def decide(self, step: int, trial: list[Measurement]) -> Knobs:
        """The measurements of the window (`window()`), one per step; returns the knobs to run
        from the next step on. Called at the same step on every rank with the same values."""
        assert self.mode is not Mode.SETTLED
        value = score(trial)
        self._device_peak = max(m.device_peak_bytes for m in trial)
        if self.mode is Mode.WARMUP:
            self.mode = Mode.TRIAL
            self.best_score = self._reference = value
            self._tried.add(self.signature(self.best))
            self._baseline_knobs = self.best
            self._baseline_peak = self._best_peak = max(m.memory_peak_bytes for m in trial)
            self.baseline_device_peak = self._device_peak
            self._log(step, "-", None, None, "baseline", f"{self.best}: step {value:.2f} ms; {_exposed(trial)}")
            proposals: list[Proposal] = []
            if self.ranker is not None:
                proposals = self.ranker(self.best, Measurement(value, *_median_waits(trial), self._baseline_peak))
                lead = (
                    f"fastest predicted {_changes(self.best, proposals[0].knobs)}: {proposals[0].predicted_ms:.2f} ms vs {proposals[0].baseline_predicted_ms:.2f} ms{proposals[0].reason}"
                    if proposals
                    else "nothing to propose"
                )
                self._log(step, "model", None, None, "model", f"{len(proposals)} settings simulated; {lead}")
            self._pending = self._proposals(proposals)
            return self._next_trial(step)
        if self._candidate is None:  # the candidate's window: now the best again, beside it
            peak = max(m.memory_peak_bytes for m in trial)
            self._candidate = (value, peak, self._device_peak, _exposed(trial))
            self.current = self.best
            self._trial_start = step + 1 + SETTLE
            return self.best
        (value, peak, device_peak, exposed), self._candidate = self._candidate, None
        after = score(trial)
        reference = (self._reference + after) / 2  # the best, measured before and after it
        self._reference = after
        knob = self._knob or "-"
        candidate = self._trying
        over = self._over_cap(peak, device_peak)
        versus = f"step {value:.2f} ms vs {reference:.2f} ms ({value / reference - 1:+.1%}); {exposed}"
        if value < reference * (1 - HYSTERESIS) and not over:
            self._log(step, knob, _value(self.best, knob), _value(candidate, knob), "keep", versus)
            self.best, self.best_score, self._reference = candidate, value, value
            self._best_peak = peak
            self._kept_this_pass = True
            self._pending = _same_first(self.moves(self.best), knob)  # the same direction again first
        else:
            why = over or f"{versus}: not {HYSTERESIS:.0%} faster"
            if not over and value < reference * (1 + HYSTERESIS):
                self._flat.add(self.signature(candidate))
            self._log(step, knob, _value(candidate, knob), _value(self.best, knob), "revert", why)
            self.best_score = reference
        return self._next_trial(step)

    def _over_cap(self, peak: int, device_peak: int) -> str:
        """Why the trial's memory disqualifies it ("": it does not): its measured peak rose over
        the cap during it, or its library peak puts the baseline's over it."""
        cap = self.memory_cap
        if cap is None:
            return ""
        if device_peak > cap and device_peak > self._peak_before_trial:
            return f"measured peak {device_peak} B over the cap {cap} B"
        predicted = self.baseline_device_peak + peak - self._baseline_peak
        if predicted > cap and peak > self._best_peak:
            return f"library peak {peak} B puts the measured peak at {predicted} B, over the cap {cap} B"
        return ""

    def recheck(self, step: int, trial: list[Measurement]) -> Knobs:
        """Settled: search again if the step moved by more than DRIFT from the settled score."""
        value = score(trial)
        if abs(value / self.best_score - 1) <= DRIFT:
            return self.current
        self._log(
            step, "-", None, None, "retune", f"step {value:.2f} ms vs settled {self.best_score:.2f} ms: searching again"
        )
        self.mode = Mode.WARMUP
        self._pending, self._tried, self._kept_this_pass, self._candidate = None, set(), False, None
        self._flat = set()
        self._trial_start = step + 1
        return self.current


def _median_waits(trial: list[Measurement]) -> tuple[float, float]:
    return statistics.median(m.gather_wait_ms for m in trial), statistics.median(m.reduce_wait_ms for m in trial)


def _exposed(trial: list[Measurement]) -> str:
    gather, reduce = _median_waits(trial)
    return f"exposed gather {gather:.2f} ms, reduce {reduce:.2f} ms"


def _value(knobs: Knobs, knob: str) -> object:
    """A knob's value for the log; a model move changes several: the knobs themselves."""
    return knobs if knob == "model" else getattr(knobs, knob, None)


def _changes(old: Knobs, new: Knobs) -> str:
    """'prefetch_depth 1 -> 4, max_reduce_inputs 1 -> 2'."""
    names = [f for f in Knobs.__dataclass_fields__ if getattr(old, f) != getattr(new, f)]
    return ", ".join(f"{f} {getattr(old, f)} -> {getattr(new, f)}" for f in names)


def _same_first(moves: Iterator[tuple[str, Knobs]], knob: str) -> Iterator[tuple[str, Knobs]]:
    """`moves` with those of `knob` first (after a kept move, the same direction is tried again;
    the opposite one returns to a measured signature and is skipped)."""
    listed = list(moves)
    yield from (m for m in listed if m[0] == knob)
    yield from (m for m in listed if m[0] != knob)
