"""The transport chosen at wrap, and the settings it refuses (overlap/transport/)."""

from __future__ import annotations

import pytest
import torch

from overlap.transport import HostTransport, StreamTransport, backend, transport_class


@pytest.mark.parametrize(
    "device,kind",
    [("cpu", HostTransport), ("cuda", StreamTransport), ("cuda:1", StreamTransport)],
)
def test_transport_chosen_by_device(device, kind):
    assert transport_class(torch.device(device)) is kind


@pytest.mark.parametrize("backend_string", ["nccl", "cpu:gloo,cuda:nccl", "undefined", "gloo"])
def test_all_to_all_gathers_refused_on_cuda(backend_string):
    """Review 2, finding 5: all_gather_impl="all_to_all" on NCCL turned on gloo's receive slack
    (receive counts above the send counts: a hang). CUDA tensors gather natively; the setting
    raises at wrap, naming it."""
    semantics = backend.semantics_of(backend_string, torch.device("cuda", 0))
    with pytest.raises(ValueError, match="all_gather_impl='all_to_all'"):
        StreamTransport.check_settings(semantics, "all_to_all")
    for impl in ("auto", "native"):
        StreamTransport.check_settings(semantics, impl)


@pytest.mark.parametrize("impl", ["auto", "native", "all_to_all"])
def test_host_transport_takes_every_gather_impl(impl):
    HostTransport.check_settings(backend.semantics_of("gloo", torch.device("cpu")), impl)
