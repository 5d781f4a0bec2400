"""`overlap bench step`'s report: per-contender numbers, the table, the scaling table and the JSON.

The package's docstring (overlap/tools/bench/step/__init__.py) describes the columns and the JSON.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from overlap.tools import flags
from overlap.tools.bench import peers
from overlap.tools.bench.step.config import StepBenchConfig
from overlap.tools.bench.step.contenders import Contender
from overlap.tools.workloads.step import describe
from overlap.tools.worlds.link import active_link

RATIO_BASES = ("fsdp2", "fsdp2-tuned", "floor-compute||comm", "ddp", *peers.PEERS)
"""Each overlap row's step time is printed as a ratio to these, where they ran."""


@dataclass(frozen=True, kw_only=True)
class StepRun:
    """One contender's numbers in one world (times: slowest rank; memory: largest rank)."""

    name: str
    median_step_ms: float
    spread_ms: tuple[float, float]
    """Min and max of the per-round medians."""
    tokens_per_s: float
    """Global: batch x seq x world size per median step."""
    exposed_comm_ms: float | None
    exposed_comm_estimated: bool
    """True: step - floor-compute, not the contender's own measure."""
    peak_mem_bytes: int | None
    """Peak RSS (VmHWM) of a fresh world that ran only this contender, largest rank; None
    when not measured (--no-memory). See "Memory" in bench/step's docstring."""
    train_mem_bytes: int | None = None
    """The same peak less the RSS the rank had just before the contender was built (torch, the
    process group and the contender's package already loaded): the memory training adds (model,
    state, buffers, activations, the allocator's slack), largest rank; None when not measured."""
    train_mem_range_bytes: tuple[int, int] | None = None
    """Smallest and largest train figure over the memory pass's worlds (--memory-repeats)."""
    state_bytes: int
    """Parameters + gradients + optimizer state, per rank, by accounting."""
    parity_rel: float | None
    """Relative difference of the step-1 loss from DDP's; None when not checked."""
    overlap_efficiency: float | None = None
    """Hidden comm / total comm (median over rounds, from overlap's trace); None for others."""
    lossy: bool = False
    """Compressed or low-precision communication: its loss is not DDP's by design."""
    settings: dict[str, Any] | None = None
    """The contender's configuration beyond its defaults (overlap overrides, DeepSpeed's ZeRO
    section, the hook and its state); None for the floors."""


@dataclass(frozen=True, kw_only=True)
class StepReport:
    world_size: int
    link: str
    config: StepBenchConfig
    runs: list[StepRun]

    def run(self, name: str) -> StepRun | None:
        return next((r for r in self.runs if r.name == name), None)

    def to_json(self) -> dict[str, object]:
        return {
            "world_size": self.world_size,
            "link": self.link,
            "model": describe(self.config),
            "config": asdict(self.config),
            "runs": [asdict(r) for r in self.runs],
        }


def summarize(cfg: StepBenchConfig, world_size: int, contenders: list[Contender]) -> StepReport:
    tokens = cfg.batch * cfg.seq * world_size
    spreads = {c.name: [statistics.median(r) for r in c.step_ms] for c in contenders}
    floor_ms = statistics.median(spreads["floor-compute"]) if "floor-compute" in spreads else None
    runs = []
    for c in contenders:
        med = statistics.median(spreads[c.name])
        exposed: float | None
        estimated = False
        if c.exposed_ms:
            exposed = statistics.median(c.exposed_ms)
        elif c.name == "floor-compute":
            exposed = 0.0
        elif floor_ms is not None:
            exposed, estimated = med - floor_ms, True
        else:
            exposed = None
        runs.append(
            StepRun(
                name=c.name,
                median_step_ms=med,
                spread_ms=(min(spreads[c.name]), max(spreads[c.name])),
                tokens_per_s=tokens / (med / 1e3),
                exposed_comm_ms=exposed,
                exposed_comm_estimated=estimated,
                peak_mem_bytes=None,  # measured in fresh processes afterwards (bench_step)
                state_bytes=c.state_bytes,
                parity_rel=c.parity_rel,
                overlap_efficiency=statistics.median(c.efficiency) if c.efficiency else None,
                lossy=c.lossy,
                settings=c.settings,
            )
        )
    return StepReport(world_size=world_size, link=active_link() or "loopback", config=cfg, runs=runs)


