"""The transport seam ([Note: the seam] in overlap/transport/strategy.py): an executor and
collective strategies, injected through `Transport.set_custom_all_gather` / `set_executor`.

- a custom all-gather strategy set on a wrapped model gathers every unit (its `allocate` places
  the output) and training stays DDP's bitwise;
- the CUDA executor's ordering logic runs on the CPU with stand-in streams (`CpuStreamExecutor`):
  a whole training run through it is DDP's bitwise, and compute waits on events only;
- the gloo strategies still send a backward all-gather inside the reduction before it ([Note:
  fused exchange] in transport/gloo.py), bitwise as DDP, and the runtime names no mechanism.
"""

from __future__ import annotations

import contextlib
import copy
import pathlib
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from helpers.models import STRICT_ZERO3, batch, encoder_stack, loss_of
from torch.nn.parallel import DistributedDataParallel as DDP

from overlap.transport import collectives as comm
from overlap.transport.strategy import AllGather
from overlap.transport.streams import StreamExecutor

ROOT = pathlib.Path(__file__).resolve().parents[2]


class StandInStream:
    """A CUDA stream stand-in: what is enqueued on it goes into the shared log, in order."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def record_event(self) -> str:
        self.log.append(f"{self.name}: record")
        return f"event@{self.name}#{len(self.log)}"

    def wait_event(self, event: str) -> None:
        self.log.append(f"{self.name}: wait {event}")

    def wait_stream(self, other: StandInStream) -> None:
        self.log.append(f"{self.name}: wait stream {other.name}")


class CpuStreamExecutor(StreamExecutor):
    """The CUDA executor's logic on the CPU: its streams are stand-ins that log what is enqueued
    on them; the collectives are real (a wait blocks, as the stream's would order)."""

    def __init__(self, log: list[str], *args: Any, **kwargs: Any) -> None:
        self.log = log
        self.current = ["compute"]
        super().__init__(*args, **kwargs)

    def make_streams(self) -> None:
        self.gather_stream = StandInStream("gather", self.log)  # type: ignore[assignment]
        self.reduce_stream = StandInStream("reduce", self.log)  # type: ignore[assignment]
        self.compute_stream = StandInStream("compute", self.log)
        if self.replicated:
            self.all_reduce_stream = StandInStream("all_reduce", self.log)  # type: ignore[assignment]

    def compute(self) -> Any:
        return self.compute_stream

    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        self.current.append("compute" if stream is None else stream.name)
        try:
            yield
        finally:
            self.current.pop()

    def wait(self, result: comm.CommResult) -> Any:
        self.log.append(f"{self.current[-1]}: wait collective")
        return comm.wait(result, self.timeout)


def cpu_stream_executor(model: nn.Module, log: list[str]) -> CpuStreamExecutor:
    """A `CpuStreamExecutor` for a wrapped model, set on its transport (between steps)."""
    transport = model._overlap_state.runtime.transport
    old = transport.executor
    executor = CpuStreamExecutor(log, old.rank, old.world_size, old.device, old.timer, old.timeout, old.replicated)
    transport.set_executor(executor)
    return executor


class CountingAllGather(AllGather):
    """The backend's all-gather into a buffer this strategy allocates, counted."""

    def __init__(self) -> None:
        self.allocated: list[int] = []
        self.calls = 0

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.allocated.append(numel)
        return torch.full((numel,), float("nan"), dtype=dtype, device=device)  # every element overwritten

    def __call__(self, *args: Any) -> comm.CommResult:
        self.calls += 1
        return super().__call__(*args)


def _parity(rank: int, steps: int, setup: Any, layers: int = 3, group: Any = None, **config: Any) -> dict:
    """`steps` SGD steps of ours (after `setup(model)`) against DDP: the largest difference of
    the parameters (bitwise expected at two ranks in fp32) and what `setup` returned."""
    import overlap

    torch.manual_seed(0)
    base = encoder_stack(layers=layers, dim=16)
    ref = DDP(copy.deepcopy(base))
    ours = overlap.wrap(base, group=group, collective_timeout_s=60, **config)
    seen = setup(ours)
    pairs = [(model, torch.optim.SGD(model.parameters(), lr=0.1)) for model in (ref, ours)]
    for step in range(steps):
        for model, optimizer in pairs:
            loss_of(model(batch(base, rank, step))).backward()
            optimizer.step()
            optimizer.zero_grad()
    state = overlap.full_state_dict(ours, rank0_only=False)
    diff = max((state[n] - p).abs().max().item() for n, p in ref.module.state_dict().items())
    return {"diff": diff, "seen": seen() if callable(seen) else seen}


def custom_all_gather(rank: int, world: int) -> dict:
    strategy = CountingAllGather()

    def setup(model: nn.Module) -> Any:
        model._overlap_state.runtime.transport.set_custom_all_gather(strategy)
        return lambda: {"calls": strategy.calls, "allocated": len(strategy.allocated)}

    return _parity(rank, 3, setup)


def stream_executor_on_cpu(rank: int, world: int) -> dict:
    log: list[str] = []

    def setup(model: nn.Module) -> Any:
        cpu_stream_executor(model, log)
        return lambda: list(log)

    return _parity(rank, 2, setup)


def fused_exchanges(rank: int, world: int) -> dict:
    calls = {"fused": 0}
    real = comm.reduce_scatter_and_gather

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["fused"] += 1
        return real(*args, **kwargs)

    def setup(model: nn.Module) -> Any:
        comm.reduce_scatter_and_gather = counted
        return lambda: dict(calls)

    try:
        # every unit gathered again for backward; through gloo (not shared memory: one host)
        return _parity(rank, 3, setup, layers=6, shared_memory="off", **STRICT_ZERO3)
    finally:
        comm.reduce_scatter_and_gather = real


def test_custom_all_gather_gathers_every_unit(world2):
    for rank, r in enumerate(world2.run(custom_all_gather, timeout_s=240)):
        assert r["diff"] == 0.0, (rank, r)
        assert r["seen"]["calls"] > 0 and r["seen"]["allocated"] == r["seen"]["calls"], (rank, r)


def test_stream_executor_logic_trains_on_cpu(world2):
    """Every gather's copy-out event is what compute waits on; compute never waits for a whole
    comm stream; results are DDP's bitwise."""
    for rank, r in enumerate(world2.run(stream_executor_on_cpu, timeout_s=240)):
        assert r["diff"] == 0.0, (rank, r["diff"])
        log = r["seen"]
        gathers = [i for i, e in enumerate(log) if e == "gather: wait collective"]
        assert gathers, log[:20]
        for i in gathers:  # the gather stream waits, copy-out follows, then its event
            assert log[i + 1] == "gather: record", log[i : i + 3]
        assert not [e for e in log if e.startswith("compute: wait stream")], log
        waits = [e for e in log if e.startswith("compute: wait event@gather")]
        assert len(waits) == len(gathers), (len(waits), len(gathers))


def test_gloo_strategies_fuse_backward_gathers(world2):
    for rank, r in enumerate(world2.run(fused_exchanges, timeout_s=240)):
        assert r["diff"] == 0.0, (rank, r)
        assert r["seen"]["fused"] > 0, (rank, r)  # small units: the backward gathers rode along


def test_runtime_names_no_transport_mechanism():
    for name in ("runtime.py", "reduction.py"):
        source = (ROOT / "overlap" / "engine" / name).read_text()
        for word in (
            "gloo",
            "all_to_all",
            "_slack",
            "_pair",
            "_fused",
            "fused=",
            "can_fuse",
            "fits_with",
            "unit.gather",
        ):
            assert not re.search(re.escape(word), source), (name, word)
