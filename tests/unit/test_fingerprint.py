"""The deferred tag check of CUDA all-gathers, on CPU tensors ([Note: deferred tag check]).

The CUDA branch of `FingerprintCheck` (`defer`, `check_pending`) is plain host logic around one
copy and one event per stream: here the copy lands in ordinary host memory and the events are
fakes whose completion the test decides, so the order of reads, the reuse of the slabs and the
"not complete yet: next step" rule run without a GPU. Ranks that diverge are tested end to end
in test_divergence.py.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from overlap.transport import fingerprint
from overlap.transport.fingerprint import (
    TAG_BYTES,
    TAG_NUMEL,
    CollectiveMismatchError,
    FingerprintCheck,
    Tag,
    byte_tags,
    row_tags,
)

WORLD = 4


class _FakeStream:
    pass


class _FakeEvent:
    """A CUDA event whose completion the test sets; counts its waits."""

    complete = True
    made: ClassVar[list[_FakeEvent]] = []

    def __init__(self) -> None:
        self.stream = None
        self.waited = False
        _FakeEvent.made.append(self)

    def record(self, stream: _FakeStream) -> None:
        self.stream = stream

    def query(self) -> bool:
        return _FakeEvent.complete

    def synchronize(self) -> None:
        self.waited = True


@pytest.fixture
def fake_cuda(monkeypatch):
    """Copies 'on a stream': the check records an event on it, and the test completes it."""
    stream = _FakeStream()
    monkeypatch.setattr(fingerprint, "_current_stream", lambda device: stream)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    _FakeEvent.complete = True
    _FakeEvent.made = []
    return stream


def _tag(step: int, unit: int) -> int:
    return Tag(step, 0, unit, 0x1234).pack()


def _trailers(values: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What copy-out leaves in a unit's tag destination: one TAG_NUMEL trailer per rank."""
    out = torch.zeros(len(values) * TAG_NUMEL, dtype=dtype)
    rows = out.view(torch.uint8).view(len(values), -1)
    rows[:, :8].copy_(torch.tensor(values, dtype=torch.int64).view(torch.uint8).view(len(values), 8))
    return out


