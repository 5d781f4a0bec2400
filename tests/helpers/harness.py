"""A local multi-rank world for tests: ranks start once per test module and run many checks.

`World(n).run(fn, **kwargs)` runs the top-level function `fn(rank, world_size, **kwargs)` on every
rank and returns the per-rank results. Every run has a deadline; a rank that misses it is named in
the failure and the world is restarted for the next check, so no test can hang. Collectives inside
the ranks time out too (the process group is created with `COLLECTIVE_TIMEOUT_S`).

Ranks are forked from one forkserver that has torch and overlap imported already: a fresh
interpreter per rank costs seconds of CPU on two cores (twice per module), a fork milliseconds, and
unlike a fork of the pytest process it never inherits a started OpenMP pool or a process group.

Threads: a rank uses one intra-op thread, as a rank of a real job on its share of cores would, unless
`OMP_NUM_THREADS` is set, which it then honours (the suite is run both ways: [Note: what is bitwise]
in tolerance.py).
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 120  # generous: a loaded machine must not fail a test
DEEPSPEED_BUILD_S = 600
"""DeepSpeed JIT-builds a small CPU op the first time it starts on a machine (~40 s idle, over
100 s measured on a loaded 2-core machine); cached under TORCH_EXTENSIONS_DIR afterwards. Tests
that use the `deepspeed_op` fixture (conftest.py) allow this much more."""
PRELOAD = [
    "torch",
    "torch.distributed",
    "overlap",
    # loaded on first use, not by `import overlap` ([Note: import cost] in overlap/engine/lazy_torch.py):
    # wrap builds DTensors, tests compile blocks and save checkpoints
    "torch.distributed.tensor",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "models",
]

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(PRELOAD)


def triton_or_skip() -> None:
    """Skip a test that needs Triton where it is not installed; fail instead under
    OVERLAP_REQUIRE_TRITON=1, which tests/run.sh sets after installing the `triton` extra, so a
    broken install cannot turn these checks into skips in CI."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("triton") is None:
        if os.environ.get("OVERLAP_REQUIRE_TRITON", "") not in ("", "0"):
            pytest.fail("OVERLAP_REQUIRE_TRITON=1 but triton is not installed")
        pytest.skip("triton is not installed (extra `triton`: pip install -e '.[triton]')")


def rank_threads() -> int:
    """Intra-op threads per rank: `OMP_NUM_THREADS` when set, else 1."""
    return int(os.environ.get("OMP_NUM_THREADS") or 1)


def ddp_and_overlap(
    world: Any, fn: Callable[..., Any], wrapper: str, timeout_s: float, ddp: dict[str, Any], ours: dict[str, Any]
) -> tuple[list[Any], list[Any]]:
    """Every rank's results of `fn` run in `world` with mode="ddp" and `ddp`'s arguments, then
    with mode="overlap" and `ours`'. Each result names the class of the model the launcher
    trained (`"wrapper"`): DDP's, and ours `wrapper` (not put inside DDP)."""
    ddp_results = world.run(fn, timeout_s=timeout_s, mode="ddp", **ddp)
    our_results = world.run(fn, timeout_s=timeout_s, mode="overlap", **ours)
    assert [r["wrapper"] for r in ddp_results] == ["DistributedDataParallel"] * world.world_size
    assert [r["wrapper"] for r in our_results] == [wrapper] * world.world_size
    return ddp_results, our_results


def torchrun_env(rank: int, world: int, **extra: str) -> None:
    """What torchrun sets, so that a launcher's library (accelerate, Lightning) sees a distributed
    launch in a spawned rank; `OMP_NUM_THREADS` too, else accelerate's CPU mode sets torch's
    thread count itself. `extra` sets more variables."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS=str(rank_threads()), **extra)  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks: Any, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(rank_threads())
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn, kwargs = task
        try:
            results.put((task_id, rank, True, fn(rank, world_size, **kwargs)))
        except BaseException:  # report everything, including assertion failures
            results.put((task_id, rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class World:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._ctx = _CTX
        self._procs: list[Any] = []
        self._task_id = 0
        self._start()

    def _start(self) -> None:
        port = _free_port()
        self._tasks = [self._ctx.Queue() for _ in range(self.world_size)]
        self._results = self._ctx.Queue()
        self._procs = [
            self._ctx.Process(
                target=_worker, args=(rank, self.world_size, port, self._tasks[rank], self._results), daemon=True
            )
            for rank in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def _restart(self) -> None:
        for p in self._procs:
            p.kill()
        for p in self._procs:
            p.join(timeout=10)
        self._start()

    def run(self, fn: Callable[..., Any], timeout_s: float = 300.0, **kwargs: Any) -> list[Any]:
        """Run `fn(rank, world_size, **kwargs)` on every rank; per-rank results in rank order."""
        self._task_id += 1
        task_id = self._task_id
        for q in self._tasks:
            q.put((task_id, fn, kwargs))
        deadline = time.monotonic() + timeout_s
        done: dict[int, tuple[bool, Any]] = {}
        first_error_at: float | None = None
        while len(done) < self.world_size:
            now = time.monotonic()
            limit = deadline if first_error_at is None else min(deadline, first_error_at + 45)
            if now >= limit:
                break
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in done]
            if dead and first_error_at is None:
                first_error_at = now
            try:
                tid, rank, ok, value = self._results.get(timeout=min(1.0, limit - now))
            except queue.Empty:
                continue
            if tid != task_id:
                continue  # a late answer from an earlier, failed check
            done[rank] = (ok, value)
            if not ok and first_error_at is None:
                first_error_at = time.monotonic()
        missing = [r for r in range(self.world_size) if r not in done]
        errors = {r: v for r, (ok, v) in done.items() if not ok}
        if missing or errors:
            lines = [f"{fn.__name__} failed on a {self.world_size}-rank world:"]
            for rank in missing:
                proc = self._procs[rank]
                what = "hung (no answer)" if proc.is_alive() else f"died (exit {proc.exitcode})"
                lines.append(f"  rank {rank}: {what} within {timeout_s:.0f}s")
            self._restart()
            for rank, tb in sorted(errors.items()):
                lines.append(f"  rank {rank} raised:\n{tb}")
            raise AssertionError("\n".join(lines))
        return [done[r][1] for r in range(self.world_size)]

    def close(self) -> None:
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
