"""The transport chosen at wrap, and the settings it refuses (overlap/transport/)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from overlap.transport import backend
from overlap.transport.base import honoured_timeout
from overlap.transport.gloo import GlooAllGather, GlooReduceScatter
from overlap.transport.host import HostExecutor
from overlap.transport.strategy import AllGather, ReduceScatter
from overlap.transport.streams import check_settings


@pytest.mark.parametrize("backend_string", ["nccl", "cpu:gloo,cuda:nccl", "undefined", "gloo"])
def test_all_to_all_gathers_refused_on_cuda(backend_string):
    """all_gather_impl="all_to_all" on NCCL turned on gloo's receive slack
    (receive counts above the send counts: a hang). CUDA tensors gather natively; the setting
    raises at wrap, naming it."""
    semantics = backend.semantics_of(backend_string, torch.device("cuda", 0))
    with pytest.raises(ValueError, match="all_gather_impl='all_to_all'"):
        check_settings(semantics, "all_to_all")
    for impl in ("auto", "native"):
        check_settings(semantics, impl)


@pytest.mark.parametrize("backend_string", ["nccl", "cpu:gloo,cuda:nccl", "undefined"])
def test_collective_timeout_on_nccl_warns(backend_string):
    """On a stream-ordered backend the timeout is not passed to the
    training collectives' waits (it would block the CPU); a warning names the setting to use."""
    semantics = backend.semantics_of(backend_string, torch.device("cuda", 0))
    with pytest.warns(
        UserWarning, match=r"collective_timeout_s=30 does not bound .*init_process_group\(timeout=\.\.\.\)"
    ):
        assert honoured_timeout(semantics, timedelta(seconds=30)) is None


def test_collective_timeout_on_gloo_is_honoured(recwarn):
    semantics = backend.semantics_of("gloo", torch.device("cpu"))
    assert honoured_timeout(semantics, timedelta(seconds=30)) == timedelta(seconds=30)
    assert honoured_timeout(backend.semantics_of("nccl", torch.device("cuda")), None) is None
    assert not recwarn.list


def wrap_with_timeout(rank: int, world_size: int, stream_ordered: bool, seconds: float | None) -> list[str]:
    """`wrap` on the CPU with the backend decision faked stream-ordered (as NCCL's is): the
    warnings it gives about the timeout; one training step still runs."""
    import warnings

    from helpers.models import batch, encoder_stack, loss_of

    import overlap

    real = backend.semantics
    backend.semantics = lambda group, device: backend.CommSemantics("cpu", "gloo", stream_ordered)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = overlap.wrap(encoder_stack(), collective_timeout_s=seconds)
    finally:
        backend.semantics = real
    loss_of(model(batch(model, rank, 0))).backward()
    honoured = None if stream_ordered or seconds is None else timedelta(seconds=seconds)
    assert model._overlap_state.runtime.timeout == honoured
    return [str(w.message) for w in caught if "collective_timeout_s" in str(w.message)]


def test_wrap_warns_once_when_the_timeout_is_ignored(world1):
    (warned,) = world1.run(wrap_with_timeout, stream_ordered=True, seconds=30, timeout_s=120)
    assert len(warned) == 1 and "init_process_group(timeout=...)" in warned[0], warned
    assert world1.run(wrap_with_timeout, stream_ordered=True, seconds=None, timeout_s=120) == [[]]
    assert world1.run(wrap_with_timeout, stream_ordered=False, seconds=30, timeout_s=120) == [[]]


def chosen_transport(rank: int, world_size: int, impl: str) -> list[str]:
    """The executor and strategies `wrap` chooses for CPU tensors over gloo."""
    from helpers.models import encoder_stack

    import overlap

    model = overlap.wrap(encoder_stack(), all_gather_impl=impl, shared_memory="off")  # shm: test_shm.py
    transport = model._overlap_state.runtime.transport
    return [type(p).__name__ for p in (transport.executor, transport.all_gather, transport.reduce_scatter)]


@pytest.mark.parametrize("impl", ["auto", "native", "all_to_all"])
def test_cpu_tensors_take_host_waits_and_gloo_strategies(world1, impl):
    (chosen,) = world1.run(chosen_transport, impl=impl, timeout_s=120)
    assert chosen == [HostExecutor.__name__, GlooAllGather.__name__, GlooReduceScatter.__name__]
    assert issubclass(GlooAllGather, AllGather) and issubclass(GlooReduceScatter, ReduceScatter)
