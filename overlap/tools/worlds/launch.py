"""Start a process group: a local world of spawned CPU/GPU ranks, or the one torchrun set up.

Demos, tests and benchmarks run the same per-rank function either way; this module is the only
place that knows how the world came to be.
"""

from __future__ import annotations

import gc
import multiprocessing.util
import os
import queue
import signal
import socket
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, NamedTuple, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from overlap.engine import teardown

Backend = Literal["gloo", "nccl"]
DEFAULT_TIMEOUT_S = 300.0
"""Collective timeout: long enough for a slow CPU step, short enough that a hang fails."""


@dataclass(frozen=True)
class WorldInfo:
    """Where this rank runs: what a per-rank function needs besides the process group."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


def num_cpu_cores() -> int:
    """Cores this process may run on (the affinity mask, which containers narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_world() -> tuple[int, Backend]:
    """Embedded default: every local GPU with NCCL, else two CPU ranks with gloo."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.cuda.device_count(), "nccl"
    return 2, "gloo"


def current_device() -> torch.device:
    """The device this rank computes on, as chosen when its group was initialized."""
    if not dist.is_initialized():
        return torch.device("cpu")
    from overlap.transport.backend import default_device  # [Note: NCCL is not gloo]

    return default_device(None)


def in_torchrun() -> bool:
    """True when a launcher (torchrun) already chose this process's rank and world."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _device_for(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_from_env(timeout_s: float = DEFAULT_TIMEOUT_S) -> WorldInfo:
    """Join the world torchrun describes in the environment (NCCL on CUDA, gloo on CPU)."""
    if not in_torchrun():
        raise RuntimeError("init_from_env: RANK/WORLD_SIZE/LOCAL_RANK are not set; use torchrun")
    local_rank = int(os.environ["LOCAL_RANK"])
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = _device_for(backend, local_rank)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    single_agent = os.environ.get("LOCAL_WORLD_SIZE") == os.environ["WORLD_SIZE"]
    if not dist.is_initialized() and not (agent_store and single_agent):
        # A plain env:// world (e.g. the linked ranks of overlap.tools.worlds.link: rank 0 hosts the
        # store), or several agents (nodes): torch's own env:// handling of the agent's store.
        # The per-attempt prefix below needs one restart count for every rank, and a node that
        # replaces a dead one starts counting at 0 while the survivors are at 1.
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    if not dist.is_initialized():
        # One torchrun agent hosts the store, and it outlives a restart (--max-restarts): without
        # a per-attempt prefix the new ranks can read the dead ranks' gloo addresses and fail to
        # connect (seen here in 4 of 8 restarts).
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(
            f"overlap_attempt_{attempt}",
            dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=timedelta(seconds=timeout_s),
            ),
        )
        dist.init_process_group(
            backend,
            store=store,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timedelta(seconds=timeout_s),
        )
    return WorldInfo(dist.get_rank(), dist.get_world_size(), local_rank, backend, device)


def _free_port() -> int:
    """A port the OS just handed out; rank 0's store binds it moments later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _RankDone(NamedTuple):
    rank: int
    value: Any


class _RankFailed(NamedTuple):
    """A rank's exception, stamped so the parent can tell the root cause from its echoes."""

    rank: int
    time_s: float
    traceback: str
    echo: bool = False
    """The exception was a failed collective: what a rank sees when a peer dies or hangs."""


def _rank_main(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    threads_per_rank: int,
    results: Any,
    args: tuple[Any, ...],
) -> None:
    """Body of each spawned rank: join the group, run `fn`, hand back its result, leave."""
    torch.set_num_threads(threads_per_rank)
    device = _device_for(backend, rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if backend == "nccl" else None,
    )
    try:
        results.put(_RankDone(rank, fn(rank, world_size, *args)))
        teardown.wait_threads_idle()  # [Note: rank exit]: the group's workers let go first
        gc.collect()  # [Note: rank exit]: cycles holding collectives' tensors go while all is alive
    except BaseException as e:
        results.put(_RankFailed(rank, time.time(), traceback.format_exc(), _is_collective_failure(e)))
        raise
    finally:
        dist.destroy_process_group()
    _leave(results)


