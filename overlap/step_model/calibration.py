"""The measured costs the simulator runs on (`Calibration`): their files, defaults, and the
calibrated model of a measured world. The arithmetic that turns measurements into them is
fitting.py's (re-exported here).

[Note: one model]
`overlap plan`, `overlap tune`'s pruning and benchmarks/plan_validate.py predict a step the same
way: units (`UnitCost`) built with `Calibration.unit`, replayed by `Calibration.predict` on the
simulator's fluid clock with the calibration's links, contention and host work ([Note: fluid
clock], [Note: host work] in simulate.py). What differs between them is only where compute comes
from: FLOPs at an achieved rate (plan), the plain model's profile (tune), or the per-layer
profile a calibration measured (plan_validate, `predict_measured`). A calibration comes from
    measurement    `overlap plan --calibrate FILE` (overlap/tools/plan/calibrate.py): this
                   machine's collectives, compute, host work and contention, in a local world
    a trace        `from_trace` (overlap/tools/plan/trace_links.py): links fitted to the
                   collectives' spans of a run's first steps
    defaults       `default_calibration`: link presets, no contention, no host work on GPUs;
                   on gloo the terms measured once on a 2-core machine (`GLOO_DEFAULT_*`)
and is saved as JSON (`save`, `load`), so the three tools read the same file.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from overlap.compression import make_grad_codec, make_param_codec
from overlap.config import OverlapConfig
from overlap.engine.units import group_units
from overlap.step_model.carriers import (  # noqa: F401  re-exported: importable from here as before
    NO_CODEC,
    codec_path,
    gather_op,
    grads_compressed,
    params_compressed,
    reduce_op,
    shm_carries,
)
from overlap.step_model.cost import LINKS, SHARED_MEMORY, Link, Topology, UnitCost
from overlap.step_model.simulate import Contention, Prediction, simulate

Backend = Literal["gloo", "nccl"]
Level = Literal["intra", "inter"]

# ---------------------------------------------------------------------------------------------
# what a calibration holds


@dataclass(frozen=True, kw_only=True)
class HostCosts:
    """Training-thread seconds around one unit's collectives, measured on a unit of
    `unit_bytes` unsharded parameter bytes; a unit of other size costs in proportion (the work
    is copies and codec passes over its bytes). See [Note: host work] in simulate.py."""

    unit_bytes: int
    gather_issue_s: float
    """Issuing the forward all-gather: copy-in (and encoding) of the shard."""
    regather_issue_s: float
    """A backward re-gather's issue: it resends the forward's encoded bytes."""
    gather_wait_s: float
    """After the all-gather completes: copy-out (and decoding) into the unsharded buffer."""
    reduce_issue_s: float
    """Packing (and encoding) the unit's gradients for the reduction."""
    reduce_wait_s: float
    """Summing (and decoding) the received chunks and scaling them."""

    def __post_init__(self) -> None:
        if self.unit_bytes <= 0:
            raise ValueError(f"HostCosts.unit_bytes must be > 0, got {self.unit_bytes}")

    def scaled(self, k: float) -> HostCosts:
        """Every cost times `k` (benchmarks/plan_repredict.py's `--fit-host`)."""
        return HostCosts(
            unit_bytes=self.unit_bytes, gather_issue_s=k * self.gather_issue_s, regather_issue_s=k * self.regather_issue_s,
            gather_wait_s=k * self.gather_wait_s, reduce_issue_s=k * self.reduce_issue_s, reduce_wait_s=k * self.reduce_wait_s,
        )  # fmt: skip

    def for_unit(self, param_bytes: int) -> dict[str, float]:
        """`UnitCost`'s host fields for a unit of `param_bytes`."""
        k = param_bytes / self.unit_bytes
        return {
            "gather_issue_host_s": k * self.gather_issue_s,
            "backward_gather_issue_host_s": k * self.regather_issue_s,
            "gather_wait_host_s": k * self.gather_wait_s,
            "reduce_issue_host_s": k * self.reduce_issue_s,
            "reduce_wait_host_s": k * self.reduce_wait_s,
        }


