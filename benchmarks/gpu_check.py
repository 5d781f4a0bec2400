"""What one lent GPU can prove about the CUDA path, in at most 4 minutes; `--device cpu` dry-runs it.

    python benchmarks/gpu_check.py --out benchmarks/gpu_results/gpu_check.json    # one GPU, NCCL
    python benchmarks/gpu_check.py --device cpu --out /tmp/gpu_check.json          # dry run, gloo
    python benchmarks/gpu_check.py --only a,d                                      # some parts

The script is rank 0 of a world of size 1 (NCCL on CUDA, gloo on CPU), run with
OVERLAP_FORCE_COLLECTIVES=1 so that overlap's comm issues real collectives at world size 1 instead
of short-circuiting them, and with CUBLAS_WORKSPACE_CONFIG=:4096:8 (deterministic cuBLAS for d).
The JSON at `--out` is rewritten after every part with that part appended, so a run cut short
still leaves every part that finished. Each part has a time budget (the whole run: 4 minutes);
one that raises or runs out of time records the error and the script goes on. A part records
{"part", "name", "status", "bar", "measured", "seconds"}; status is "passed" / "failed" (held to
its bar), "measured" (no bar applies on this device), "skipped" (why) or "error" (traceback).
Exit code 1 if any part errored, else 0: a failed bar is a result, not a crash.

Parts (model: a stack of nn.TransformerEncoderLayer; 6 x d=1024 on CUDA, 2 x d=32 in the dry run)
  a nccl_path  wrapped steps under torch.profiler: the c10d collectives issued per step (and, on
               CUDA, the NCCL kernels CUPTI saw). Bar: > 0 per step, from the process group's
               backend (nccl on CUDA).
  b sync_free  steps 2-3 under torch.cuda.set_sync_debug_mode("warn") for the plain, bucketed
               and int8 + error-feedback configs: sync warnings counted with where they came
               from. Bar: 0 per config. CUDA only.
  c overlap    median step with the real (world size 1) collectives, then with a stand-in
               (torch.cuda._sleep) on the comm stream before each collective, sized so that the
               stand-ins add up to half the real step. hidden = 1 - added time / stand-in time.
               Bar: hidden >= 0.5. CUDA only.
  d parity     overlap.wrap against the plain model on the same device, 3 AdamW steps, under
               torch.use_deterministic_algorithms(True, warn_only=True) and the math SDPA backend:
               losses and final parameters. Bar: bitwise, else max abs diff <= 1e-6 (stated
               tolerance; both reported).
  e kernels    benchmarks/kernels.py (its own CLI, rows in kernels_rows.json beside --out): each
               Triton kernel's GB/s as a share of the measured device-to-device copy and its
               speedup over the torch reference. Bar: share >= 0.8 for every Triton row at the
               largest size. On CPU the rows are measured, no bar (no Triton).
  f memory     `overlap bench memory` at world size 1 (each contender in a fresh process): train
               peak torch.cuda.max_memory_allocated of overlap against FSDP2 on the 151 M-param
               model. Bar: overlap <= 1.10 x FSDP2. On CPU: RSS measured, no bar.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's `overlap`, installed or not

TOTAL_BUDGET_S = 240.0
PART_BUDGET_S = {"a": 20.0, "b": 45.0, "c": 35.0, "d": 25.0, "e": 50.0, "f": 50.0}
"""Per-part caps (sum 225 s); a part also never runs past the whole run's budget."""
ENV = {"OVERLAP_FORCE_COLLECTIVES": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
PARITY_TOL = 1e-6
SHARE_BAR = 0.8
HIDDEN_BAR = 0.5
MEMORY_BAR = 1.10
STEPS = 3  # steps per measurement after warm-up (timing: TIMED_STEPS)
TIMED_STEPS = 5


@dataclass(frozen=True)
class Sizes:
    layers: int
    d: int
    heads: int
    ff: int
    batch: int
    seq: int


SIZES = {"cuda": Sizes(6, 1024, 16, 4096, 8, 256), "cpu": Sizes(2, 32, 2, 64, 2, 8)}


class PartTimeout(Exception):
    pass


@dataclass
class Check:
    """What every part gets: the device, the sizes, where to write side files."""

    device: torch.device
    sizes: Sizes
    out: Path

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


# ---------------------------------------------------------------------------------------------
# shared pieces


def build_plain(c: Check) -> nn.Module:
    s = c.sizes
    torch.manual_seed(0)
    layers = [
        nn.TransformerEncoderLayer(s.d, s.heads, s.ff, dropout=0.0, batch_first=True)
        for _ in range(s.layers)
    ]
    return nn.Sequential(*layers).to(c.device)


def make_input(c: Check) -> torch.Tensor:
    s = c.sizes
    gen = torch.Generator().manual_seed(1)
    return torch.randn(s.batch, s.seq, s.d, generator=gen).to(c.device)


def wrapped(c: Check, **overrides: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    import overlap

    model = overlap.wrap(build_plain(c), **overrides)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    """One step; returns the loss without reading it (no host sync here)."""
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def synchronize(c: Check) -> None:
    if c.cuda:
        torch.cuda.synchronize(c.device)


def median_step_ms(c: Check, step: Callable[[], Any], n: int = TIMED_STEPS) -> float:
    times = []
    for _ in range(n):
        synchronize(c)
        t0 = time.perf_counter()
        step()
        synchronize(c)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@contextlib.contextmanager
def patched_comm(wrap_fn: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Replace overlap.comm's two plain collectives by `wrap_fn(original)` (the runtime calls
    them through the module), and put them back."""
    from overlap.transport import collectives as comm

    names = ("all_gather_flat", "reduce_scatter_flat")
    originals = {n: getattr(comm, n) for n in names}
    for n, fn in originals.items():
        setattr(comm, n, wrap_fn(fn))
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(comm, n, fn)


# ---------------------------------------------------------------------------------------------
# parts: each returns (status, bar, measured)

PartResult = tuple[str, str, dict[str, Any]]


def part_nccl_path(c: Check) -> PartResult:
    model, opt = wrapped(c)
    x = make_input(c)
    for _ in range(2):  # step 1 records the unit order
        train_step(model, opt, x)
    synchronize(c)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if c.cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(STEPS):
            train_step(model, opt, x)
        synchronize(c)
    events = prof.events()
    issued = Counter(
        e.name for e in events if e.name.startswith("c10d::") and "barrier" not in e.name
    )
    ran = Counter(e.name for e in events if e.name.startswith(("nccl:", "gloo:")))
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    nccl_kernels = Counter(e.name.split("(")[0] for e in kernels if "nccl" in e.name.lower())
    backend = str(dist.get_backend())
    per_step = sum(issued.values()) / STEPS
    ok = per_step > 0 and (not c.cuda or backend == "nccl")
    if c.cuda and kernels:  # CUPTI works here: the collectives must show as NCCL kernels too
        ok = ok and sum(nccl_kernels.values()) > 0
    measured = {
        "backend": backend,
        "OVERLAP_FORCE_COLLECTIVES": os.environ.get("OVERLAP_FORCE_COLLECTIVES"),
        "collectives_per_step": per_step,
        "issued": dict(issued),
        "backend_events": dict(ran),
        "num_kernel_events": len(kernels),
        "nccl_kernels": dict(nccl_kernels),
    }
    bar = "> 0 c10d collectives issued per step (CUDA: on nccl, and NCCL kernels if CUPTI sees kernels)"
    return ("passed" if ok else "failed"), bar, measured


def sync_warnings(c: Check, overrides: dict[str, Any]) -> dict[str, Any]:
    model, opt = wrapped(c, **overrides)
    x = make_input(c)
    train_step(model, opt, x)  # step 1: allowed to sync (order recording, first allocations)
    synchronize(c)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(2):
                train_step(model, opt, x)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    synchronize(c)
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    where = Counter(f"{Path(w.filename).as_posix().split('site-packages/')[-1]}:{w.lineno}" for w in syncs)
    return {
        "sync_warnings": len(syncs),
        "in_overlap": sum(n for k, n in where.items() if "overlap/" in k),
        "where": dict(where.most_common(12)),
    }


def part_sync_free(c: Check) -> PartResult:
    s = c.sizes
    layer_bytes = sum(p.numel() for p in nn.TransformerEncoderLayer(s.d, s.heads, s.ff).parameters()) * 4
    configs = {
        "plain": {},
        "strict-zero3": {"keep_for_backward_bytes": 0},  # backward gathers too (the default keeps small units)
        "bucketed": {"reduce_scatter_bucket_bytes": 3 * layer_bytes},
        "int8+ef": {"grad_compression": "int8", "error_feedback": True},
    }
    measured: dict[str, Any] = {}
    for name, overrides in configs.items():
        try:
            measured[name] = {"overrides": overrides, **sync_warnings(c, overrides)}
        except PartTimeout:
            raise
        except Exception:  # noqa: BLE001  one config's crash is that config's result
            measured[name] = {"overrides": overrides, "error": traceback.format_exc()[-3000:]}
    ok = all(m.get("sync_warnings") == 0 for m in measured.values())
    return ("passed" if ok else "failed"), "0 sync warnings in steps 2-3, per config", measured


def sleep_cycles_per_ms() -> float:
    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # warm-up
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / begin.elapsed_time(end)


def part_overlap(c: Check) -> PartResult:
    model, opt = wrapped(c)
    x = make_input(c)
    calls = Counter()

    def counting(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            calls[fn.__name__] += 1
            return fn(*a, **k)

        return call

    for _ in range(2):
        train_step(model, opt, x)
    with patched_comm(counting):
        train_step(model, opt, x)
    num_collectives = sum(calls.values())
    real_ms = median_step_ms(c, lambda: train_step(model, opt, x))
    standin_total_ms = 0.5 * real_ms
    per_collective_ms = standin_total_ms / max(1, num_collectives)
    cycles = int(per_collective_ms * sleep_cycles_per_ms())

    def with_sleep(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            torch.cuda._sleep(cycles)  # on the stream the runtime issues the collective from
            return fn(*a, **k)

        return call

    with patched_comm(with_sleep):
        train_step(model, opt, x)
        standin_ms = median_step_ms(c, lambda: train_step(model, opt, x))
    hidden = 1.0 - (standin_ms - real_ms) / standin_total_ms
    measured = {
        "collectives_per_step": dict(calls),
        "real_step_ms": real_ms,
        "standin_step_ms": standin_ms,
        "standin_comm_ms_per_step": standin_total_ms,
        "standin_ms_per_collective": per_collective_ms,
        "ratio_standin_over_real": standin_ms / real_ms,
        "serial_would_be_ms": real_ms + standin_total_ms,
        "hidden_share": hidden,
    }
    bar = f"hidden share of the stand-in comm >= {HIDDEN_BAR} (ratio 1.0 = all hidden, 1.5 = none)"
    return ("passed" if hidden >= HIDDEN_BAR else "failed"), bar, measured


def part_parity(c: Check) -> PartResult:
    import overlap

    sdpa: contextlib.AbstractContextManager = contextlib.nullcontext()
    if c.cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa = sdpa_kernel(SDPBackend.MATH)
    plain = build_plain(c)
    ours = overlap.wrap(copy.deepcopy(plain))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (plain, ours)]
    x = make_input(c)
    losses: list[tuple[torch.Tensor, torch.Tensor]] = []
    with warnings.catch_warnings(record=True) as caught, sdpa:
        warnings.simplefilter("always")
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            for _ in range(3):
                ref_loss = train_step(plain, opts[0], x)
                our_loss = train_step(ours, opts[1], x)
                losses.append((ref_loss, our_loss))
        finally:
            torch.use_deterministic_algorithms(False)
    full = overlap.full_state_dict(ours)
    loss_diff = max(abs(a.item() - b.item()) for a, b in losses)
    bitwise = all(torch.equal(a, b) for a, b in losses)
    param_diff = 0.0
    for name, ref in plain.state_dict().items():
        mine = full[name].to(ref.device)
        bitwise &= torch.equal(ref, mine)
        param_diff = max(param_diff, (ref.double() - mine.double()).abs().max().item())
    nondeterministic = sorted({str(w.message)[:160] for w in caught if "determinis" in str(w.message)})
    measured = {
        "bitwise": bitwise,
        "max_abs_loss_diff": loss_diff,
        "max_abs_param_diff": param_diff,
        "losses": [(a.item(), b.item()) for a, b in losses],
        "nondeterministic_op_warnings": nondeterministic,
    }
    ok = bitwise or max(loss_diff, param_diff) <= PARITY_TOL
    bar = f"bitwise losses and parameters, else max abs diff <= {PARITY_TOL:g}"
    return ("passed" if ok else "failed"), bar, measured


def part_kernels(c: Check, budget_s: float) -> PartResult:
    rows_json = c.out.with_name(c.out.stem + "_kernels_rows.json")
    cmd = [sys.executable, str(REPO / "benchmarks" / "kernels.py"), "--json", str(rows_json)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    if c.cuda:  # large enough that a launch's fixed cost does not hide the bandwidth
        cmd += ["--device", "cuda", "--sizes", "8M,64M", "--rounds", "5"]
    else:  # the dry run checks the plumbing: tiny, reference kernels only
        cmd += ["--device", "cpu", "--sizes", "64K", "--rounds", "1", "--ops", "memcpy,quantize,copy_out,copy_in"]
        env["OVERLAP_NO_EXT"] = "1"
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=budget_s, env=env)
    measured: dict[str, Any] = {"cmd": cmd[1:], "rc": proc.returncode, "stdout": proc.stdout[-4000:],
                                "stderr": proc.stderr[-2000:]}  # fmt: skip
    if proc.returncode != 0 or not rows_json.exists():
        return "failed", "kernels.py runs and writes its rows", measured
    rows = json.loads(rows_json.read_text())["rows"]
    # kernels.py writes each size's rows after that size's memcpy row, sizes in the order given
    last_size_from = max(i for i, r in enumerate(rows) if r["op"].startswith("memcpy"))
    timing = {"op", "numel", "backend", "median_ms", "min_ms", "max_ms", "gbps"}
    summary = []
    for i, r in enumerate(rows):
        share = r.get("share_of_d2d_copy", r.get("share_of_memcpy"))
        extra = {k: v for k, v in r.items() if k not in timing and not k.startswith("share_of")}
        summary.append({"op": r["op"], "numel": r["numel"], "backend": r["backend"], "gbps": r["gbps"],
                        "share_of_d2d_copy": share, "largest_size": i >= last_size_from, **extra})  # fmt: skip
    measured["rows"] = summary
    measured["rows_json"] = str(rows_json)
    triton = [r for r in summary if r["backend"] == "triton" and r["largest_size"]]
    measured["below_bar"] = [f"{r['op']} {r['numel']}: {r['share_of_d2d_copy']:.2f}" for r in triton
                             if not r["share_of_d2d_copy"] >= SHARE_BAR]  # fmt: skip
    bar = f"every Triton row at the largest size >= {SHARE_BAR} of the device-to-device copy GB/s"
    if not c.cuda:
        return "measured", bar + " (CUDA only: no Triton rows on CPU)", measured
    ok = bool(triton) and not measured["below_bar"]
    return ("passed" if ok else "failed"), bar, measured


def part_memory(c: Check) -> PartResult:
    from overlap.tools.bench.memory import MemoryBenchConfig, bench_memory

    if c.cuda:  # the issue's 151 M-parameter model
        cfg = MemoryBenchConfig(nproc=(1,), contenders=("overlap", "fsdp2"), device="cuda")
    else:
        s = c.sizes
        cfg = MemoryBenchConfig(
            layers=s.layers, d_model=s.d, heads=s.heads, ff=s.ff, seq=s.seq, batch=s.batch,
            steps=2, nproc=(1,), contenders=("overlap", "fsdp2"), device="cpu", threads=1,
        )  # fmt: skip
    runs = {r["name"]: r for r in bench_memory(cfg)["runs"]}
    keys = ("cuda_train_max_allocated_bytes", "cuda_max_allocated_bytes", "cuda_max_reserved_bytes",
            "peak_rss_bytes", "train_peak_rss_bytes", "state_bytes", "ideal_zero3_bytes",
            "library_peak_bytes", "library_peak")  # fmt: skip
    measured: dict[str, Any] = {name: {k: r.get(k) for k in keys} for name, r in runs.items()}
    figure = "cuda_train_max_allocated_bytes" if c.cuda else "peak_rss_bytes"
    ratio = runs["overlap"][figure] / runs["fsdp2"][figure]
    measured["overlap_over_fsdp2"] = {"figure": figure, "ratio": ratio}
    bar = f"train-peak max_memory_allocated: overlap <= {MEMORY_BAR} x FSDP2"
    if not c.cuda:
        return "measured", bar + " (CUDA only; CPU RSS is dominated by the torch import)", measured
    return ("passed" if ratio <= MEMORY_BAR else "failed"), bar, measured


# ---------------------------------------------------------------------------------------------
# running the parts


@dataclass
class Part:
    key: str
    name: str
    run: Callable[[Check, float], PartResult]
    cuda_only: bool = False


PARTS = [
    Part("a", "nccl_path", lambda c, _b: part_nccl_path(c)),
    Part("b", "sync_free", lambda c, _b: part_sync_free(c), cuda_only=True),
    Part("c", "overlap", lambda c, _b: part_overlap(c), cuda_only=True),
    Part("d", "parity", lambda c, _b: part_parity(c)),
    Part("e", "kernels", part_kernels),
    Part("f", "memory", lambda c, _b: part_memory(c)),
]


@contextlib.contextmanager
def time_budget(seconds: float) -> Iterator[None]:
    """Raise PartTimeout in this (main) thread after `seconds`."""

    def expire(_signum: int, _frame: Any) -> None:
        raise PartTimeout(f"ran past its budget of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Atomically: a reader (or a crash) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    tmp.replace(path)


def run_parts(
    check: Check, parts: list[Part], report: dict[str, Any], budgets: dict[str, float], total_s: float
) -> dict[str, Any]:
    """Run `parts` in order, appending each result to `report["parts"]` and rewriting the JSON."""
    start = time.monotonic()
    for part in parts:
        left = total_s - (time.monotonic() - start)
        budget = min(budgets.get(part.key, total_s), left)
        t0 = time.monotonic()
        entry: dict[str, Any] = {"part": part.key, "name": part.name, "budget_s": round(budget, 1)}
        if part.cuda_only and not check.cuda:
            entry.update(status="skipped: no CUDA", bar=None, measured=None)
        elif budget < 5:
            entry.update(status="skipped: out of time", bar=None, measured=None)
        else:
            try:
                with time_budget(budget):
                    status, bar, measured = part.run(check, budget)
                entry.update(status=status, bar=bar, measured=measured)
            except Exception as e:  # noqa: BLE001  a part's failure is its result
                entry.update(status="error", error=f"{type(e).__name__}: {e}",
                             traceback=traceback.format_exc()[-4000:])  # fmt: skip
        entry["seconds"] = round(time.monotonic() - t0, 2)
        report["parts"].append(entry)
        write_report(check.out, report)
        shown = {k: entry.get(k) for k in ("bar", "error")}
        print(f"[gpu_check] {part.key} {part.name}: {entry['status']} ({entry['seconds']} s) "
              f"{json.dumps(entry.get('measured'), default=str)[:600]} {shown}", flush=True)  # fmt: skip
        gc.collect()
        if check.cuda:
            torch.cuda.empty_cache()
    return report


def give_up(out: Path, report: dict[str, Any]) -> None:
    report["summary"] = {"error": "watchdog: a part hung past the whole run's budget"}
    write_report(out, report)
    print(f"[gpu_check] watchdog: a part hung; wrote {out}", flush=True)
    os._exit(2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    os.environ.update(ENV)  # before overlap is imported and before CUDA initializes
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "gpu_results" / "gpu_check.json")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", default=",".join(p.key for p in PARTS), help="comma list of parts, e.g. a,d")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: --device cuda but CUDA is not available (use --device cpu for the dry run)")
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
        timeout=timedelta(seconds=120), device_id=device if cuda else None,
    )  # fmt: skip
    check = Check(device, SIZES[args.device], args.out)
    environment: dict[str, Any] = {"torch": torch.__version__, "device": args.device, "env": ENV,
                                   "sizes": asdict(check.sizes)}  # fmt: skip
    if cuda:
        environment |= {"name": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability(),
                        "nccl": str(torch.cuda.nccl.version())}  # fmt: skip
    report: dict[str, Any] = {"environment": environment, "parts": []}
    wanted = set(args.only.split(","))
    # A part stuck inside a C++ call (a hung collective, a device sync) never sees its SIGALRM:
    # past the whole budget, give up on it. The parts that finished are on disk already.
    watchdog = threading.Timer(TOTAL_BUDGET_S + 30, give_up, args=(check.out, report))
    watchdog.daemon = True
    watchdog.start()
    try:
        run_parts(check, [p for p in PARTS if p.key in wanted], report, PART_BUDGET_S, TOTAL_BUDGET_S)
    finally:
        watchdog.cancel()
        dist.destroy_process_group()
    statuses = Counter(p["status"].split(":")[0] for p in report["parts"])
    report["summary"] = dict(statuses)
    write_report(check.out, report)
    print(f"[gpu_check] {dict(statuses)}; wrote {check.out}", flush=True)
    return 1 if statuses.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
