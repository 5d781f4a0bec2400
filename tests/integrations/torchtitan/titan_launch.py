"""Start a torchtitan world as torchrun would (one fresh process per rank, env:// rendezvous) and
collect what each rank's runs saw (titan_rank.py). A world that misses its deadline is killed,
rank by rank, and the failure names the ranks that hung and shows each rank's last output; the
world's folder (logs, checkpoints) is removed when every rank succeeded."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
WORLD_TIMEOUT_S = 840  # a world's whole run: generous, a loaded 2-core machine must not fail a test


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: int, world_size: int, port: int, cache: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
        PYTHONPATH=os.pathsep.join([HERE, REPO, env.get("PYTHONPATH", "")]),
    )
    return env


def run_world(world_size: int, runs: list[dict[str, Any]], timeout_s: float = WORLD_TIMEOUT_S) -> list[dict[str, Any]]:
    """Run `runs` in order on a fresh `world_size`-rank world; per-rank results in rank order,
    each {run name: result}. Raises naming the rank that failed or hung."""
    out = tempfile.mkdtemp(prefix="titan_world_")
    spec = os.path.join(out, "spec.json")
    with open(spec, "w") as f:
        json.dump({"out": out, "runs": runs}, f)
    port = _free_port()
    procs = []
    for rank in range(world_size):
        log = open(os.path.join(out, f"rank{rank}.log"), "w")
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.join(HERE, "titan_rank.py"), spec],
                env=_env(rank, world_size, port, out),
                cwd=out,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killed with its children
            )
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):  # one failed: the rest get 30 s to say why
            deadline = min(deadline, time.monotonic() + 30)
        time.sleep(0.5)
    hung = [rank for rank, p in enumerate(procs) if p.poll() is None]
    for rank in hung:
        os.killpg(procs[rank].pid, signal.SIGKILL)
        procs[rank].wait()
    results, problems = [], []
    for rank, p in enumerate(procs):
        path = os.path.join(out, f"rank{rank}.json")
        result = json.load(open(path)) if os.path.exists(path) else {}
        results.append(result)
        if rank in hung or p.returncode != 0 or "__error__" in result:
            what = "hung" if rank in hung else f"exited {p.returncode}"
            tail = open(os.path.join(out, f"rank{rank}.log")).read()[-4000:]
            problems.append(f"rank {rank} {what} (within {timeout_s:.0f}s); last output:\n{tail}")
    if problems:  # the folder (logs, checkpoints) is kept to look into
        raise AssertionError(f"torchtitan world of {world_size} ({out}):\n" + "\n".join(problems))
    shutil.rmtree(out, ignore_errors=True)
    return results


def assert_same_training(
    results: list[dict[str, Any]], fsdp2: str, overlap: str, *, init: bool = True, rtol: float = 0.0
) -> None:
    """On every rank, run `overlap` logged the same losses and grad norms as run `fsdp2` (bitwise,
    or within `rtol` where the reduction order differs) and, with `init`, started from the same
    parameter values (then the first step's loss, a forward from them, is bitwise in any case)."""
    for rank, runs in enumerate(results):
        want, got = runs[fsdp2]["steps"], runs[overlap]["steps"]
        where = f"rank {rank}: {overlap} {got} != {fsdp2} {want}"
        assert len(want) > 0 and [s["step"] for s in got] == [s["step"] for s in want], where
        for a, b in zip(got, want):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= rtol * abs(b[key]), f"{where} ({key}, rtol {rtol})"
        if init:
            before, after = runs[fsdp2]["init"], runs[overlap]["init"]
            differ = sorted(name for name in before if after.get(name) != before[name])
            assert before.keys() == after.keys() and not differ, (
                f"rank {rank}: initial parameters of {overlap} differ from {fsdp2}'s: {differ or 'names'}"
            )
            assert got[0]["loss"] == want[0]["loss"], where