@dataclass(frozen=True, kw_only=True)
class ComputeCosts:
    """Per-unit compute of the model a calibration measured (W1 for `overlap plan --calibrate`):
    all ranks computing at once, the slowest rank's median (ranks meet in every collective)."""

    unit_numel: int
    """Parameters of one unit (a W1 layer); every unit has as many."""
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    optimizer_s: float
    """The optimizer step on this rank's shards."""
    tokens: int = 0
    """Tokens per rank per step: with `unit_numel`, the achieved rate (`achieved_tflops`)."""
    hook_forward_s: float = 0.0
    """What the wrapper's own verbs add to each unit's forward ([Note: hook cost] in
    overlap/tools/plan/hooks.py)."""
    hook_backward_s: float = 0.0
    """The same for each unit's backward."""

    def achieved_tflops(self) -> float | None:
        """Dense-layer FLOPs (2·N·T forward, 4·N·T backward) over the measured seconds."""
        seconds = sum(self.forward_s) + sum(self.backward_s)
        if not self.tokens or seconds <= 0:
            return None
        return 6.0 * self.unit_numel * len(self.forward_s) * self.tokens / seconds / 1e12


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Everything the simulator's step depends on besides the model and the config.

    Links are per collective and per level: the shard group's all-gathers (`gather_link`), its
    gradient exchange (`reduce_link`; gloo reduce-scatters through all-to-all, which sustains a
    busbw of its own) and, under HSDP, the replicas' all-reduce (`replica_link`). Contention and
    host work are the fluid clock's terms ([Note: fluid clock] in simulate.py)."""

    source: str
    """Where the numbers come from (measured where and when, a trace, or presets)."""
    backend: Backend
    """gloo: two lanes per process group, host work on the training thread; nccl: one lane."""
    num_ranks: int
    """Ranks of one shard group in the calibrated world."""
    num_replicas: int = 1
    """HSDP replicas of the calibrated world (1: plain sharding)."""
    shared_memory: bool = False
    """The shard group's ranks share a host and exchange through shared memory
    (`OverlapConfig.shared_memory`): its uncompressed all-gathers and reductions are host work,
    no wire ([Note: shared-memory collectives] in cost.py); codecs' exchanges stay on gloo. A
    replica group on one host likewise: `replica_link` is then `SHARED_MEMORY`."""
    level: Level = "intra"
    """The link level the measurements crossed: "intra" (one host, loopback; NVLink) or "inter"
    (between hosts; an emulated link). `overlap plan` puts the links on that level."""
    gather_link: Link
    reduce_link: Link | None = None
    """None: `gather_link`."""
    replica_link: Link | None = None
    """None: `gather_link`."""
    compute_share_lost: float = 0.0
    """Share of its speed compute loses while a collective is in flight (`contention_share`)."""
    comm_stretch: float = 1.0
    """A collective's time beside compute / alone."""
    concurrent_throughput: float | None = None
    """Throughput of the collectives in flight, in solo speeds (`concurrent_throughput`); None:
    independent lanes."""
    host: Mapping[str, HostCosts] = field(default_factory=dict)
    """Host work per codec path (`codec_path`); empty: none charged (GPUs: comm-stream kernels)."""
    compute: ComputeCosts | None = None
    """The calibrated model's compute (None: calibrated from collectives only)."""
    measured: Mapping[str, Any] = field(default_factory=dict)
    """The raw numbers behind the fits, for the record (link rows, contention and concurrency ms)."""

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"Calibration.backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.level not in ("intra", "inter"):
            raise ValueError(f"Calibration.level must be 'intra' or 'inter', got {self.level!r}")
        if self.num_ranks < 1 or self.num_replicas < 1:
            raise ValueError(
                f"Calibration: num_ranks and num_replicas must be >= 1, got {self.num_ranks}, {self.num_replicas}"
            )
        self.contention()  # validates the contention terms

    # ------------------------------------------------------------------ the simulator's inputs
    def contention(self) -> Contention:
        return Contention(
            compute_share_lost=self.compute_share_lost,
            comm_stretch=self.comm_stretch,
            concurrent_throughput=self.concurrent_throughput,
        )

    def topology(self, num_ranks: int | None = None, num_replicas: int | None = None) -> Topology:
        """One level: the calibrated world, or `num_ranks` per shard group (and `num_replicas`)
        over the same links."""
        n = self.num_ranks if num_ranks is None else num_ranks
        return Topology(
            n, n, self.gather_link, self.gather_link, reduce_link=self.reduce_link,
            num_replicas=self.num_replicas if num_replicas is None else num_replicas,
            replica_link=self.replica_link,
        )  # fmt: skip

    def host_costs(self, codec: str) -> HostCosts | None:
        """Host work for this codec path; a codec not measured gets the uncompressed path's."""
        return self.host.get(codec, self.host.get(NO_CODEC))

    def unit(
        self,
        name: str,
        param_bytes: int,
        grad_bytes: int,
        forward_s: float,
        backward_s: float,
        *,
        codec: str = NO_CODEC,
        gather_wire_bytes: int | None = None,
        reduce_wire_bytes: int | None = None,
        gather_codec_s: float = 0.0,
        reduce_codec_s: float = 0.0,
        num_ranks: int | None = None,
    ) -> UnitCost:
        """One unit for the simulator, with this calibration's host work for its bytes and the
        collective its all-gather goes through in a shard group of `num_ranks` (default: the
        calibrated one's)."""
        host = self.host_costs(codec)
        wire = param_bytes if gather_wire_bytes is None else gather_wire_bytes
        op = gather_op(self.backend, num_ranks or self.num_ranks, params_compressed(codec), wire, self.shared_memory)
        grad_wire = grad_bytes if reduce_wire_bytes is None else reduce_wire_bytes
        return UnitCost(
            name, param_bytes, grad_bytes, forward_s, backward_s,
            gather_wire_bytes=gather_wire_bytes, reduce_wire_bytes=reduce_wire_bytes,
            gather_codec_s=gather_codec_s, reduce_codec_s=reduce_codec_s, gather_op=op,
            reduce_op=reduce_op(self.backend, grads_compressed(codec), grad_wire, self.shared_memory),
            **(host.for_unit(param_bytes) if host is not None else {}),
        )  # fmt: skip

    def predict(
        self,
        units: list[UnitCost],
        config: OverlapConfig,
        *,
        topology: Topology | None = None,
        root: int | None = None,
        optimizer_s: float = 0.0,
        record: bool = False,
    ) -> Prediction:
        """The simulator's steady step ([Note: one model]): this calibration's lanes, links
        (or `topology`'s), contention and the units' host work."""
        return simulate(
            units, config, topology or self.topology(), backend=self.backend, root=root,
            optimizer_s=optimizer_s, record=record, contention=self.contention(),
        )  # fmt: skip

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict[str, Any]:
        return {"version": 1, **asdict(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Calibration:
        data = dict(data)
        data.pop("version", None)

        def link(value: Any) -> Link | None:
            return None if value is None else Link(**value)

        compute = data.get("compute")
        return cls(
            **{k: v for k, v in data.items() if k not in ("gather_link", "reduce_link", "replica_link", "host", "compute")},
            gather_link=Link(**data["gather_link"]),
            reduce_link=link(data.get("reduce_link")),
            replica_link=link(data.get("replica_link")),
            host={k: HostCosts(**v) for k, v in data.get("host", {}).items()},
            compute=None if compute is None else ComputeCosts(**{
                **compute, "forward_s": tuple(compute["forward_s"]), "backward_s": tuple(compute["backward_s"])}),
        )  # fmt: skip

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"calibration {path}: no such file (write one with `overlap plan --calibrate {path}`)")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"calibration {path}: not a calibration file ({e})") from None


