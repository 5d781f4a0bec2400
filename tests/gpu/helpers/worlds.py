"""Worlds of ranks on the one device: spawned over gloo (CUDA tensors on the one GPU, or CPU
tensors), each rank's results streamed to the test config by config, so a run cut short keeps
what every finished config measured."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import queue
import socket
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..parts import ENV
from .common import Sizes, same_bits, synchronize, worst_difference

WORLD_TIMEOUT_S = 30  # each collective of a spawned world
Send = Callable[[str, Any], None]  # a rank's message to the test: (kind, payload)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, nproc: int, port: int, spec: dict[str, Any], results: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(ENV)  # whichever forkserver forked this rank: deterministic cuBLAS, before its first handle
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc,
                                timeout=timedelta(seconds=WORLD_TIMEOUT_S))  # fmt: skip
        spec["target"](rank, nproc, spec, lambda kind, payload: results.put((rank, kind, payload)))
        results.put((rank, "done", None))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()[-3000:]))
    finally:
        gc.collect()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        results.close()
        results.join_thread()
        os._exit(0)  # no interpreter finalization (gloo threads): [Note: rank exit] in overlap/launch.py


def run_world(nproc: int, spec: dict[str, Any], on_message: Callable[[int, str, Any], None]) -> None:
    """`spec["target"](rank, nproc, spec, send)` on `nproc` ranks forked from a forkserver that
    has torch, overlap and the worlds' modules imported (a fresh interpreter per rank costs
    seconds; the server starts once, without CUDA). Returns when every rank is done; raises when
    one fails or dies. The test's time budget ends the ranks (the `finally`)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "overlap", spec["target"].__module__])
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(r, nproc, port, spec, results), daemon=True) for r in range(nproc)]
    done: set[int] = set()
    try:
        for p in procs:
            p.start()
        while len(done) < nproc:
            try:
                rank, kind, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(procs)
                        if p.exitcode is not None and r not in done]  # fmt: skip
                if dead:
                    with contextlib.suppress(queue.Empty):  # a last report may still be in the pipe
                        rank, kind, payload = results.get(timeout=2.0)
                        on_message(rank, kind, payload) if kind not in ("done", "error") else None
                    raise RuntimeError(f"{', '.join(dead)} ended without reporting done") from None
                continue
            if kind == "done":
                done.add(rank)
            elif kind == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            else:
                on_message(rank, kind, payload)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)


def rank_setup(spec: dict[str, Any]) -> tuple[torch.device, Sizes, dict[str, Any]]:
    """A rank's device (the one GPU, made current, or the CPU), the world's sizes, and which of
    gloo's collectives run on that device's tensors (`probe_native`)."""
    device = torch.device("cuda", 0) if spec["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device, Sizes(**spec["sizes"]), probe_native(device)


def probe_native(device: torch.device) -> dict[str, Any]:
    """Whether gloo runs the native reduce-scatter and all-gather on `device` tensors (the same
    answer on every rank); "all_to_all" replaces one that does not, with the error reported."""
    ws, errors = dist.get_world_size(), {}
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    ok = []
    for name, run in (("reduce_scatter", lambda: rs(torch.empty(2, device=device), torch.ones(2 * ws, device=device))),
                      ("all_gather", lambda: ag(torch.empty(2 * ws, device=device), torch.ones(2, device=device)))):  # fmt: skip
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run()
            synchronize(device)
            ok.append(1)
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
            ok.append(0)
    flags = torch.tensor(ok)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    rs_ok, ag_ok = (bool(v) for v in flags.tolist())
    overrides = {"reduce_scatter_impl": "native" if rs_ok else "all_to_all",
                 "all_gather_impl": "native" if ag_ok else "all_to_all"}  # fmt: skip
    return {"overrides": overrides, "errors": errors}


Run = tuple[torch.Tensor, dict[str, torch.Tensor], list[float]]  # losses, full state, the scaler's scales


def delayed_summary(plain: Run, delayed: Run, counts: Counter) -> dict[str, Any]:
    """A config's two runs compared ([Note: injected delays] in delays.py): bitwise, and the
    delays counted."""
    (l1, s1, scales1), (l2, s2, scales2) = plain, delayed
    summary = {"bitwise_delayed": same_bits(l1, l2) and all(same_bits(s1[k], s2[k]) for k in s1) and scales1 == scales2,
               "delayed_vs_plain": worst_difference(s2, s1), "delays": dict(counts), "losses": l1.tolist()}  # fmt: skip
    if scales1:
        summary["scales"] = scales1
    return summary


def run_configs(configs: dict[str, dict[str, Any]], nproc: int, send: Send,
                one: Callable[[str, dict[str, Any]], dict[str, Any]]) -> None:  # fmt: skip
    """Each config's summary `one(name, overrides)` (a raise is its result), sent to the test;
    the ranks stop together when some but not all failed (they may have desynced)."""
    for name, overrides in configs.items():
        t0 = time.monotonic()
        try:
            summary = one(name, overrides)
        except Exception:
            summary = {"error": traceback.format_exc()[-3000:]}
        summary["seconds"] = round(time.monotonic() - t0, 2)
        send("config", {"name": name, **summary})
        failed = torch.tensor([1 if "error" in summary else 0])
        dist.all_reduce(failed)
        if 0 < failed.item() < nproc:
            break


def judge(entry: dict[str, Any], name: str, nproc: int, exact: bool = True, skip_below: float | None = None) -> None:
    """A config's verdict from its ranks' summaries; `exact`: plain fp32 bitwise equal to the
    reference (where it sums in the collective's order), else within fp32 rounding of it;
    `skip_below`: the scaler's initial scale, where an overflow was injected."""
    ranks = entry["ranks"].values()
    ok = len(entry["ranks"]) == nproc and all("error" not in r for r in ranks)
    ok = ok and all(r["bitwise_delayed"] and r["delays"].get("before_collective", 0) > 0
                    and r["delays"].get("after_wait", 0) > 0 for r in ranks)  # fmt: skip
    if name == "plain":
        ok = ok and all(r.get("bitwise_vs_reference" if exact else "close_vs_reference") for r in ranks)
    scales = [r.get("scales") for r in ranks]
    if any(scales):  # every rank stepped (or skipped) alike: the same scale after every step
        ok = ok and all(s == scales[0] for s in scales)
    if skip_below is not None:  # the injected overflow happened: a step skipped, the scale below its start
        ok = ok and all(s and min(s) < skip_below for s in scales)
    entry["ok"] = bool(ok)
