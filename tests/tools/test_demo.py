"""The demo's pieces: the GPT, the stdlib byte data, the local-world launcher, and `overlap demo`
end to end (a few steps in a subprocess, as a user would run it), including its resume after a
crash under `torchrun --max-restarts=1` and in a rerun local world."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from overlap import checkpoint
from overlap.tools.demo import (
    CRASH_AT_ENV,
    CRASH_EXIT_CODE,
    CRASH_MARKER,
    CRASH_RANK_ENV,
    DemoConfig,
    demo,
    injected_crash_step,
)
from overlap.tools.workloads import GPT, GPTConfig
from overlap.tools.workloads.data import ByteDataset, get_batch, load_stdlib_bytes, rank_generator
from overlap.tools.worlds.launch import num_cpu_cores, run_local_world

pytestmark = pytest.mark.slow  # spawns worlds or runs a command end to end: `-m 'not slow'` leaves it out

ROOT = Path(__file__).resolve().parents[2]
TINY = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64)


def test_gpt_initial_loss_is_uniform_over_bytes() -> None:
    """Near-zero initial logits mean the first loss is ln(256): a broken init shows here first."""
    torch.manual_seed(0)
    idx = torch.randint(256, (4, 32))
    logits, loss = GPT(TINY)(idx, idx)
    assert logits.shape == (4, 32, 256)
    assert loss is not None and abs(loss.item() - math.log(256)) < 0.15


def test_gpt_init_is_deterministic_and_blocks_are_units() -> None:
    torch.manual_seed(1)
    a = GPT(TINY)
    torch.manual_seed(1)
    b = GPT(TINY)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert len(a.blocks) == TINY.n_layer and isinstance(a.blocks, torch.nn.ModuleList)
    assert a.lm_head.weight is not a.wte.weight  # untied until the engine handles sharing


def test_gpt_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=65, n_head=2)
    with pytest.raises(ValueError, match="block_size"):
        GPT(TINY)(torch.zeros(1, 33, dtype=torch.long))


def test_batches_are_in_range_shifted_and_rank_specific() -> None:
    data = load_stdlib_bytes(max_bytes=1 << 20)
    assert data.dtype == torch.uint8 and len(data) == 1 << 20
    x, y = get_batch(data, 8, 32, rank_generator(0, 0))
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.int64
    assert int(x.min()) >= 0 and int(x.max()) < 256
    assert torch.equal(x[:, 1:], y[:, :-1])
    x1, _ = get_batch(data, 8, 32, rank_generator(0, 1))
    assert not torch.equal(x, x1)
    again, _ = get_batch(data, 8, 32, rank_generator(0, 0))
    assert torch.equal(x, again)


def test_split_is_ninety_ten_and_deterministic() -> None:
    a = ByteDataset.from_stdlib(max_bytes=1 << 20)
    b = ByteDataset.from_stdlib(max_bytes=1 << 20)
    assert len(a.train) + len(a.val) == 1 << 20
    assert len(a.val) == pytest.approx(0.1 * (1 << 20), abs=1)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)


def _sum_of_ranks(rank: int, world_size: int, offset: int) -> tuple[int, int]:
    t = torch.tensor([rank + offset])
    dist.all_reduce(t)
    return int(t), torch.get_num_threads()


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("injected failure")
    dist.barrier()


def test_local_world_returns_results_and_names_the_failing_rank() -> None:
    assert run_local_world(_sum_of_ranks, 2, 10, threads_per_rank=1) == [(21, 1), (21, 1)]
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 failed[\s\S]*injected failure"):
        run_local_world(_fail_on_rank_one, 2, timeout_s=60, deadline_s=240)


@pytest.mark.timeout(400)
def test_demo_cli_runs_and_loss_is_finite() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [
        sys.executable,
        "-m",
        "overlap",
        "demo",
        "--steps",
        "3",
        "--layers",
        "2",
        "--dim",
        "64",
        "--heads",
        "2",
        "--block-size",
        "32",
        "--batch-size",
        "4",
        "--log-every",
        "1",
        "--eval-batches",
        "2",
        "--nproc",
        "2",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = re.search(r"train loss (\S+) -> (\S+) \| val loss (\S+)", proc.stdout)
    assert match, proc.stdout
    first, last, val = (float(g) for g in match.groups())
    assert all(math.isfinite(v) for v in (first, last, val))
    assert abs(first - math.log(256)) < 0.2
    assert proc.stdout.count("step ") >= 3  # a progress line per step with --log-every 1
    # A rank leaves with os._exit ([Note: rank exit]); what it registered with the resource
    # tracker (a progress bar's multiprocessing lock) must still be released, not reported.
    leaks = [ln for ln in proc.stderr.splitlines() if re.search("resource_tracker|leaked", ln)]
    assert not leaks, proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# Resume after a crash: `overlap demo --checkpoint-dir DIR --save-every N`, restarted by torchrun
# (--max-restarts=1) or rerun in a spawned local world, trains exactly as an uninterrupted run.

DEMO_STEPS = 8
SAVE_EVERY = 3
CRASH_AT = 5  # the crashing rank dies during step 5 (after its forward), after step 3's save
TINY_DEMO: dict[str, int] = {
    "steps": DEMO_STEPS,
    "layers": 1,
    "dim": 32,
    "heads": 2,
    "block_size": 16,
    "batch_size": 2,
    "log_every": 100,
    "eval_batches": 1,
    "max_bytes": 1 << 20,
    "save_every": SAVE_EVERY,
}
LAUNCH_TIMEOUT_S = 60.0
"""Bound on one launch of the demo (a few seconds when the machine is not loaded)."""
THREADS_PER_RANK = max(1, num_cpu_cores() // 2)
"""What `run_local_world` gives each of 2 ranks; torchrun's ranks get it too (OMP_NUM_THREADS),
so that both worlds run the same kernels and the shared reference run holds bitwise for both."""


def _demo_argv(checkpoint_dir: Path, json_path: Path) -> list[str]:
    argv = ["demo"]
    for name, value in TINY_DEMO.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv + ["--checkpoint-dir", str(checkpoint_dir), "--json", str(json_path)]


def _children(pid: int) -> list[int]:
    """Every live descendant of `pid` (Linux /proc); empty where /proc is missing."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields_after_name = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields_after_name[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _rank_of(pid: int) -> str | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((e[5:].decode() for e in env if e.startswith(b"RANK=")), None)