# ---------------------------------------------------------------------------------------------
# defaults (no measurement)


GLOO_DEFAULT_HOST = HostCosts(
    unit_bytes=12_609_536, gather_issue_s=0.30e-3, regather_issue_s=0.26e-3, gather_wait_s=2.45e-3,
    reduce_issue_s=2.92e-3, reduce_wait_s=2.19e-3,
)  # fmt: skip
"""Host work of a gloo world nobody calibrated: one W1 layer's (12 MiB fp32), the median
calibration of `benchmarks/plan_validate.py --worlds loopback` on the 2-core development machine
(2026-12-03, 3 rounds, load average 1.2 at the start, 2.4 at the end). Calibrate your machine."""
SHM_DEFAULT_HOST = HostCosts(
    unit_bytes=12_609_536, gather_issue_s=0.72e-3, regather_issue_s=0.73e-3, gather_wait_s=2.45e-3,
    reduce_issue_s=1.98e-3, reduce_wait_s=1.73e-3,
)  # fmt: skip
"""The same for ranks exchanging through shared memory, where the waits hold the pulls (the
peers' copies, the sum): `overlap plan --calibrate --calibrate-rounds 3` on loopback 2 ranks, the
median of 3 rounds (2-core AMD EPYC, 2026-12-07, load average 0.5 at the start, 2.2 at the end)."""
GLOO_DEFAULT_CONTENTION: Mapping[str, float] = {
    "compute_share_lost": 0.43,
    "comm_stretch": 1.74,
    "concurrent_throughput": 1.18,
}
"""The fluid clock's terms for an uncalibrated gloo world, from the same run (ranges over its
rounds: 0.41-0.52, 1.74-2.17x, 1.0-1.37x). They move with the machine's load: runs under load 6-10
measured 0.00-0.76, 1.2-2.5x and 1.0-2.0x."""


