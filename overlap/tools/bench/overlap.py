"""`overlap bench overlap`: how much communication can this machine hide behind compute?

    overlap bench overlap                                 # 2 gloo ranks, all_gather 16 MiB x 4
    overlap bench overlap --op reduce_scatter --comm-bytes 67108864 --matmul-dim 1024
    overlap bench overlap --link 1gbit --json out/overlap.json

Three phases, each on every rank after a barrier: compute alone (a loop of square matmuls),
comm alone (`--num-comms` collectives of `--comm-bytes`, issued async, then waited for) and
together (the same collectives issued async, the same matmuls at once, then the wait). On GPU the
collectives are issued from a side stream, so NCCL's stream runs beside the compute stream; on
CPU they are gloo's async work, run by its worker threads, which take cores from the matmuls.
Each phase's time is the slowest rank's. Rounds rotate the phase order; reported are the
median over rounds and the min-max.

Derived: hidden comm = compute + comm - together, as a share of comm alone (1.0: all of it
hidden; at most min(compute, comm) can be); compute slowdown = compute time inside "together"
/ compute alone - 1 (what the concurrent comm cost the compute). On CPU the process CPU time of
the comm-alone phase shows what the collectives themselves burn (gloo's copies and sockets).

Each collective gets its own buffers, so those running at once never share memory. By default
the number of matmuls is calibrated in the warm-up round so compute alone takes about as long as
comm alone (agreed across ranks): the case where overlap matters most.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from overlap.tools.bench.comm import OPS, Op, build_case, count_for
from overlap.tools.flags import JSON_FLAG, LINK_FLAG, command
from overlap.tools.worlds.launch import current_device
from overlap.tools.worlds.link import LinkSpec, active_link
from overlap.tools.worlds.runner import run_bench

PHASES = ("compute", "comm", "together", "together_compute")
"""Per-round timings: the three phases, and the compute loop's own time inside "together"."""
_CALIBRATION_MATMULS = 4


@dataclass(frozen=True, kw_only=True)
class OverlapBenchConfig:
    """One overlap measurement. Defaults take about half a minute on 2 CPU cores."""

    op: Op = "all_gather"
    comm_bytes: int = 16 * 2**20
    """Per-rank bytes of one collective, counted as in `bench comm`."""
    num_comms: int = 4
    """Collectives per phase, all issued at once."""
    matmul_dim: int = 512
    num_matmuls: int | None = None
    """Matmuls per phase; None: calibrated so compute alone ~ comm alone."""
    rounds: int = 5
    dtype: str = "float32"
    nproc: int | None = None
    """Ranks of the spawned local world; None: `default_world()` (2 on CPU). Ignored under torchrun."""
    link: str | None = field(default=None, metadata=LINK_FLAG)
    json_path: str | None = field(default=None, metadata=JSON_FLAG)

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"OverlapBenchConfig.op: {self.op!r} is not one of {OPS}")
        if min(self.comm_bytes, self.num_comms, self.matmul_dim, self.rounds) < 1:
            raise ValueError("OverlapBenchConfig: sizes, counts and rounds must be >= 1")
        if self.num_matmuls is not None and self.num_matmuls < 1:
            raise ValueError("OverlapBenchConfig.num_matmuls must be >= 1 or None")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise TypeError(f"OverlapBenchConfig.dtype: {self.dtype!r} is not a torch dtype")
        if self.link is not None:
            LinkSpec.parse(self.link)


@dataclass(frozen=True, kw_only=True)
class Spread:
    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(median=statistics.median(values), min=min(values), max=max(values))


