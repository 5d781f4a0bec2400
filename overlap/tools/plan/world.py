"""The local worlds the calibration (and benchmarks/plan_validate.py) measure in, and what every
rank of one sets up: its groups, W1, and the reductions of per-rank numbers to one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from overlap.tools.workloads.step import Workload


@dataclass(frozen=True)
class World:
    """A local world to calibrate (or validate) in: its link, ranks and HSDP replicas."""

    link: str = "loopback"
    """"loopback" or an emulated link's text ("1gbit", "1gbit,200us": overlap.tools.worlds.link)."""
    num_ranks: int = 2
    num_replicas: int = 1
    """HSDP: a 2-D mesh of num_replicas x (num_ranks / num_replicas)."""

    def __post_init__(self) -> None:
        if self.link != "loopback":
            from overlap.tools.worlds.link import LinkSpec

            LinkSpec.parse(self.link)  # fail here, not in the ranks
        if self.num_ranks < 2 or self.num_replicas < 1 or self.num_ranks % self.num_replicas:
            raise ValueError(
                f"World: num_ranks ({self.num_ranks}) must be >= 2 and a multiple of num_replicas ({self.num_replicas})"
            )
        if self.num_ranks // self.num_replicas < 2:
            raise ValueError(f"World: a shard group needs >= 2 ranks, got {self.num_ranks} / {self.num_replicas}")

    @classmethod
    def parse(cls, text: str) -> World:
        """ "loopback", "1gbit" (2 ranks), "loopback,4" or "4ranks" (4 ranks), "hsdp2x2"
        (2 replicas x 2 shards, loopback), "1gbit,hsdp2x2"."""
        link, ranks, replicas = "loopback", 2, 1
        for part in (p.strip() for p in text.split(",") if p.strip()):
            if part.startswith("hsdp") and "x" in part:
                r, s = part[4:].split("x")
                replicas, ranks = int(r), int(r) * int(s)
            elif part.endswith("ranks") and part[:-5].isdigit():
                ranks = int(part[:-5])
            elif part.isdigit():
                ranks = int(part)
            elif part != "loopback":
                link = part if link == "loopback" else f"{link},{part}"
        return cls(link, ranks, replicas)

    @property
    def shard_size(self) -> int:
        return self.num_ranks // self.num_replicas

    def __str__(self) -> str:
        hsdp = f" hsdp {self.num_replicas}x{self.shard_size}" if self.num_replicas > 1 else ""
        return f"{self.link} {self.num_ranks} ranks{hsdp}"

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """`fn(rank, world_size, *args)` on this world's ranks (one thread each)."""
        from overlap.tools.worlds.launch import run_local_world
        from overlap.tools.worlds.link import LinkSpec, run_linked_world

        if self.link == "loopback":
            return run_local_world(fn, self.num_ranks, *args, threads_per_rank=1)
        return run_linked_world(fn, self.num_ranks, *args, spec=LinkSpec.parse(self.link))


def groups(world: World) -> tuple[Any, dist.ProcessGroup, dist.ProcessGroup | None]:
    """(what `overlap.wrap` takes as `group`, the shard group, the replica group or None)."""
    if world.num_replicas == 1:
        return None, dist.group.WORLD, None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world.num_replicas, world.shard_size), mesh_dim_names=("replicate", "shard"))
    return mesh, mesh.get_group(1), mesh.get_group(0)


def w1(**sizes: Any) -> Workload:
    """W1, `overlap bench step`'s default model (`sizes`: other `Workload` fields, such as
    `seq`)."""
    return Workload(**sizes)


def mean_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def set_up_rank() -> None:
    """One compute thread, freed CPU memory kept as overlap.wrap keeps it, the C++ kernels built
    (a JIT build must not land inside a timed phase)."""
    from overlap.transport.host import keep_freed_cpu_memory

    torch.set_num_threads(1)
    keep_freed_cpu_memory()
    try:
        from overlap.kernels.cpu import load_extension

        load_extension()
    except Exception as e:
        print(f"note: C++ kernels not loaded ({e})")
