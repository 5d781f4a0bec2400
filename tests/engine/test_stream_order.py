"""What the compute stream waits for, and where the end of backward reads from the device.

On CUDA the compute stream waits on events that comm streams record; an event recorded too late
makes compute wait for work it does not need (a device-to-host copy, a clone, a cast). These
checks run the CUDA executor on the CPU (`CpuStreamExecutor` in test_seam.py), with stand-ins for
streams and events that log the order of everything enqueued ([Note: gather event] in
transport/streams.py):

- a gather's event is recorded right after copy-out, before the tags' copy to the host and hpZ's
  copy; a reduction's input is released on the reduce-scatter's event, not the cast's;
- tensor parallelism's Partial() gradients are summed over tp in one all-reduce per bucket, on the
  reduce stream, with compute waiting for its event ([Note: tensor-parallel parameters]);
- a rank that left a parameter without gradient reads the used counts only after every gradient
  it produced is in `.grad`, from a copy enqueued ahead of the division and cast ([Note: used
  counts] in engine/reduction.py), and keeps DDP's `.grad` None-ness.
"""

from __future__ import annotations

import copy
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers.models import loss_of
from test_seam import CpuStreamExecutor
from torch.nn.parallel import DistributedDataParallel as DDP

from overlap.engine.reduction import PendingReduce, Reductions
from overlap.engine.runtime import Runtime
from overlap.observe.timing import HostTimer
from overlap.transport.host import HostExecutor
from overlap.transport.strategy import GatherResult


class _LoggedCollective:
    """Stands in for a collective's result: waiting on it logs (on the stream it is waited on)."""

    output = "received"


def _executor(log: list[str]) -> CpuStreamExecutor:
    """The CUDA executor on the CPU, its streams logging to `log`; a wait on a collective logs."""
    executor = CpuStreamExecutor(log, 0, 2, torch.device("cpu"), HostTimer(), timedelta(seconds=5), False)
    executor.wait = lambda result: (log.append(f"{executor.current[-1]}: wait collective"), "rows")[1]
    return executor


def test_gather_event_is_recorded_right_after_copy_out():
    """The runtime's work after a gather (`Runtime._finish_gather`), enqueued through the CUDA
    executor: the event compute waits on comes after copy-out and before the tag copy and the
    hpZ clone."""
    log: list[str] = []
    executor = _executor(log)
    runtime = SimpleNamespace(
        units=[SimpleNamespace()],
        transport=SimpleNamespace(executor=executor),
        _alloc_unsharded=lambda unit: None,
        _copy_out=lambda unit, rows: log.append("gather: copy-out"),
        _check_tag=lambda record, rows, received: log.append("gather: tags to host"),
        _keep_secondary=lambda unit, rows, from_secondary: log.append("gather: hpZ clone"),
        _drop_gather=lambda record: log.append("host: drop buffers"),
    )
    record = GatherResult(0, _LoggedCollective(), 7, False, 0)  # type: ignore[arg-type]
    done = Runtime._finish_gather.__get__(runtime)
    with executor.on(executor.gather_stream):
        kept = executor.gather_issued(record, executor.timer.start("collective", "gather", "unit"), done)
    executor.wait_gather(kept, done)
    assert log[:3] == ["gather: wait collective", "gather: copy-out", "gather: record"], log
    event = f"event@gather#{log.index('gather: record') + 1}"
    assert log.index("gather: record") < log.index("gather: tags to host") < log.index("gather: hpZ clone"), log
    assert log[-1] == f"compute: wait {event}", log  # the copy-out event, nothing later
    assert kept.comm is None and kept.event == event  # the record keeps the event, not the buffers


