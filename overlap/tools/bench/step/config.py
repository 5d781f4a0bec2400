"""`overlap bench step`'s config: the workload (overlap/tools/workloads/step.py) and how it is
compared; its fields are the command's flags (overlap/tools/flags.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from overlap.tools.bench import peers
from overlap.tools.bench.peers import parse_overrides
from overlap.tools.flags import JSON_FLAG, LINK_FLAG, OVERLAP_CONFIG_FLAG, WORLD_SIZES_FLAG, flag
from overlap.tools.workloads.step import Workload
from overlap.tools.worlds.link import LinkSpec

DEFAULT_CONTENDERS = ("overlap", "fsdp2", "fsdp2-tuned", "ddp", "floor-compute", "floor-compute||comm")
ALL_CONTENDERS = DEFAULT_CONTENDERS + peers.PEERS

CONTENDERS_FLAG = flag(help="comma list from " + ", ".join(ALL_CONTENDERS))


@dataclass(frozen=True, kw_only=True)
class StepBenchConfig(Workload):
    """One side-by-side comparison. Defaults are W1 on 2 ranks: a few minutes on 2 CPU cores."""

    contenders: tuple[str, ...] = field(default=DEFAULT_CONTENDERS, metadata=CONTENDERS_FLAG)
    overlap_configs: tuple[str, ...] = field(default=(), metadata=OVERLAP_CONFIG_FLAG)
    """Extra overlap contenders, one per "key=value[,key=value]" of OverlapConfig overrides."""
    rounds: int = 3
    """Rounds interleaving the contenders (order rotated each round)."""
    steps: int = 6
    """Timed steps per contender per round."""
    nproc: tuple[int, ...] = field(default=(2,), metadata=WORLD_SIZES_FLAG)
    """World sizes, one spawned world each, run in this order (several: a scaling table)."""
    hsdp: int = field(default=1, metadata=flag(metavar="R"))
    """HSDP: R replicate groups. overlap and the fsdp2 contenders shard over world / R ranks and
    replicate over R, on a (R, world / R) DeviceMesh; DDP and floor-compute are the same whatever
    the mesh; floor-compute||comm and the DeepSpeed peers stay ZeRO-3 over every rank. 1: no HSDP."""
    threads: int = 1
    """Torch threads per rank."""
    keep_freed_memory: bool = True
    """Apply overlap's CPU allocator setting to every contender (see [Note: one allocator ...] in
    bench/step/protocol.py); off: glibc's malloc thresholds are left alone for every contender."""
    memory: bool = True
    """Measure each contender's peak RSS in a fresh world of its own (see bench/step's docstring)."""
    memory_repeats: int = 1
    """Fresh worlds per contender in the memory pass (taken in turn); the medians are reported."""
    timeout_s: float = 300.0
    """Process-group timeout: a hung collective fails after this long."""
    link: str | None = field(default=None, metadata=LINK_FLAG)
    """Emulated link for every world, e.g. "1gbit" or "1gbit,200us" (overlap.tools.worlds.link)."""
    json_path: str | None = field(default=None, metadata=JSON_FLAG)
    """One file per world size: PATH, or PATH with .n<N> before its suffix for several."""

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = sorted(set(self.contenders) - set(ALL_CONTENDERS))
        if unknown or not self.contenders:
            raise ValueError(f"StepBenchConfig.contenders: unknown {unknown}; choose from {ALL_CONTENDERS}")
        if min(self.rounds, self.steps, self.memory_repeats, self.threads) < 1:
            raise ValueError("StepBenchConfig: rounds, steps, memory_repeats and threads must be >= 1")
        if not self.nproc or min(self.nproc) < 1 or len(set(self.nproc)) != len(self.nproc):
            raise ValueError(f"StepBenchConfig.nproc: need distinct world sizes >= 1, got {self.nproc}")
        if self.hsdp < 1:
            raise ValueError(f"StepBenchConfig.hsdp: need R >= 1 replicate groups, got {self.hsdp}")
        uneven = [n for n in self.nproc if n % self.hsdp]
        if uneven:
            raise ValueError(
                f"StepBenchConfig.hsdp: --hsdp {self.hsdp} needs every world size of --nproc divisible "
                f"by {self.hsdp} (the shard group is world / R ranks); {uneven} is not"
            )
        for spec in self.overlap_configs:
            parse_overrides(spec)
        if self.link is not None:
            LinkSpec.parse(self.link)  # fail here, not in the ranks