def _encoded(values: list[int], row_bytes: int = 40) -> torch.Tensor:
    """A compressed all-gather's output: each rank's byte row ends in its tag."""
    out = torch.randint(0, 255, (len(values), row_bytes), dtype=torch.uint8)
    out[:, -TAG_BYTES:] = torch.tensor(values, dtype=torch.int64).view(torch.uint8).view(len(values), 8)
    return out.view(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_tags_reads_the_bits(dtype):
    # a tag whose bits look like a NaN in the element dtype comes back unchanged
    values = [_tag(1, 2), -1, 0x7FC0_7FC0_7FC0_7FC0, _tag(3, 4)]
    assert row_tags(_trailers(values, dtype).view(torch.uint8), WORLD) == values


def test_matching_tags_raise_nothing_and_slabs_are_reused(fake_cuda):
    check = FingerprintCheck(0, torch.device("cpu"))
    mine = _tag(1, 0)
    for step in range(6):
        for unit in range(3):
            check.defer(_trailers([mine] * WORLD), WORLD, mine, f"all-gather of unit {unit}")
        check.check_pending()
        assert check.num_unread == 3 * min(step + 1, fingerprint.REPORT_AFTER_CHECKS)  # read two checks late
    # a slab per step in flight, handed back and taken again
    assert len(check._free) == 1 and len(check._batches) == fingerprint.REPORT_AFTER_CHECKS
    assert len(_FakeEvent.made) == 6 and not any(e.waited for e in _FakeEvent.made)
    assert check.blocking_waits == 0


def test_mismatch_reported_two_checks_later_without_a_wait(fake_cuda):
    """Every rank reports at the same check, whatever its device's pace (a rank raising a step
    before the others would leave them in the next collective)."""
    check = FingerprintCheck(1, torch.device("cpu"))
    mine, other = _tag(5, 2), _tag(5, 3)
    check.defer(_trailers([mine, other, mine, mine]), WORLD, mine, "all-gather of unit 2")
    _FakeEvent.complete = False  # the device has not reached the copy yet
    check.check_pending()  # closes the step: nothing to read yet, nothing waited for
    assert check.num_unread == 1
    _FakeEvent.complete = True  # done now, but not yet its check: not read
    check.check_pending()
    assert check.num_unread == 1
    with pytest.raises(CollectiveMismatchError) as info:
        check.check_pending()
    message = str(info.value)
    assert message.startswith("overlap: rank 1: the ranks' collectives diverged at the all-gather of unit 2")
    assert "rank 1: step 5 forward of unit 3" in message
    assert not any(e.waited for e in _FakeEvent.made)
    assert check.num_unread == 0


def test_wait_reads_everything_now(fake_cuda):
    """The final checks: what this step copied is read at once, at one wait per stream."""
    check = FingerprintCheck(0, torch.device("cpu"))
    mine = _tag(7, 0)
    check.defer(_trailers([mine] * WORLD), WORLD, mine, "all-gather of unit 0")
    check.check_pending()
    _FakeEvent.complete = False
    check.defer(byte_tags(_encoded([mine, mine, _tag(6, 0), mine]), WORLD), WORLD, mine, "all-gather of unit 1")
    with pytest.raises(CollectiveMismatchError, match="unit 1") as info:
        check.check_pending(wait=True)
    assert "rank 2: step 6 forward of unit 0" in str(info.value)
    # both batches read now (the first was not due before its check), one wait each: the fake
    # device reports neither copy done
    assert [e.waited for e in _FakeEvent.made] == [True, True]
    assert check.num_unread == 0


def test_a_device_two_steps_behind_is_waited_for_at_the_check(fake_cuda):
    check = FingerprintCheck(0, torch.device("cpu"))
    mine = _tag(1, 0)
    _FakeEvent.complete = False
    for _ in range(fingerprint.REPORT_AFTER_CHECKS + 1):
        check.defer(_trailers([mine] * WORLD), WORLD, mine, "all-gather of unit 0")
        check.check_pending()
    assert [e.waited for e in _FakeEvent.made] == [True] + [False] * fingerprint.REPORT_AFTER_CHECKS
    assert check.blocking_waits == 1 and check.num_unread == fingerprint.REPORT_AFTER_CHECKS


def test_host_tensors_are_complete_at_once():
    """No stream, no event: a check of host tensors is read at the next check_pending."""
    check = FingerprintCheck(0, torch.device("cpu"))
    mine = _tag(2, 1)
    check.defer(_trailers([mine, mine + 1, mine, mine]), WORLD, mine, "all-gather of unit 1")
    with pytest.raises(CollectiveMismatchError):
        check.check_pending()


def test_pieces_larger_than_a_slab():
    check = FingerprintCheck(0, torch.device("cpu"))
    mine = _tag(3, 0)
    world = fingerprint.SLAB_BYTES // (TAG_NUMEL * 4) + 3  # more trailer bytes than one slab
    check.defer(_trailers([mine] * world), world, mine, "all-gather of unit 0")
    check.defer(_trailers([mine] * WORLD), WORLD, mine, "all-gather of unit 1")
    check.check_pending()
    assert check.num_unread == 0


class _CountOps(TorchDispatchMode):
    VIEWS: ClassVar[set[str]] = {"view", "slice", "select", "alias", "_unsafe_view", "as_strided", "detach", "expand"}

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    @property
    def kernels(self) -> list[str]:
        return [op for op in self.ops if op not in self.VIEWS]


@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "compressed"])
def test_one_copy_per_gather_and_no_op_per_step(compressed):
    """The device comparison dispatched 11 ops per gather (clone x2, ne,
    any, _to_copy, add_, where, copy_, full_like, where, copy_); the deferred check one copy
    (on CUDA a compressed gather's strided tag rows add one contiguous copy inside it), and
    `check_pending` none."""
    check = FingerprintCheck(0, torch.device("cpu"))
    mine = _tag(1, 0)
    tags = byte_tags(_encoded([mine] * WORLD), WORLD) if compressed else _trailers([mine] * WORLD)
    check.defer(tags, WORLD, mine, "warm-up")
    check.check_pending()
    with _CountOps() as per_gather:
        check.defer(tags, WORLD, mine, "all-gather")
    with _CountOps() as per_step:
        check.check_pending()
    assert per_gather.kernels == ["copy_"], per_gather.ops
    assert per_step.ops == []


def test_host_check_still_raises_at_once():
    """The CPU transport's fallback compares a gathered buffer's tags on the host, at once."""
    check = FingerprintCheck(0, torch.device("cpu"))
    mine = _tag(1, 0)
    shard = torch.zeros(WORLD, 32)
    shard[:, -TAG_NUMEL:] = _trailers([mine, mine, mine, _tag(1, 1)]).view(WORLD, TAG_NUMEL)
    with pytest.raises(CollectiveMismatchError, match="rank 3: step 1 forward of unit 1"):
        check.check(shard.view(-1), WORLD, mine, "all-gather of unit 0")


def test_events_recorded_on_the_streams_that_copied(monkeypatch, fake_cuda):
    """The event that says a copy is done is recorded on the stream the
    copy ran on (the gather stream of the tags' device), not on the current device's stream.
    Copies from two streams: one event on each, both complete before the batch is read."""
    other = _FakeStream()
    check = FingerprintCheck(0, torch.device("cpu"))
    mine = _tag(1, 0)
    check.defer(_trailers([mine] * WORLD), WORLD, mine, "all-gather of unit 0")
    monkeypatch.setattr(fingerprint, "_current_stream", lambda device: other)
    check.defer(_trailers([mine] * WORLD), WORLD, mine, "all-gather of unit 1")
    check.defer(_trailers([mine] * WORLD), WORLD, mine, "all-gather of unit 2")
    check.check_pending()
    assert [e.stream for e in _FakeEvent.made] == [fake_cuda, other]
    for _ in range(fingerprint.REPORT_AFTER_CHECKS):
        assert check.num_unread == 3
        check.check_pending()
    assert check.num_unread == 0
