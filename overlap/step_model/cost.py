"""Cost model: alpha-beta times for ring collectives on a two-level topology, compute per unit.

[Note: alpha-beta ring model]
A ring collective over n ranks moves (n-1)/n of the data through every rank's link in n-1
steps: all-gather / reduce-scatter of S bytes (the full, unsharded size) take
    (n-1)·α + (n-1)/n · S / B
all-reduce twice that (reduce-scatter then all-gather), all-to-all the same as all-gather with
every rank's S. B is the bus bandwidth a rank sustains, so busbw from nccl-tests (or from
`overlap bench comm`, which prints the same column) is exactly B. On two levels (GPUs per node
over NVLink, nodes over InfiniBand/Ethernet) a ring spanning nodes is limited by the inter-node
link: B is the per-GPU share of the node's network bandwidth and α the inter-node latency.

[Note: shared-memory collectives]
Ranks of one host exchange through shared memory (overlap/transport/shm.py): a rank posts its
bytes into its ring at issue and pulls every peer's at the wait, both copies on the training
thread. Nothing is in flight between the two, so the op "shm" crosses `SHARED_MEMORY`, a link of
no time; its copies are host work ([Note: host work] in simulate.py), measured on the
runtime's own verbs (overlap/tools/plan/measure.py `measure_host`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Link:
    """One link level: latency per ring step and the bus bandwidth one rank sustains."""

    name: str
    alpha_s: float
    busbw_gbps: float  # GB/s (1e9 bytes/s), the nccl-tests "busbw" column
    source: str = ""

    def seconds(self, num_bytes: float) -> float:
        return num_bytes / (self.busbw_gbps * 1e9)


SHARED_MEMORY = Link(
    "shared memory", 0.0, math.inf, "no wire: the post and the pull are copies on the training thread (host work)"
)
"""The link of a shared-memory collective ([Note: shared-memory collectives])."""

# Presets. Each cites where its numbers come from; busbw is what collectives achieve, not the
# line rate.
LINKS: dict[str, Link] = {
    "nvlink4": Link(
        "nvlink4",
        8e-6,
        360.0,
        "H100/H200 SXM NVLink4, 900 GB/s bidirectional per GPU; nccl-tests all_gather busbw on "
        "8xH100 reaches ~360 GB/s at large sizes (NVIDIA nccl-tests results)",
    ),
    "ndr400": Link(
        "ndr400",
        15e-6,
        45.0,
        "InfiniBand NDR 400 Gb/s, one NIC per GPU: 50 GB/s line rate, ~45 GB/s busbw across nodes in nccl-tests",
    ),
    "nvlink3": Link(
        "nvlink3",
        8e-6,
        240.0,
        "A100 SXM NVLink3, 600 GB/s bidirectional per GPU (300 GB/s each way, NVIDIA A100 "
        "datasheet); busbw taken at the same 80% of the one-way rate as the nvlink4 preset",
    ),
    "hdr200": Link(
        "hdr200",
        15e-6,
        22.5,
        "InfiniBand HDR 200 Gb/s, one NIC per GPU (NVIDIA ConnectX-6): 25 GB/s line rate; busbw "
        "at the same 90% of line rate as the ndr400 preset",
    ),
    "eth100": Link(
        "eth100",
        30e-6,
        1.4,
        "100 Gb/s Ethernet per node (12.5 GB/s) shared by 8 GPUs, ~90% achievable: 1.4 GB/s per GPU",
    ),
    "gloo-loopback": Link(
        "gloo-loopback",
        60e-6,
        0.9,
        "gloo over 127.0.0.1 on this 2-core machine, measured by `overlap bench comm --nproc 2` "
        "(all_gather busbw at 4-64 MiB); calibrate with --calibrate for your machine",
    ),
    "1gbit": Link(
        "1gbit",
        200e-6,
        0.118,
        "the emulated 1 Gbit/s link of `--link 1gbit` (tc tbf): 125 MB/s line rate, ~118 MB/s busbw",
    ),
}


@dataclass(frozen=True)
class Topology:
    num_ranks: int
    ranks_per_node: int
    intra: Link
    inter: Link
    reduce_link: Link | None = None
    """The link as the gradient exchange sees it, when it differs from the all-gathers' (None:
    the same). gloo reduce-scatters through all-to-all ([Note: reduce-scatter through
    all-to-all] in overlap/transport/collectives.py), which sustains its own busbw: calibrate it separately."""
    num_replicas: int = 1
    """HSDP: replicas of the shard group (`num_ranks` is one shard group); each reduced shard is
    then all-reduced across them ([Note: hybrid sharding] in overlap/engine/groups.py)."""
    replica_link: Link | None = None
    """The link the replicas' all-reduce crosses (None: `link()`)."""

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"Topology.num_replicas must be >= 1, got {self.num_replicas}")

    def replicas(self) -> Topology | None:
        """The replica group as a topology of its own (None without HSDP): its ring times the
        all-reduce of the reduced shards."""
        if self.num_replicas == 1:
            return None
        link = self.replica_link or self.link()
        return Topology(self.num_replicas, self.num_replicas, link, link)

    def link(self) -> Link:
        return self.intra if self.num_ranks <= self.ranks_per_node else self.inter

    def link_for(self, op: str) -> Link:
        """The link that times `op`: `reduce_link` for reduce-scatter / all-to-all if set;
        `SHARED_MEMORY` for "shm" ([Note: shared-memory collectives])."""
        if op == "shm":
            return SHARED_MEMORY
        if self.reduce_link is not None and op in ("reduce_scatter", "all_to_all"):
            return self.reduce_link
        return self.link()


