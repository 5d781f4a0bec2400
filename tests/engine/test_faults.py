"""Faults: a rank killed or frozen mid-step, and a config that differs across ranks.

A dead rank breaks its process group for good, so these checks cannot share `harness.World`'s
long-lived ranks. Each case gets its own short-lived ranks instead, forked from one forkserver
that has torch and overlap imported already (a fresh interpreter per rank costs seconds of CPU
on two cores; a fork costs milliseconds, and unlike a plain fork of the pytest process it never
inherits a started OpenMP pool). All cases start at once and are collected under one deadline;
a rank that has not answered by then is named as hung.

The victim rank stops at a chosen (step, phase): at its n-th all-gather or reduce-scatter of
that phase (a patched `Runtime` verb, before the collective is issued), or after backward,
before the optimizer. It stops by `os._exit`, SIGKILL (its sockets close: the survivors' gloo
pairs fail at once) or SIGSTOP (its sockets stay open: only `collective_timeout_s` ends the
survivors' waits). Every survivor must raise `overlap.comm.CollectiveError` naming itself, the
collective and unit, and the timeout, within `collective_timeout_s` + `SLACK_S` of the stop.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import pytest
import torch
import torch.multiprocessing as mp
from helpers.harness import PRELOAD

# "overlap: rank 1: the all-gather of unit2 (blocks.1) failed after 0.0s (collective_timeout_s=2): ..."
_NAMED_FAILURE = (
    r"overlap: rank \d+: the (all-gather of (root|unit\d+ \(.+?\))|gradient reduction of "
    r"bucket\d+ \[.+?\]) failed after \d+\.\ds \(collective_timeout_s=\d"
)
# Load: all cases run at once (17 ranks on 2 cores), and CI's machine is shared. A wait of a
# healthy rank on a healthy peer may then take seconds, so the timeout must be far above that
# (else a survivor raises before the victim reached its fault), and the survivor's error is bounded
# by what tells the two timeouts apart, not by a wall-clock guess: it must come long before the
# process group's own timeout could have ended the wait.
COLLECTIVE_TIMEOUT_S = 10.0  # overlap's bound on each wait, what the survivors must honour
PG_TIMEOUT_S = 600  # the process group's own bound: far above, so it never decides a result
SLACK_S = 60.0  # survivor's error after the victim stopped: within the timeout plus this
DEADLINE_S = 300.0  # every case, all ranks: answer within this or be named as hung

_CTX = mp.get_context("forkserver")  # the harness's forkserver ([harness] module docstring)
_CTX.set_forkserver_preload([*PRELOAD, "test_faults"])

Phase = Literal["forward gather", "backward gather", "backward reduce", "before optimizer"]
How = Literal["exit", "sigkill", "sigstop"]


@dataclass(frozen=True)
class Fault:
    """Where and how the victim rank stops."""

    world_size: int
    victim: int
    step: int
    phase: Phase
    nth: int = 1  # the n-th gather/reduce of that phase in that step (1-based)
    how: How = "exit"


FAULTS = {
    "forward-gather-exit": Fault(world_size=2, victim=1, step=1, phase="forward gather", nth=3),
    "backward-gather-sigkill": Fault(world_size=3, victim=0, step=1, phase="backward gather", nth=2, how="sigkill"),
    # the last reduce-scatter (the root's): no gather is left, the survivors fail in its wait
    "backward-reduce-exit": Fault(world_size=3, victim=1, step=1, phase="backward reduce", nth=5),
    "before-optimizer-sigkill": Fault(world_size=2, victim=0, step=1, phase="before optimizer", how="sigkill"),
    "backward-reduce-stuck": Fault(world_size=3, victim=2, step=1, phase="backward reduce", nth=1, how="sigstop"),
    "forward-gather-stuck": Fault(world_size=2, victim=0, step=2, phase="forward gather", nth=1, how="sigstop"),
}


# ------------------------------------------------------------------------- ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


Report = Callable[[tuple[Any, ...]], None]


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., None], kwargs: dict, results: Any) -> None:
    """One rank: join a fresh gloo group, run `fn`, which reports exactly once, then leave.

    It leaves by `os._exit`: after a fault the group is broken and tearing it down could block.
    """
    import torch.distributed as dist

    torch.set_num_threads(1)

    def report(message: tuple[Any, ...]) -> None:
        results.put((rank, *message))
        results.close()
        results.join_thread()  # flushed before the process can vanish

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=PG_TIMEOUT_S),
        )
        fn(rank, world_size, report, **kwargs)
    except BaseException as e:
        report(("error", f"{type(e).__name__}: {e}", time.time()))
    os._exit(0)


class Ranks:
    """`world_size` fresh ranks running `fn(rank, world_size, report, **kwargs)`."""

    def __init__(self, name: str, world_size: int, fn: Callable[..., None], **kwargs: Any) -> None:
        self.name = name
        self.world_size = world_size
        self.results = _CTX.Queue()
        port = _free_port()
        self.procs = [
            _CTX.Process(target=_worker, args=(r, world_size, port, fn, kwargs, self.results), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.answers: dict[int, tuple[Any, ...]] = {}

    def collect(self, deadline: float) -> None:
        """Take answers until every rank has answered or `deadline` (monotonic) passes."""
        while len(self.answers) < self.world_size and time.monotonic() < deadline:
            try:
                rank, *answer = self.results.get(timeout=0.2)
            except queue.Empty:
                if all(r in self.answers or not p.is_alive() for r, p in enumerate(self.procs)):
                    return  # the missing ones are dead; waiting longer changes nothing
                continue
            self.answers[rank] = tuple(answer)

    def missing(self) -> str:
        """Who did not answer, and whether it hung or died (for failure messages)."""
        lines = []
        for r, p in enumerate(self.procs):
            if r not in self.answers:
                what = "hung (alive, no answer)" if p.is_alive() else f"died (exit {p.exitcode})"
                lines.append(f"{self.name}: rank {r} {what} within {DEADLINE_S:.0f}s")
        return "\n".join(lines)

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()  # a SIGSTOPped victim, or a rank that hung
        for p in self.procs:
            p.join(timeout=5)


# ------------------------------------------------------------------ fault cases


def _stop(fault: Fault, rank: int, report: Report) -> None:
    report(("stopped", "", time.time()))
    if fault.how == "exit":
        os._exit(17)
    sig = signal.SIGKILL if fault.how == "sigkill" else signal.SIGSTOP
    os.kill(os.getpid(), sig)
    time.sleep(3600)  # not reached: SIGSTOP freezes here until the test kills the process


def _arm(model: torch.nn.Module, fault: Fault, step: list[int], rank: int, report: Report) -> None:
    """Patch this process's Runtime so that the victim stops at its fault's collective."""
    from overlap.engine.runtime import Runtime
    from overlap.engine.schedule import Phase as SchedulePhase

    state = model._overlap_state
    phase = SchedulePhase.FORWARD if fault.phase == "forward gather" else SchedulePhase.BACKWARD
    calls = 0

    def trap(verb: str, counts: Callable[[tuple[Any, ...]], bool]) -> None:
        original = getattr(Runtime, verb)

        def trapped(self: Runtime, *args: Any) -> None:
            nonlocal calls
            if counts(args) and step[0] == fault.step and state.schedule.phase is phase:
                calls += 1
                if calls == fault.nth:
                    _stop(fault, rank, report)
            original(self, *args)

        setattr(Runtime, verb, trapped)

    if fault.phase == "backward reduce":
        trap("reduce", lambda args: True)
    else:
        trap("gather", lambda args: True)
        if fault.phase == "backward gather":  # one may ride in a reduction ([Note: fused exchange])
            trap("reduce", lambda args: len(args) > 2 and args[2] is not None)


def train_with_fault(rank: int, world_size: int, report: Report, fault: Fault) -> None:
    from helpers.models import STRICT_ZERO3, batch, loss_of, tiny_lm

    import overlap
    from overlap.transport.collectives import CollectiveError

    # strict ZeRO-3: every kind of collective it issues, backward gathers included (units kept
    # for backward have none)
    model = overlap.wrap(tiny_lm(layers=4), collective_timeout_s=COLLECTIVE_TIMEOUT_S, **STRICT_ZERO3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = [0]
    if rank == fault.victim and fault.phase != "before optimizer":
        _arm(model, fault, step, rank, report)
    try:
        for step[0] in range(fault.step + 2):
            loss_of(model(batch(model, rank, step[0]))).backward()
            if rank == fault.victim and step[0] == fault.step and fault.phase == "before optimizer":
                _stop(fault, rank, report)
            opt.step()
            opt.zero_grad()
    except CollectiveError as e:
        report(("raised", str(e), time.time()))
        return
    report(("finished", "", time.time()))


# -------------------------------------------------------------- config mismatch


def config_mismatch(rank: int, world_size: int, report: Report) -> None:
    """Wrap with configs that differ on rank 1 in one field each; record what every rank got."""
    from helpers.models import tiny_lm

    import overlap

    cases: dict[str, tuple[dict, dict]] = {
        "prefetch_depth": ({"prefetch_depth": 1}, {"prefetch_depth": 2}),
        "reduce_scatter_bucket_bytes": ({"reduce_scatter_bucket_bytes": 0}, {"reduce_scatter_bucket_bytes": 4096}),
        "param_dtype": ({}, {"param_dtype": torch.bfloat16}),
        "unit_policy": ({}, {"unit_policy": {torch.nn.LayerNorm}}),
        # rank-local: a per-rank alert threshold must not raise
        "alert_step_gap_ms": ({"alert_step_gap_ms": 100.0}, {"alert_step_gap_ms": 200.0}),
    }
    outcome = {}
    for name, (on_rank0, on_others) in cases.items():
        try:
            overlap.wrap(tiny_lm(), **(on_rank0 if rank == 0 else on_others))
            outcome[name] = "wrapped"
        except ValueError as e:
            outcome[name] = str(e)
    report(("returned", outcome, time.time()))


# ----------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def answers() -> dict[str, Ranks]:
    """Start every case at once, then collect them all under one deadline."""
    groups = {name: Ranks(name, fault.world_size, train_with_fault, fault=fault) for name, fault in FAULTS.items()}
    groups["config-mismatch"] = Ranks("config-mismatch", 2, config_mismatch)
    deadline = time.monotonic() + DEADLINE_S
    try:
        for group in groups.values():
            group.collect(deadline)
    finally:
        for group in groups.values():
            group.close()
    return groups


@pytest.mark.parametrize("name", list(FAULTS))
def test_survivors_raise_within_the_timeout(answers, name):
    fault, ranks = FAULTS[name], answers[name]
    assert not ranks.missing(), ranks.missing()
    kind, _, stopped_at = ranks.answers[fault.victim]
    assert kind == "stopped", f"{name}: the victim rank {fault.victim} never reached its fault: {ranks.answers}"
    for rank in range(fault.world_size):
        if rank == fault.victim:
            continue
        kind, message, at = ranks.answers[rank]
        assert kind == "raised", f"{name}: rank {rank} did not raise CollectiveError: {kind} {message}"
        after = at - stopped_at
        assert after <= COLLECTIVE_TIMEOUT_S + SLACK_S, f"{name}: rank {rank} raised {after:.1f}s after the fault"
        if fault.how == "sigstop":  # nothing closed: only the timeout can have ended the wait
            assert after >= 0.8 * COLLECTIVE_TIMEOUT_S, f"{name}: rank {rank} raised after {after:.1f}s"
        # the error names the rank, the collective and its unit, and the timeout in force
        assert message.startswith(f"overlap: rank {rank}: the "), message
        assert re.match(_NAMED_FAILURE, message), message
        assert f"collective_timeout_s={COLLECTIVE_TIMEOUT_S:g}" in message, message
        assert "Backend error:" in message, message


def test_config_mismatch_raises_on_every_rank(answers):
    ranks = answers["config-mismatch"]
    assert not ranks.missing(), ranks.missing()
    for rank, (kind, outcome, _) in ranks.answers.items():
        assert kind == "returned", (rank, outcome)
        for field, message in outcome.items():
            if field == "alert_step_gap_ms":
                assert message == "wrapped", (rank, message)
                continue
            assert "OverlapConfig differs across ranks" in message, (rank, field, message)
            assert f"in {field} " in message, (rank, field, message)