def test_release_waits_for_the_reduce_scatter_not_the_cast():
    """`_finish_shard` divides and casts behind the reduce-scatter: ReleaseReduce (compute may
    reuse the input) keeps the reduce-scatter's event; only the end of backward waits for the
    cast's."""
    log: list[str] = []
    executor = _executor(log)
    executor.after_reduction = lambda fn, after: (fn(), "event after the cast")
    unit = SimpleNamespace(
        grad_locals=[(torch.zeros(()).to(torch.bfloat16), 0, (4,), (1,))], layout=SimpleNamespace(grad_shard_numel=4)
    )
    runtime = SimpleNamespace(units=[unit], transport=SimpleNamespace(executor=executor))
    pending = PendingReduce("reduce-scatter", "event after the reduce-scatter", (True,), 0, averaged=False, post=2.0)
    reduced = torch.full((5,), 4.0)
    out = Reductions._finish_shard(runtime, (0,), pending, reduced)
    assert out.dtype == torch.bfloat16 and out[:4].tolist() == [2.0] * 4 and out[4].item() == 4.0
    assert pending.event == "event after the reduce-scatter", pending.event
    assert pending.ready == "event after the cast", pending.ready
    executor.release_reduce(pending.result, pending.event)
    assert log == ["compute: wait event after the reduce-scatter"], log


def test_partial_gradients_are_summed_on_the_reduce_stream():
    """[Note: tensor-parallel parameters]: the executor's sum of a bucket's Partial() gradients
    runs on the reduce stream, behind compute, and compute waits for its event only."""
    log: list[str] = []
    executor = _executor(log)

    def all_reduce(tensor, group, average=False):
        log.append(f"{executor.current[-1]}: all-reduce {group}")
        return "ar"

    executor.sum_over(torch.ones(3), "tp", all_reduce)
    assert log == [
        "reduce: wait stream compute",
        "reduce: all-reduce tp",
        "reduce: wait collective",
        "reduce: record",
        "compute: wait event@reduce#4",
    ], log


# ------------------------------------------------------------------ used counts, two ranks


class SometimesUnused(nn.Module):
    """Three blocks; the middle one's `gate` is used on rank 0 only, the last one's `spare` by
    no rank: rank 1 leaves two parameters out, rank 0 one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)])
        self.gate = nn.Parameter(torch.full((16,), 1.5))
        self.spare = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x * self.gate if dist.get_rank() == 0 else x


def counts_read_last(rank: int, world: int, config: dict) -> dict:
    """Three steps against DDP (find_unused_parameters=True): `.grad` None-ness and values, and,
    for each read of the used counts: how many gradients this rank produced were still missing
    from `.grad` when it read, and whether the counts' copy was enqueued before the cast."""
    import overlap
    from overlap.engine import reduction
    from overlap.transport.readback import HostRead

    log: list[str] = []
    ours_box: list[nn.Module] = []

    class RecordingRead(HostRead):
        def __init__(self, tensor, stream=None):
            log.append("counts copied")
            super().__init__(tensor, stream)

        def values(self):
            model = ours_box[0]
            missing = [n for n, p in model.named_parameters() if n not in ("gate", "spare") and p.grad is None]
            log.append(f"counts read, {len(missing)} of this rank's gradients missing")
            return super().values()

    base = SometimesUnused()
    ref = DDP(copy.deepcopy(base), find_unused_parameters=True)
    ours = overlap.wrap(base, collective_timeout_s=60, **config)
    ours_box.append(ours)
    transport = ours._overlap_state.runtime.transport

    class LoggingExecutor(HostExecutor):
        def after_reduction(self, fn, after):
            log.append("divided and cast")
            return super().after_reduction(fn, after)

    old = transport.executor
    transport.set_executor(
        LoggingExecutor(old.rank, old.world_size, old.device, old.timer, old.timeout, old.replicated)
    )
    saved = reduction.HostRead
    reduction.HostRead = RecordingRead
    mismatches: list[str] = []
    exact = config.get("reduce_dtype") is None  # two ranks in fp32: DDP's bitwise
    try:
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            loss_of(ref(x)).backward()
            loss_of(ours(x)).backward()
            named = dict(ref.module.named_parameters())
            for name, p in ours.named_parameters():  # the same order and None-ness on every rank
                theirs = named[name].grad
                if (p.grad is None) != (theirs is None):
                    mismatches.append(f"step {step} {name}: None on one side only")
                    continue
                if p.grad is None:
                    continue
                mine = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                same = torch.equal(mine, theirs) if exact else torch.allclose(mine, theirs, rtol=2e-2, atol=1e-3)
                if not same:
                    mismatches.append(f"step {step} {name}: differs by {(mine - theirs).abs().max().item()}")
            ref.zero_grad(set_to_none=True)
            ours.zero_grad(set_to_none=True)
    finally:
        reduction.HostRead = saved
    return {"log": log, "mismatches": mismatches}