@dataclass(frozen=True, kw_only=True)
class OverlapReport:
    backend: str
    world_size: int
    link: str | None
    config: OverlapBenchConfig
    num_matmuls: int
    phases_ms: dict[str, Spread]
    comm_cpu_ms: Spread
    """Process CPU time (all threads, user + system) of the comm-alone phase, slowest rank;
    kernel network work done in softirq context may be charged to other processes."""
    rounds_ms: list[dict[str, float]]

    @property
    def hidden_ms(self) -> float:
        p = self.phases_ms
        return p["compute"].median + p["comm"].median - p["together"].median

    @property
    def hidden_share(self) -> float:
        return self.hidden_ms / self.phases_ms["comm"].median

    @property
    def compute_slowdown(self) -> float:
        return self.phases_ms["together_compute"].median / self.phases_ms["compute"].median - 1

    def to_json(self) -> dict[str, object]:
        return {
            "backend": self.backend,
            "world_size": self.world_size,
            "link": self.link,
            "config": {**asdict(self.config), "num_matmuls": self.num_matmuls},
            "phases_ms": {k: asdict(v) for k, v in self.phases_ms.items()},
            "comm_cpu_ms": asdict(self.comm_cpu_ms),
            "hidden_ms": self.hidden_ms,
            "hidden_share": self.hidden_share,
            "compute_slowdown": self.compute_slowdown,
            "rounds_ms": self.rounds_ms,
        }


class _Phases:
    """The buffers and the three timed phases of one rank."""

    def __init__(self, cfg: OverlapBenchConfig, device: torch.device) -> None:
        dtype = getattr(torch, cfg.dtype)
        self.device = device
        n = dist.get_world_size()
        count = max(count_for(cfg.op, cfg.comm_bytes, dtype.itemsize, n), n)
        self.cases = [build_case(cfg.op, count, False, dtype, device) for _ in range(cfg.num_comms)]
        gen = torch.Generator(device=device).manual_seed(0)
        dim = cfg.matmul_dim
        self.a = torch.randn(dim, dim, dtype=dtype, device=device, generator=gen)
        self.b = torch.randn(dim, dim, dtype=dtype, device=device, generator=gen)
        self.c = torch.empty(dim, dim, dtype=dtype, device=device)
        # Why a side stream: issued there, NCCL's kernels are not ordered behind the compute
        # stream's matmuls; priority high so comm kernels get SMs as soon as they are ready.
        self.comm_stream = torch.cuda.Stream(priority=-1) if device.type == "cuda" else None

    def _issue(self) -> list[dist.Work]:
        works = [case.launch(async_op=True) for case in self.cases]
        return [w for w in works if w is not None]

    def issue_comm(self) -> list[dist.Work]:
        if self.comm_stream is None:
            return self._issue()
        self.comm_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.comm_stream):
            return self._issue()

    def compute(self, num_matmuls: int) -> None:
        for _ in range(num_matmuls):
            torch.mm(self.a, self.b, out=self.c)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time_compute(self, num_matmuls: int) -> float:
        return _timed(lambda: self.compute(num_matmuls), self.sync)[0]

    def time_comm(self) -> tuple[float, float]:
        """(wall ms, process CPU ms) of issuing the collectives and waiting for them."""
        return _timed(lambda: _wait_all(self.issue_comm()), self.sync)

    def time_together(self, num_matmuls: int) -> tuple[float, float]:
        """(wall ms of the whole phase, ms of its compute loop)."""
        compute_ms = 0.0

        def both() -> None:
            nonlocal compute_ms
            works = self.issue_comm()
            start = time.perf_counter()
            self.compute(num_matmuls)
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()  # the compute stream only
            compute_ms = (time.perf_counter() - start) * 1e3
            _wait_all(works)

        return _timed(both, self.sync)[0], compute_ms