# [Note: rank exit]
# Intermittently (a few times in hundreds of runs, always after every step had finished) a
# spawned rank aborted at exit with "terminate called without an active exception" and no Python
# frame. A core dump later showed why ([Note: quiet exit] in overlap/engine/teardown.py): a gloo worker
# thread dropping a finished collective's tensors needs the GIL, and a thread that asks for it
# during finalization is ended by pthread_exit, whose unwinding through a noexcept destructor
# calls std::terminate. A finished rank therefore collects garbage while the group is alive,
# destroys the group, flushes its output and result queue and leaves with os._exit: nothing is
# left for finalization to tear down. A user's torchrun script, which finalizes, is covered by
# the exit hook `wrap` registers.
# Before the garbage is collected the rank waits until the group's workers are idle
# (`teardown.wait_threads_idle`, ~10 ms): otherwise a lagging worker can hold the last
# reference to a tensor whose Python object holds a process group (DeepSpeed sets
# `param.ds_process_group`); once `destroy_process_group` has dropped the group, that worker
# destroys the group itself and joins its own thread: "Resource deadlock avoided", the rare
# SIGABRT of a DeepSpeed rank in `test_bench_memory_peers` ([Note: died after its result]). The
# mechanism is read from the code, not caught in a core dump: the abort was not reproduced
# here (0 in 20 runs of that test).
def _leave(results: Any) -> None:
    results.close()
    results.join_thread()  # the result reached the parent's pipe
    exit_now(0)


def exit_now(code: int) -> NoReturn:
    """Flush the output and leave this process with `code` at once, without interpreter
    finalization ([Note: rank exit]): for a rank whose process group is already destroyed.

    multiprocessing's own exit step still runs: os._exit skips it, and it is what releases the
    named semaphores this process created (tqdm's lock behind every progress bar, a user's
    `multiprocessing.Lock`). Left registered, the resource tracker (the parent's, for spawned
    ranks) reports each one as leaked when it shuts down. Its finalizers are plain Python
    (unlink a name, tell the tracker), nothing that needs the process group or gloo's threads.
    """
    multiprocessing.util._run_finalizers(0)  # the first step of multiprocessing's exit hook
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _drain(results: Any, done: dict[int, Any], failed: list[_RankFailed], wait_s: float = 0.0) -> None:
    """Move queued rank reports into `done` / `failed`; wait up to `wait_s` for the first."""
    while True:
        try:
            item = results.get(timeout=wait_s) if wait_s else results.get_nowait()
        except queue.Empty:
            return
        wait_s = 0.0
        if isinstance(item, _RankFailed):
            failed.append(item)
        else:
            done[item.rank] = item.value