def default_calibration(backend: Backend, num_ranks: int, link: Link, *, num_replicas: int = 1,
                        level: Level = "intra", shared_memory: bool = False) -> Calibration:  # fmt: skip
    """What the tools assume without a calibration file: `link` for every collective; on
    nccl no contention and no host work (the comm streams hold it), on gloo
    `GLOO_DEFAULT_CONTENTION` and `GLOO_DEFAULT_HOST`; with `shared_memory` (ranks of one host,
    replicas too) `SHM_DEFAULT_HOST`, the link and contention left to the codecs' exchanges."""
    if backend == "nccl":
        return Calibration(source=f"defaults: {link.name}, no contention", backend="nccl",
                           num_ranks=num_ranks, num_replicas=num_replicas, level=level, gather_link=link)  # fmt: skip
    g = GLOO_DEFAULT_CONTENTION
    host = "SHM_DEFAULT_HOST (shared memory)" if shared_memory else "GLOO_DEFAULT_HOST"
    return Calibration(
        source=f"defaults: {link.name}, gloo terms of GLOO_DEFAULT_CONTENTION and {host}", backend="gloo",
        num_ranks=num_ranks, num_replicas=num_replicas, level=level, gather_link=link, shared_memory=shared_memory,
        replica_link=SHARED_MEMORY if shared_memory and num_replicas > 1 else None,
        compute_share_lost=g["compute_share_lost"], comm_stretch=g["comm_stretch"],
        concurrent_throughput=g["concurrent_throughput"],
        host={NO_CODEC: SHM_DEFAULT_HOST if shared_memory else GLOO_DEFAULT_HOST},
    )  # fmt: skip


EMULATED_LINK_ALPHA_S = 200e-6
"""Per-step latency of a ring step over the emulated veth link (as cost.py's "1gbit" preset)."""
EMULATED_LINK_EFFICIENCY = 0.94
"""busbw / line rate measured for all_reduce on the emulated link (benchmarks/RESULTS.md)."""


class EmulatedLink(Protocol):
    """An emulated link as the world that runs over it describes it (the `--link` text parsed:
    overlap.tools.worlds.link.LinkSpec)."""

    @property
    def rate_gbps(self) -> float:
        """Line rate in GB/s."""
        ...

    @property
    def delay_us(self) -> float:
        """One-way latency added to every packet."""
        ...


def emulated_link(spec: EmulatedLink) -> Link:
    """The link the step model times an emulated link by: its line rate at the measured
    efficiency, its added latency on top of the veth's."""
    return Link(
        f"emulated:{spec}", EMULATED_LINK_ALPHA_S + spec.delay_us * 1e-6, spec.rate_gbps * EMULATED_LINK_EFFICIENCY,
        "the --link emulation (tc tbf) at its line rate",
    )  # fmt: skip


def default_world_calibration(num_ranks: int, backend: str, link: EmulatedLink | None = None, *, num_replicas: int = 1,
                              ranks_per_node: int | None = None, shared_memory: bool = False) -> Calibration:  # fmt: skip
    """`default_calibration` for a world of `num_ranks` shard ranks: the emulated `link`'s line
    rate when there is one (`emulated_link`), gloo loopback for other gloo worlds (through
    shared memory where `shared_memory`: the runtime's transport says, `through_shared_memory`),
    NVLink within a node and NDR InfiniBand across nodes for NCCL."""
    if link is not None:
        kind: Backend = "nccl" if "nccl" in backend else "gloo"
        return default_calibration(kind, num_ranks, emulated_link(link), num_replicas=num_replicas, level="inter")
    if "nccl" not in backend:
        return default_calibration(
            "gloo", num_ranks, LINKS["gloo-loopback"], num_replicas=num_replicas, shared_memory=shared_memory
        )
    per_node = ranks_per_node or num_ranks
    inter = num_ranks * num_replicas > per_node
    return default_calibration("nccl", num_ranks, LINKS["ndr400" if inter else "nvlink4"],
                               num_replicas=num_replicas, level="inter" if inter else "intra")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# combining calibrations