def _run_torchrun(argv: list[str], env: dict[str, str], max_restarts: int, log_dir: Path) -> str:
    """`torchrun --standalone --nproc-per-node 2 -m overlap.tools.cli *argv`; its output, each rank's
    lines prefixed `[default<rank>]:` (--tee). On a hang, names the ranks still running and has
    each print its Python stack (faulthandler, on SIGABRT)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [f"--max-restarts={max_restarts}", "--monitor-interval=0.2", "--tee=3"]
    cmd += ["--log-dir", str(log_dir), "-m", "overlap.tools.cli"]
    env = dict(env, OMP_NUM_THREADS=str(THREADS_PER_RANK), PYTHONFAULTHANDLER="1")
    proc = subprocess.Popen(cmd + argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    timeout_s = LAUNCH_TIMEOUT_S * (1 + max_restarts)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        ranks = {pid: _rank_of(pid) for pid in _children(proc.pid)}
        workers = {pid: rank for pid, rank in ranks.items() if rank is not None}
        for pid in workers:
            os.kill(pid, signal.SIGABRT)  # faulthandler prints where the rank is stuck
        time.sleep(2.0)
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
        out, err = proc.communicate()
        hung = ", ".join(f"rank {r} (pid {p})" for p, r in sorted(workers.items(), key=str))
        pytest.fail(
            f"torchrun did not finish within {timeout_s:.0f}s; still running: "
            f"{hung or 'no worker (the launcher itself hung)'}\n"
            f"stdout:\n{out[-3000:]}\nstderr (stacks):\n{err[-6000:]}"
        )
    assert proc.returncode == 0, f"torchrun exit {proc.returncode}\n{out[-3000:]}\n{err[-5000:]}"
    return out + err


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The reference: the tiny demo in a spawned local world, checkpointing, never crashing."""
    root = tmp_path_factory.mktemp("demo_ref")
    with pytest.MonkeyPatch.context() as env:
        for name in (CRASH_AT_ENV, CRASH_RANK_ENV, "TORCHELASTIC_RESTART_COUNT"):
            env.delenv(name, raising=False)
        result = demo(DemoConfig(nproc=2, checkpoint_dir=str(root), **TINY_DEMO), LAUNCH_TIMEOUT_S)
    assert result is not None
    return asdict(result)