def _is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it came from) is a failed collective: the error every
    survivor of a dead peer raises, so it says less about the root cause than any other."""
    from overlap.transport.collectives import CollectiveError

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, (CollectiveError, dist.DistError)):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _died(code: int | None) -> bool:
    """An exit code of a rank that ended by itself, not cleanly (SIGTERM is the parent's)."""
    return code not in (None, 0, -signal.SIGTERM)


def _exit_description(code: int) -> str:
    if code < 0:
        try:
            return f"terminated with signal {signal.Signals(-code).name}"
        except ValueError:
            return f"terminated with signal {-code}"
    return f"terminated with exit code {code}"


def _world_error(
    nproc: int, failed: list[_RankFailed], fallback: ProcessException, exitcodes: Sequence[int | None] = ()
) -> RuntimeError:
    """Name the rank that failed first: once it dies, its peers fail too (connection reset),
    and their errors only echo the real one.

    [Note: first failure]
    A rank that raises reports its traceback, stamped, before it exits; a rank that dies hard
    (`os._exit`, a signal, an abort in C++) reports nothing and is seen only by its exit code, at
    whatever moment the parent next looks, often after its peers' reports of the broken
    connection. Ordering by time alone therefore blames a survivor. The root cause is chosen in
    this order: a rank that raised something other than a failed collective (earliest first),
    then a rank that died without a report (the one the parent saw die first before the rest,
    which it terminated), then the earliest failed collective.
    """
    reported = {f.rank for f in failed}
    # Ranks the parent terminated (torch's join sends SIGTERM to the rest) did not fail; the
    # rank whose exit the join reported comes first among those without a report.
    silent = [
        (r, code)
        for r, code in enumerate(exitcodes)
        if r not in reported and code not in (None, 0) and (_died(code) or r == fallback.error_index)
    ]
    silent.sort(key=lambda rc: rc[0] != fallback.error_index)
    causes = sorted((f for f in failed if not f.echo), key=lambda f: f.time_s)
    echoes = sorted((f for f in failed if f.echo), key=lambda f: f.time_s)
    if causes:
        rank, detail = causes[0].rank, causes[0].traceback.strip()
    elif silent:
        rank, detail = silent[0][0], f"process {silent[0][0]} {_exit_description(silent[0][1])}"
    elif echoes:
        rank, detail = echoes[0].rank, echoes[0].traceback.strip()
    else:
        return RuntimeError(f"rank {fallback.error_index} of {nproc} failed:\n{fallback.msg.strip()}")
    others = sorted(({f.rank for f in failed} | {r for r, _ in silent}) - {rank})
    echo = f" (then ranks {others} failed too)" if others else ""
    return RuntimeError(f"rank {rank} of {nproc} failed{echo}:\n{detail}")


def run_local_world(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    backend: Backend = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    threads_per_rank: int | None = None,
    deadline_s: float | None = None,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `nproc` spawned ranks on this machine; return the
    ranks' return values in rank order.

    `fn` and `args` must be picklable (a module-level function). A rank that raises fails the
    whole world: the others are terminated and a `RuntimeError` naming the rank carries its
    traceback. `timeout_s` bounds each collective; `deadline_s`, if given, the whole run.
    Each rank gets `threads_per_rank` intra-op threads (default: the cores split evenly), so
    ranks do not oversubscribe the CPU and distort overlap measurements.
    """
    if nproc < 1:
        raise ValueError(f"run_local_world: nproc must be >= 1, got {nproc}")
    threads = threads_per_rank or max(1, num_cpu_cores() // nproc)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rank_args = (fn, nproc, _free_port(), backend, timeout_s, threads, results, args)
    procs = mp.start_processes(_rank_main, rank_args, nprocs=nproc, join=False, start_method="spawn")
    done: dict[int, Any] = {}
    failed: list[_RankFailed] = []
    start = time.monotonic()
    try:
        # Drain while joining: a rank blocks on exit until its queued result is read.
        while not procs.join(timeout=0.1):
            _drain(results, done, failed)
            if deadline_s is not None and time.monotonic() - start > deadline_s:
                raise TimeoutError(f"run_local_world: ranks {_alive(procs)} still running after {deadline_s:.0f}s")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        _drain(results, done, failed, wait_s=1.0)
        exitcodes = [p.exitcode for p in procs.processes]
        if len(done) == nproc and not failed:  # [Note: died after its result]
            _warn_teardown(nproc, exitcodes)
            return [done[r] for r in range(nproc)]
        raise _world_error(nproc, failed, e, exitcodes) from None
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.terminate()
    _drain(results, done, failed)
    return [done.get(r) for r in range(nproc)]


# [Note: died after its result]
# A rank that returned and whose result reached the parent has done all its work; if it then dies
# in teardown (rarely, a C++ thread of the process group or of a peer library aborting as the
# process ends: "terminate called ...", SIGABRT), the world's results are complete and are
# returned, with a warning naming the rank, instead of failing a run whose every rank finished.
# Any rank without a result, or any rank that raised, still fails the world.
def _warn_teardown(nproc: int, exitcodes: Sequence[int | None]) -> None:
    dead = [f"rank {r} {_exit_description(code)}" for r, code in enumerate(exitcodes) if _died(code)]
    warnings.warn(
        f"run_local_world: every one of {nproc} ranks returned its result, then "
        f"{', '.join(dead) or 'a rank'} while exiting; results kept",
        RuntimeWarning,
        stacklevel=3,
    )


def _alive(procs: mp.ProcessContext) -> list[int]:
    return [r for r, p in enumerate(procs.processes) if p.is_alive()]