@pytest.mark.parametrize(
    "config",
    [{"reduce_scatter_impl": "native"}, {"reduce_scatter_bucket_bytes": 1 << 20, "reduce_dtype": torch.bfloat16}],
    ids=["per_unit_divided", "one_bucket_bf16"],
)
def test_used_counts_read_after_every_own_gradient(world2, config):
    for rank, r in enumerate(world2.run(counts_read_last, config=config, timeout_s=300)):
        assert not r["mismatches"], (rank, r["mismatches"])
        reads = [e for e in r["log"] if e.startswith("counts read")]
        assert len(reads) == 3, (rank, r["log"])  # one bucket a step holds what this rank left out
        assert all(e.endswith(" 0 of this rank's gradients missing") for e in reads), (rank, r["log"])
        log = r["log"]
        copies = [i for i, e in enumerate(log) if e == "counts copied"]
        assert len(copies) == 3 and all(log[i + 1] == "divided and cast" for i in copies), (rank, log)


# ------------------------------------------------------------------ Partial() gradients, dp2 x tp2


def tp_sums(rank: int, world: int, config: dict) -> dict:
    """Two backwards of the sequence-parallel model of test_compose (dp2 x tp2; each block's
    LayerNorm weight and bias have Partial() gradients): the all-reduces over tp each backward
    issues, and the gradients against FSDP2's on the same batches."""
    import torch.distributed._functional_collectives as funcol
    from test_compose import _backward, _dp, _fsdp2, _mesh, _tp_model

    import overlap

    mesh = _mesh()
    tp_group = mesh["tp"].get_group()
    ours = overlap.wrap(_tp_model(mesh, sequence_parallel=True), group=_dp(mesh), **config)
    ref = _fsdp2(mesh, sequence_parallel=True)
    calls: list[str] = []
    real_dist, real_funcol = dist.all_reduce, funcol.all_reduce

    def counted_dist(tensor, *args, group=None, **kwargs):
        if group is tp_group:
            calls.append("all_reduce")
        return real_dist(tensor, *args, group=group, **kwargs)

    def counted_funcol(tensor, *args, **kwargs):
        calls.append("funcol.all_reduce")
        return real_funcol(tensor, *args, **kwargs)

    per_step, differences = [], []
    for step in range(2):
        dist.all_reduce, funcol.all_reduce = counted_dist, counted_funcol
        try:
            _backward(ours, mesh, step, True)
        finally:
            dist.all_reduce, funcol.all_reduce = real_dist, real_funcol
        per_step.append(list(calls))
        calls.clear()
        _backward(ref, mesh, step, True)
        theirs = dict(ref.named_parameters())
        for name, p in ours.named_parameters():
            if not torch.equal(p.grad.to_local(), theirs[name].grad.to_local()):
                differences.append(f"step {step} {name}")
        ours.zero_grad()
        ref.zero_grad()
    return {"calls": per_step, "differences": differences}


@pytest.mark.parametrize(
    "config,num_buckets", [({}, 3), ({"reduce_scatter_bucket_bytes": 1 << 20}, 1)], ids=["per_unit", "one_bucket"]
)
def test_partial_gradients_one_all_reduce_per_bucket(world4, config, num_buckets):
    """Each bucket holding Partial() gradients sums them in one all-reduce over tp (through the
    transport), not one redistribute per parameter; the gradients stay FSDP2's bitwise (two tp ranks)."""
    for rank, r in enumerate(world4.run(tp_sums, config=config, timeout_s=300)):
        assert not r["differences"], (rank, r["differences"])
        # three blocks of two Partial() gradients (the norm's): a redistribute each made six
        assert r["calls"] == [["all_reduce"] * num_buckets] * 2, (rank, r["calls"])