def ring_time_s(op: str, total_bytes: float, topo: Topology) -> float:
    """Time of one ring collective whose unsharded size is `total_bytes` (see the Note)."""
    n = topo.num_ranks
    if n == 1:
        return 0.0
    link = topo.link_for(op)
    steps = n - 1
    frac = (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all", "shm"):
        return steps * link.alpha_s + frac * link.seconds(total_bytes)
    if op == "all_reduce":
        return 2 * (steps * link.alpha_s + frac * link.seconds(total_bytes))
    raise ValueError(f"unknown collective {op!r}")


def calibrate_from_bench(path: str | Path, op: str = "all_gather") -> Link:
    """A Link fitted to `overlap bench comm --json` rows: α from the smallest size, busbw from
    the median of the largest quarter. A sweep over the shared-memory transport
    (`--transport shm`) fits the link between ranks of one host, and is named so."""
    rows = [r for r in json.loads(Path(path).read_text())["rows"] if r["op"] == op]
    if not rows:
        raise ValueError(f"{path}: no {op} rows")
    rows.sort(key=lambda r: r["bytes"])
    big = rows[-max(1, len(rows) // 4) :]
    busbw = sorted(r["busbw_gbps"] for r in big)[len(big) // 2]
    data = json.loads(Path(path).read_text())
    n = data["world_size"]
    alpha = rows[0]["time_us"] * 1e-6 / max(n - 1, 1)
    via = " (shared memory between ranks of one host)" if data.get("transport") == "shm" else ""
    return Link(f"measured:{Path(path).name}", alpha, busbw, f"fitted to {path}{via}")


@dataclass(frozen=True)
class UnitCost:
    """One unit as the planner sees it."""

    name: str
    param_bytes: int  # unsharded bytes in the gather dtype
    grad_bytes: int  # unsharded bytes in the reduce dtype
    forward_s: float
    backward_s: float
    gather_wire_bytes: int | None = None
    """Unsharded bytes the all-gather puts on the wire when a codec compresses it (None:
    `param_bytes`). Memory is still counted in `param_bytes`: the decoded buffer."""
    reduce_wire_bytes: int | None = None
    """Likewise for the gradient exchange (None: `grad_bytes`)."""
    gather_codec_s: float = 0.0
    """Encode + decode kernel time of one all-gather, charged to the collective."""
    reduce_codec_s: float = 0.0
    """Encode + decode(-accumulate) kernel time of this unit's share of a reduction."""
    gather_issue_host_s: float = 0.0
    """Seconds the training thread spends issuing this unit's all-gather (casting or encoding
    the shard) before the collective can start. On GPUs this work sits on the comm stream and
    belongs in `gather_codec_s`; on CPU there is no comm stream and it holds up compute."""
    backward_gather_issue_host_s: float | None = None
    """The same for a backward re-gather (None: `gather_issue_host_s`): the runtime resends the
    bytes its forward gather encoded, so with a codec this is cheaper."""
    gather_wait_host_s: float = 0.0
    """Seconds the training thread spends after the all-gather completes, in its wait: decoding
    and copying out into the unsharded buffer (CPU; see [Note: host work] in simulate.py)."""
    reduce_issue_host_s: float = 0.0
    """This unit's share of packing (and encoding) a reduction bucket on the training thread."""
    reduce_wait_host_s: float = 0.0
    """This unit's share of summing (decoding) the received chunks and scaling them, on the
    training thread in the bucket's wait."""
    gather_op: str = "all_gather"
    """The collective that carries the all-gather, and so the link that times it: "all_gather"
    (the backend's own), "all_to_all" where gloo gathers through all-to-all (two ranks, or
    small shards), or "shm" through shared memory (`overlap.step_model.calibration.gather_op`)."""
    reduce_op: str = "reduce_scatter"
    """Likewise for the gradient reduction: "reduce_scatter" (the backend's, timed by the
    reduce link) or "shm" (`overlap.step_model.calibration.reduce_op`)."""

    def gather_s(self, topo: Topology) -> float:
        """Seconds of this unit's all-gather: the ring over its wire bytes plus codec kernels."""
        wire = self.param_bytes if self.gather_wire_bytes is None else self.gather_wire_bytes
        return ring_time_s(self.gather_op, wire, topo) + self.gather_codec_s


def flops_compute(numel: int, tokens: int, tflops: float) -> tuple[float, float]:
    """Forward and backward seconds of a dense unit from its parameter count: 2·N·T FLOPs
    forward, 4·N·T backward, at an achieved `tflops`."""
    fwd = 2.0 * numel * tokens / (tflops * 1e12)
    return fwd, 2.0 * fwd