def median_calibration(cals: Sequence[Calibration]) -> Calibration:
    """Calibrations of several rounds combined: the median of every measured number (element
    by element for sequences, field by field for links, host and compute costs)."""
    if not cals:
        raise ValueError("median_calibration: no calibrations")

    def median(values: list[Any]) -> Any:
        first = values[0]
        if first is None or isinstance(first, (bool, int, str)):
            return first
        if isinstance(first, float):
            return statistics.median(values)
        if isinstance(first, (list, tuple)):
            return type(first)(median(list(column)) for column in zip(*values, strict=True))
        if isinstance(first, Mapping):
            return {k: median([v[k] for v in values]) for k in first}
        if isinstance(first, Link):
            return Link(f"{first.name} (median of {len(values)})", median([v.alpha_s for v in values]),
                        median([v.busbw_gbps for v in values]), first.source)  # fmt: skip
        if isinstance(first, (HostCosts, ComputeCosts)):
            return type(first)(**{f.name: median([getattr(v, f.name) for v in values]) for f in fields(first)})
        raise TypeError(f"median_calibration: cannot combine {type(first).__name__}")

    out = {f.name: median([getattr(c, f.name) for c in cals]) for f in fields(Calibration) if f.name != "measured"}
    out["source"] = f"{cals[0].source} (median of {len(cals)})" if len(cals) > 1 else cals[0].source
    return Calibration(**out, measured=cals[0].measured)


# ---------------------------------------------------------------------------------------------
# the calibrated model itself


def measured_units(cal: Calibration, config: OverlapConfig) -> list[UnitCost]:
    """The simulator's units for the model `cal.compute` measured, under `config` (fp32;
    layers merged as overlap.wrap merges them), with its compute, the codecs' wire bytes and
    the calibration's host work."""
    if cal.compute is None:
        raise ValueError(f"measured_units: the calibration ({cal.source}) holds no compute profile")
    c = cal.compute
    names = [str(i) for i in range(len(c.forward_s))]
    groups = group_units(names, dict.fromkeys(names, c.unit_numel), config.min_unit_numel)
    param_codec = make_param_codec(config.param_compression, block_size=config.compression_block_size)
    grad_codec = make_grad_codec(config.grad_compression, block_size=config.compression_block_size)
    codec = codec_path(config.param_compression, config.grad_compression)
    units = []
    for group in groups:
        layers = [int(i) for i in group]
        numel = len(layers) * c.unit_numel
        units.append(cal.unit(
            f"layers.{group[0]}" if len(group) == 1 else f"layers.{group[0]}-{group[-1]}",
            numel * 4, numel * 4,
            sum(c.forward_s[i] for i in layers) + c.hook_forward_s,  # hooks: once per unit
            sum(c.backward_s[i] for i in layers) + c.hook_backward_s,
            codec=codec,
            gather_wire_bytes=param_codec.wire_bytes(numel, torch.float32),
            reduce_wire_bytes=grad_codec.wire_bytes(numel, torch.float32),
        ))  # fmt: skip
    return units


def predict_measured(cal: Calibration, config: OverlapConfig, *, record: bool = False) -> Prediction:
    """The calibrated model's steady step under `config` (benchmarks/plan_validate.py compares
    it with the measured step)."""
    assert cal.compute is not None, "predict_measured: the calibration holds no compute profile"
    return cal.predict(measured_units(cal, config), config, optimizer_s=cal.compute.optimizer_s, record=record)


def with_compute(cal: Calibration, forward_s: Sequence[float], backward_s: Sequence[float]) -> Calibration:
    """`cal` with its per-layer forward and backward seconds replaced (a profile taken beside
    the steps it predicts)."""
    assert cal.compute is not None, "with_compute: the calibration holds no compute profile"
    return replace(cal, compute=replace(cal.compute, forward_s=tuple(forward_s), backward_s=tuple(backward_s)))


def with_links(cal: Calibration, link: Link) -> Calibration:
    """`cal` with every collective on `link` (the uncalibrated tools' view of the links)."""
    return replace(cal, gather_link=link, reduce_link=None, replica_link=None)


# the measured terms' arithmetic lives in fitting.py; importable from here as before
from overlap.step_model.fitting import (  # noqa: F401
    RING_FACTOR,
    SOLVE_BISECTIONS,
    concurrent_throughput,
    contention_share,
    fit_link,
    fluid_queue_s,
    solve_increasing,
)