def format_report(report: StepReport) -> str:
    cfg, rows, mib = report.config, report.runs, 2**20
    hsdp = f", HSDP {cfg.hsdp} x {report.world_size // cfg.hsdp}" if cfg.hsdp > 1 else ""
    title = (
        f"\n{describe(cfg)}, B={cfg.batch} T={cfg.seq}, world={report.world_size} x "
        f"{cfg.threads} thread(s){hsdp}, gloo {report.link}; {cfg.rounds} rounds x {cfg.steps} steps"
    )
    lines = [title]
    w = max(len(row.name) for row in rows)
    header = (
        f"{'contender':<{w}} {'step ms':>9} {'spread ms':>15} {'tok/s':>8} {'exposed ms':>11} "
        f"{'overlap eff':>11} {'state MiB':>10} {'peak RSS MiB':>13} {'train MiB':>10}"
    )
    lines += [header, "-" * len(header)]
    for row in rows:
        lo, hi = row.spread_ms
        e = row.exposed_comm_ms
        e_str = "n/a" if e is None else ("~" if row.exposed_comm_estimated else "") + f"{e:.1f}"
        eff = "n/a" if row.overlap_efficiency is None else f"{row.overlap_efficiency:.0%}"
        peak = "n/a" if row.peak_mem_bytes is None else f"{row.peak_mem_bytes / mib:.1f}"
        train = "n/a" if row.train_mem_bytes is None else f"{row.train_mem_bytes / mib:.1f}"
        lines.append(
            f"{row.name:<{w}} {row.median_step_ms:>9.1f} {f'{lo:.1f}-{hi:.1f}':>15} "
            f"{row.tokens_per_s:>8.0f} {e_str:>11} {eff:>11} {row.state_bytes / mib:>10.1f} "
            f"{peak:>13} {train:>10}"
        )
    lines.append(
        "~ = estimate: step - floor-compute.  overlap eff = hidden comm / total comm from "
        "overlap's trace.  state = params + grads + optimizer + communication state "
        "(error feedback, PowerSGD), per rank.\n"
        "peak RSS = the OS's high-water mark (VmHWM) of a fresh world running only that contender "
        "(largest rank; whole process: import, build, steps); train = that peak less the RSS "
        "before the contender was built"
        + (f" (medians of {cfg.memory_repeats} worlds)" if cfg.memory_repeats > 1 else "")
        + ("" if cfg.memory else ": not measured (--no-memory)")
    )
    for row in rows:
        if not row.name.startswith("overlap"):
            continue
        ratios = [
            f"{row.name}/{other.name} = {row.median_step_ms / other.median_step_ms:.3f}"
            for other in map(report.run, RATIO_BASES)
            if other is not None
        ]
        ratios += [
            f"memory (state) {row.name}/{other.name} = {row.state_bytes / other.state_bytes:.3f}"
            for other in map(report.run, ("ddp", *peers.DEEPSPEED_PEERS))
            if other is not None and other.state_bytes
        ]
        lines.append("  " + "\n  ".join(ratios))
        carried = (row.settings or {}).get("transport")
        if carried:
            lines.append("  transport: " + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in carried.items()))
    return "\n".join(lines)


def format_scaling(reports: list[StepReport]) -> str:
    """tokens/s per contender per world size, and the speedup over the smallest world size."""
    reports = sorted(reports, key=lambda r: r.world_size)
    base = reports[0]
    names = list(dict.fromkeys(run.name for r in reports for run in r.runs))
    w = max(len("contender"), *map(len, names))
    col = 18
    n0 = base.world_size
    title = f"\nscaling: global tokens/s at world size n (speedup vs n={n0}), {base.config.batch} sequences per rank"
    header = f"{'contender':<{w}}" + "".join(f"{f'n={r.world_size}':>{col}}" for r in reports)
    lines = [title, header, "-" * len(header)]
    for name in names:
        ref = base.run(name)
        cells = []
        for r in reports:
            run = r.run(name)
            if run is None:
                cells.append(f"{'-':>{col}}")
                continue
            speedup = f"({run.tokens_per_s / ref.tokens_per_s:.2f}x)" if ref is not None else "(-)"
            cells.append(f"{f'{run.tokens_per_s:.0f} {speedup}':>{col}}")
        lines.append(f"{name:<{w}}" + "".join(cells))
    ideal = "".join(f"{f'({r.world_size / n0:.2f}x)':>{col}}" for r in reports)
    lines.append(f"{'ideal':<{w}}" + ideal)
    return "\n".join(lines)


def json_path_for(path: str, world_size: int, num_worlds: int) -> Path:
    """PATH for a single world size; PATH with `.n<world size>` before its suffix otherwise."""
    p = Path(path)
    return p if num_worlds == 1 else p.with_name(f"{p.stem}.n{world_size}{p.suffix}")


def write_json(report: StepReport, path: Path) -> None:
    flags.write_json(path, report.to_json())