def _wait_all(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def _timed(fn: Callable[[], None], sync: Callable[[], None]) -> tuple[float, float]:
    """(wall ms, process CPU ms) of `fn` on this rank, started together with the other ranks.
    Process CPU time counts every thread: gloo's workers as well as the matmuls."""
    sync()
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    sync()
    return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


def _round(phases: _Phases, num_matmuls: int, order: int) -> tuple[dict[str, float], float]:
    """One round, phases in rotated order; times (and comm CPU ms) of the slowest rank."""
    steps = ["compute", "comm", "together"]
    times: dict[str, float] = {}
    cpu_ms = 0.0
    for step in steps[order % 3 :] + steps[: order % 3]:
        if step == "compute":
            times["compute"] = phases.time_compute(num_matmuls)
        elif step == "comm":
            times["comm"], cpu_ms = phases.time_comm()
        else:
            times["together"], times["together_compute"] = phases.time_together(num_matmuls)
    # once per round, after its timed phases: the slowest rank's times (a host read, off the clock)
    t = torch.tensor([times[k] for k in PHASES] + [cpu_ms], dtype=torch.float64, device=phases.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    values = t.cpu().tolist()
    return dict(zip(PHASES, values[:-1], strict=True)), values[-1]


def _calibrate(phases: _Phases) -> int:
    """Matmuls that take about as long as the comm alone (from the slowest rank's times, so
    every rank agrees). The first round only warms up: it includes one-time costs."""
    _round(phases, _CALIBRATION_MATMULS, order=0)
    times, _ = _round(phases, _CALIBRATION_MATMULS, order=0)
    per_matmul_ms = times["compute"] / _CALIBRATION_MATMULS
    return max(1, round(times["comm"] / per_matmul_ms))


def overlap_rank(rank: int, world_size: int, cfg: OverlapBenchConfig) -> OverlapReport | None:
    """The benchmark on one rank (all ranks call it); rank 0 prints and returns the report."""
    from tqdm import tqdm

    phases = _Phases(cfg, current_device())
    num_matmuls = cfg.num_matmuls or _calibrate(phases)
    _round(phases, num_matmuls, order=0)  # warm-up at the final size
    rounds, cpu = [], []
    for r in tqdm(range(cfg.rounds), desc="bench overlap", disable=rank != 0, leave=False):
        times, cpu_ms = _round(phases, num_matmuls, order=r)
        rounds.append(times)
        cpu.append(cpu_ms)
    if rank != 0:
        return None
    report = OverlapReport(
        backend=dist.get_backend(),
        world_size=world_size,
        link=active_link(),
        config=cfg,
        num_matmuls=num_matmuls,
        phases_ms={k: Spread.of([t[k] for t in rounds]) for k in PHASES},
        comm_cpu_ms=Spread.of(cpu),
        rounds_ms=rounds,
    )
    print(format_report(report), flush=True)
    return report


def format_report(report: OverlapReport) -> str:
    cfg, p = report.config, report.phases_ms
    dim = cfg.matmul_dim
    link = f", link {report.link}" if report.link else ""
    labels = {
        "compute": f"compute alone ({report.num_matmuls} x matmul {dim}^3)",
        "comm": f"comm alone ({cfg.num_comms} x {cfg.op} {cfg.comm_bytes} B)",
        "together": "compute || comm",
        "together_compute": "  its compute loop",
    }
    w = max(map(len, labels.values()))
    header = (
        f"bench overlap: {report.world_size} ranks, {report.backend}{link}, {cfg.dtype}, "
        f"{cfg.rounds} rounds (slowest rank per phase)"
    )
    lines = [header, f"{'phase':<{w}} {'median ms':>10} {'min-max ms':>17}"]
    for key, label in labels.items():
        t = p[key]
        lines.append(f"{label:<{w}} {t.median:>10.1f} {f'{t.min:.1f}-{t.max:.1f}':>17}")
    c = report.comm_cpu_ms
    busy = c.median / p["comm"].median
    possible = min(p["compute"].median, p["comm"].median) / p["comm"].median
    ratio = p["together"].median / max(p["compute"].median, p["comm"].median)
    cpu_label = "comm alone: process CPU time"
    lines.append(
        f"{cpu_label:<{w}} {c.median:>10.1f} {f'{c.min:.1f}-{c.max:.1f}':>17}"
        f"   ({busy:.2f} cores busy while only communicating)"
    )
    lines.append(
        f"hidden comm: {report.hidden_ms:.1f} of {p['comm'].median:.1f} ms = "
        f"{report.hidden_share:.0%} (at most {possible:.0%}: min(compute, comm) / comm)"
    )
    lines.append(
        f"compute slowed down by {report.compute_slowdown:+.0%} under concurrent comm; "
        f"together / max(compute, comm) = {ratio:.2f}"
    )
    return "\n".join(lines)


def bench_overlap(cfg: OverlapBenchConfig) -> OverlapReport | None:
    """Run in torchrun's world, over an emulated link, or in a spawned local world; the report
    on the process holding rank 0 (None elsewhere). Writes `cfg.json_path` there."""
    return run_bench(overlap_rank, cfg)


add_arguments, run = command(OverlapBenchConfig, bench_overlap, "overlap bench overlap")