def _assert_same_run(resumed: dict, reference: dict, resumed_from: int) -> None:
    """Bitwise: every step's loss (the ones before the crash come from the checkpoint), the
    final loss and the validation loss of the final model."""
    assert resumed["start_step"] == resumed_from, resumed
    assert reference["start_step"] == 0, reference
    assert resumed["losses"] == reference["losses"], (resumed["losses"], reference["losses"])
    assert resumed["final_loss"] == reference["final_loss"]
    assert resumed["val_loss"] == reference["val_loss"]


@pytest.mark.timeout(4 * LAUNCH_TIMEOUT_S)
def test_torchrun_restart_resumes_demo_from_latest_checkpoint(tmp_path: Path, uninterrupted: dict) -> None:
    """Rank 0 dies in step 5; torchrun (--max-restarts=1) restarts both ranks, which resume from
    the step-3 checkpoint and end with the uninterrupted run's losses, bitwise."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop(CRASH_RANK_ENV, None)  # rank 0, the default, dies
    env[CRASH_AT_ENV] = str(CRASH_AT)
    run = tmp_path / "run"
    out = _run_torchrun(_demo_argv(run, tmp_path / "run.json"), env, 1, tmp_path / "logs")
    assert f"injected crash on rank 0 ({CRASH_AT_ENV}={CRASH_AT})" in out, out[-3000:]
    assert "resumed from step 3 " in out, out[-3000:]
    assert (run / CRASH_MARKER).exists()
    assert checkpoint.latest(run) == run / f"step_{DEMO_STEPS:06d}"
    _assert_same_run(json.loads((tmp_path / "run.json").read_text()), uninterrupted, 3)


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S)
def test_local_world_rerun_resumes_demo_after_injected_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uninterrupted: dict
) -> None:
    """Without torchrun nothing restarts the world: the crash fails the run (naming the rank),
    and running the same command again resumes; the marker file keeps it from crashing again."""
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv(CRASH_AT_ENV, str(CRASH_AT))
    monkeypatch.setenv(CRASH_RANK_ENV, "1")
    cfg = DemoConfig(nproc=2, checkpoint_dir=str(tmp_path / "run"), **TINY_DEMO)
    failed = rf"rank 1 of 2 failed[\s\S]*exit code {CRASH_EXIT_CODE}"
    with pytest.raises(RuntimeError, match=failed):
        demo(cfg, LAUNCH_TIMEOUT_S)
    assert checkpoint.latest(cfg.checkpoint_dir) == tmp_path / "run" / "step_000003"
    resumed = demo(cfg, LAUNCH_TIMEOUT_S)
    assert resumed is not None
    _assert_same_run(asdict(resumed), uninterrupted, resumed_from=3)


def test_crash_injection_only_on_the_first_attempt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = DemoConfig(checkpoint_dir=str(tmp_path), **TINY_DEMO)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv(CRASH_RANK_ENV, raising=False)
    monkeypatch.delenv(CRASH_AT_ENV, raising=False)
    assert injected_crash_step(0, cfg) is None
    monkeypatch.setenv(CRASH_AT_ENV, "4")
    assert [injected_crash_step(r, cfg) for r in (0, 1)] == [4, None]
    monkeypatch.setenv(CRASH_RANK_ENV, "1")
    assert [injected_crash_step(r, cfg) for r in (0, 1)] == [None, 4]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun's restart
    assert injected_crash_step(1, cfg) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    (tmp_path / CRASH_MARKER).write_text("rank 1\n")  # a rerun after the crash
    assert injected_crash_step(1, cfg) is None
    monkeypatch.setenv(CRASH_AT_ENV, "five")
    with pytest.raises(ValueError, match=CRASH_AT_ENV):
        injected_crash_step(1, cfg)


def test_demo_config_rejects_checkpoints_it_cannot_write() -> None:
    with pytest.raises(ValueError, match="--engine ddp"):
        DemoConfig(engine="ddp", checkpoint_dir="/tmp/x")
    with pytest.raises(ValueError, match="--save-every"):
        DemoConfig(checkpoint_dir="/tmp/x", save_every=0)
    with pytest.warns(UserWarning, match="ignored without --checkpoint-dir"):
        DemoConfig(save_every=5)
