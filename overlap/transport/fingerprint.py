"""What every all-gather carries besides the shards: who sent it, in which step, phase and unit.

[Note: collective fingerprints]
The order of collectives is checked across ranks on the first step only (CheckOrder, a
collective of its own). Later a rank that runs something else — the classic is evaluating on
rank 0 only (`if rank == 0: evaluate()`) while the others train, or a data-dependent branch that
skips a unit on one rank — would pair its all-gathers with the others' wrong ones: same sizes,
wrong data, or a hang. So every uncompressed all-gather carries, behind each rank's shard,
`TAG_NUMEL` elements whose first 8 bytes are this rank's tag: the step (mod 2^16), the phase
(forward with grad, forward without grad, backward), the unit and a signature of the unit's
trainable parameters (mod 2^24), packed into one int64. The all-gather copies bits, so every
rank receives every rank's tag in the same collective, without a collective of its own:

- CPU: the tags are compared on the host right after the wait (read in place from copy-out's
  tag destination through a ctypes view, `HostTags`: no torch op per check); on a mismatch every rank raises
  `CollectiveMismatchError` in the same collective, naming each rank's step, phase and unit.
- CUDA: no comparison on the device. Right after copy-out (on the gather stream, behind it)
  the received tags (copy-out's tag destination, `world_size x TAG_NUMEL` elements) go to the
  host in one non-blocking copy into a pinned slab ([Note: deferred tag check]), and the host
  compares them with the tag it sent two checks later (`check_pending`, at the end of each
  backward): the error comes two steps late, normally without a sync, on every rank at the same
  check (every rank received every tag). `check_pending(wait=True)`
  reads everything at once, at one sync: checkpoint.save, the state-dict export and exit do
  ([Note: final checks] in engine/late_checks.py).

Compressed all-gathers carry the same tag in the last `TAG_BYTES` of each rank's byte row
(`coded.encode_shard` leaves the room, `byte_tags` reads it).

[Note: reduction trail]
Gradient reductions carry no tag (a reduce-scatter sums what it receives; there is nothing to
compare after it). In ZeRO-3 the backward all-gathers between them caught ranks whose backwards
diverged (one rank skipped a unit, so it reduces the units in another order). Units kept from
forward to backward ([Note: units kept for backward] in schedule.py) have no backward gather,
and with every unit kept a backward is reductions only: two ranks reducing [3, 2, 1, 0] and
[3, 2, 0, 1] would sum unit 1's gradients with unit 0's, silently when the sizes match. So the
runtime folds the units of every reduction it issues into a running hash (`reduce_trail`); when
the next step begins, the trail of the last step that reduced anything moves into the
signature field of every tag (XOR). Ranks whose reductions differed then raise
`CollectiveMismatchError` at the next step's first all-gather, naming "signature" as what
differs. One step late (the optimizer has applied that step's gradients by then, as on CUDA,
where every check is read two steps late), but not silent. Ranks that skip the same unit together
(layer drop under one seed) reduce in the same order and raise nothing.

What it cannot catch: collectives of different sizes (gloo aborts the process on the size
mismatch, NCCL may hang until the process group's timeout), and hpZ's backward all-gathers
from the secondary copies, which carry no tag yet.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

TAG_BYTES = 8
"""The tag's size; a compressed all-gather's byte rows end in it (`byte_tags`)."""

TAG_NUMEL = 16
"""Elements after each rank's shard in a tagged all-gather (the tag is the first 8 bytes). 16, the
chunk alignment (`units.CHUNK_ALIGN_NUMEL`), so that every gathered row stays a multiple of 16
elements and the copy-out keeps its aligned, vectorized kernel at world size >= 2 (with 4,
every copy-out there ran the unaligned variant)."""

PHASES = ("forward", "forward (no grad)", "backward")


@dataclass(frozen=True)
class Tag:
    step: int
    phase: int
    unit: int
    signature: int

    def pack(self) -> int:
        value = (self.step & 0xFFFF) | (self.phase & 0xFF) << 16 | (self.unit & 0xFFFF) << 24
        value |= (self.signature & 0x7FFFFF) << 40
        return value

    @staticmethod
    def unpack(value: int) -> Tag:
        return Tag(value & 0xFFFF, (value >> 16) & 0xFF, (value >> 24) & 0xFFFF, (value >> 40) & 0x7FFFFF)

    def describe(self) -> str:
        phase = PHASES[self.phase] if self.phase < len(PHASES) else f"phase {self.phase}"
        return f"step {self.step} {phase} of unit {self.unit} (signature {self.signature:#x})"


TRAIL_MASK = 0x7FFFFF
"""The reduction trail's bits: those of the tag's signature field ([Note: reduction trail])."""


def signature(trainable: tuple[bool, ...]) -> int:
    """A unit's trainable-parameter pattern as a small hash (ranks that froze different
    parameters differ here; [Note: requires_grad after wrap] in engine/state.py)."""
    digest = hashlib.blake2b(repr(trainable).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFF


class CollectiveMismatchError(ValueError):
    """Ranks paired all-gathers of different steps, phases or units ([Note: collective fingerprints])."""


def tag_view(buffer: torch.Tensor, numel: int) -> torch.Tensor:
    """The int64 tag slot behind the first `numel` elements of a flat `buffer`."""
    trailer = buffer[numel : numel + TAG_NUMEL]
    return trailer.view(torch.uint8)[:8].view(torch.int64)


def write_tag(buffer: torch.Tensor, numel: int, value: int) -> None:
    """Put `value` behind the shard: a fill with a scalar argument (no host-to-device copy)."""
    tag_view(buffer, numel).fill_(value)


def received_tags(gathered: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every rank's int64 tag from a tagged all-gather output, shape (world_size,), read from the
    bits (no float copy in between: a tag may look like a NaN)."""
    trailers = gathered.view(world_size, -1)[:, -TAG_NUMEL:].contiguous()
    return trailers.view(torch.uint8)[:, :8].contiguous().view(torch.int64).view(-1)


def byte_tags(received: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every rank's tag bytes in a tagged compressed all-gather's uint8 output: a (world_size,
    TAG_BYTES) view, no copy (each rank's row ends in its tag: `coded.all_gather_encoded`)."""
    return received.view(world_size, -1)[:, -TAG_BYTES:]


def host_byte_tags(received: torch.Tensor, world_size: int) -> list[int]:
    """`byte_tags` read in place from host memory (a ctypes view: no torch op per check)."""
    row = received.numel() // world_size
    assert received.device.type == "cpu" and received.is_contiguous() and row % 8 == 0
    assert received.data_ptr() % 8 == 0
    words = ctypes.cast(received.data_ptr(), ctypes.POINTER(ctypes.c_int64))
    return [words[(r + 1) * row // 8 - 1] for r in range(world_size)]


def mismatch_message(values: list[int], mine: int, rank: int, what: str) -> str:
    lines = [
        f"overlap: rank {rank}: the ranks' collectives diverged at the {what}: ranks paired "
        "all-gathers of different steps, phases or units, so they would exchange the wrong data "
        "or hang. Each rank sent:"
    ]
    for r, value in enumerate(values):
        lines.append(f"  rank {r}: {Tag.unpack(value).describe()}")
    lines.append(
        f"(this rank expected {Tag.unpack(mine).describe()}). Every rank must run the same "
        "forwards and backwards in the same order: e.g. evaluate on every rank (and reduce the "
        "metric), not under `if rank == 0`, and keep data-dependent branches from skipping a unit "
        "on some ranks only. Tags that differ in their signature only: the ranks froze different "
        "parameters, or reduced gradients in a different order in their last backward (a unit "
        "skipped on some ranks: [Note: reduction trail] in overlap/transport/fingerprint.py)."
    )
    return "\n".join(lines)


class HostTags:
    """Every rank's tag, read in place from `trailers`: a contiguous CPU tensor of world_size x
    TAG_NUMEL elements holding the received trailers (the runtime's copy-out destination for
    them, allocated once per unit). A ctypes view: a check costs no torch op, where slicing the
    gathered buffer took several per all-gather."""

    def __init__(self, trailers: torch.Tensor, world_size: int) -> None:
        assert self.fits(trailers, world_size)
        self.trailers = trailers  # keeps the memory the pointer reads alive
        self._ptr = ctypes.cast(trailers.data_ptr(), ctypes.POINTER(ctypes.c_int64))
        self._stride = TAG_NUMEL * trailers.element_size() // 8
        self._world_size = world_size

    @staticmethod
    def fits(trailers: torch.Tensor, world_size: int) -> bool:
        row = TAG_NUMEL * trailers.element_size()
        return (
            trailers.device.type == "cpu"
            and trailers.is_contiguous()
            and trailers.numel() == world_size * TAG_NUMEL
            and row % 8 == 0
            and trailers.data_ptr() % 8 == 0
        )

    def values(self) -> list[int]:
        return [self._ptr[r * self._stride] for r in range(self._world_size)]


# [Note: deferred tag check]
# On CUDA the tags arrive in device memory, on the gather stream, and the host must not wait for
# them ([Note: no host sync in the hot path] in engine/runtime.py). Comparing on the device cost
# about 11 small kernels per all-gather on the gather stream, between the collective and the
# next unit's copy-out. Instead each check issues one non-blocking copy of
# the received tag rows (`world_size` rows, each beginning with an 8-byte tag) into a pinned
# slab, on the stream that ran copy-out, and remembers the tag this rank sent. Once per step,
# `check_pending` (at the end of each backward) closes the step's checks with one event per
# stream that issued copies, and compares on the host the batch closed `REPORT_AFTER_CHECKS`
# checks ago: its events are asked first (`Event.query()`); they have normally completed a step
# ago, and only if not (the device two whole steps behind the host) does the host wait for them
# (`blocking_waits`). The step of the report is fixed, not "whenever the copy is done": every
# rank sees every tag, so all find a mismatch, and with a fixed step all raise at the same check
# (a rank whose device ran ahead would otherwise raise a step before a slower one, and leave it
# in the next collective; the same rule as [Note: deferred finite check] in
# compression/finite.py). A mismatch is reported two steps late and never missed; slabs are
# reused once read, so at most `REPORT_AFTER_CHECKS + 1` steps of slabs are held.
# `wait=True` reads everything now, at one sync, for the final checks ([Note: final checks] in
# engine/late_checks.py).

REPORT_AFTER_CHECKS = 2
"""A CUDA batch of tag copies closed at check c is compared at check c + 2 ([Note: deferred tag check])."""

SLAB_BYTES = 64 * 1024
"""Pinned bytes per slab: a step of tag copies (world_size x TAG_NUMEL elements per all-gather)."""


def row_tags(host: torch.Tensor, world_size: int) -> list[int]:
    """The tag at the start of each of the `world_size` equal rows of the host bytes `host`,
    read in place (a ctypes view: no torch op)."""
    row_bytes = host.numel() * host.element_size() // world_size
    assert host.device.type == "cpu" and host.is_contiguous() and row_bytes % 8 == 0
    assert host.data_ptr() % 8 == 0
    words = ctypes.cast(host.data_ptr(), ctypes.POINTER(ctypes.c_int64))
    stride = row_bytes // 8
    return [words[r * stride] for r in range(world_size)]


def _pinned(nbytes: int, device: torch.device) -> torch.Tensor:
    """Host bytes a non-blocking copy from `device` may land in: pinned for CUDA."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


def _current_stream(device: torch.device) -> Any:
    """The stream a copy from `device` is issued on; None for host tensors (complete at once)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


class _Slab:
    """Pinned bytes handed out in 8-byte aligned pieces; all given back at once."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.buffer = _pinned(nbytes, device)
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor | None:
        start = -(-self.used // 8) * 8
        if start + nbytes > self.buffer.numel():
            return None
        self.used = start + nbytes
        return self.buffer[start : start + nbytes]


class _Deferred(NamedTuple):
    """One all-gather's tags on their way to the host."""

    host: torch.Tensor  # uint8 bytes in a slab: world_size rows, each beginning with a tag
    world_size: int
    mine: int  # the tag this rank sent
    what: str


class _Batch(NamedTuple):
    """A step's deferred checks and the events that say their copies are done."""

    checks: list[_Deferred]
    slabs: list[_Slab]
    done: list[Any]  # torch.cuda.Event per stream that issued copies (none for host tensors)
    check: int  # the check that closed it


class FingerprintCheck:
    """Compares the gathered tags with this rank's ([Note: collective fingerprints]): at once on
    the host (`check_host`, `check`), or two checks late from pinned copies (`defer`,
    `check_pending`: [Note: deferred tag check])."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.device = device
        self._open: list[_Deferred] = []  # deferred since the last check_pending
        self._open_slabs: list[_Slab] = []
        self._streams: dict[Any, Any] = {}  # the streams that issued them (keys = values)
        self._batches: deque[_Batch] = deque()  # closed, not yet read, oldest first
        self._num_checks = 0  # check_pending calls so far
        self.blocking_waits = 0  # reads that had to wait for their copies
        self._free: list[_Slab] = []

    def check_host(self, tags: HostTags | list[int], mine: int, what: str) -> None:
        """CPU: compare the tags `tags` reads (or holds) with `mine`, now."""
        values = tags.values() if isinstance(tags, HostTags) else tags
        for value in values:
            if value != mine:
                raise CollectiveMismatchError(mismatch_message(values, mine, self.rank, what))

    def check(self, gathered: torch.Tensor, world_size: int, mine: int, what: str) -> None:
        """CPU: compare the tags of a tagged all-gather's output with `mine`, now."""
        assert gathered.device.type == "cpu", "device tags are checked through `defer`"
        self.check_host(received_tags(gathered, world_size).tolist(), mine, what)

    @property
    def num_unread(self) -> int:
        """Deferred checks not compared yet."""
        return len(self._open) + sum(len(b.checks) for b in self._batches)

    def defer(self, tags: torch.Tensor, world_size: int, mine: int, what: str) -> None:
        """Send `tags` (`world_size` equal rows of bytes, each beginning with a tag; device
        memory) to the host in one non-blocking copy on the current stream, to be compared with
        `mine` by a later `check_pending` ([Note: deferred tag check])."""
        raw = tags.view(torch.uint8)  # the bits: a tag may look like a NaN
        host = self._take(raw.numel(), raw.device)
        host = host.view(raw.shape) if raw.dim() > 1 else host
        host.copy_(raw, non_blocking=True)  # the one device op of a check
        stream = _current_stream(raw.device)  # the stream that copied
        if stream is not None:
            self._streams.setdefault(stream, stream)
        self._open.append(_Deferred(host, world_size, mine, what))

    def _take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        piece = self._open_slabs[-1].take(nbytes) if self._open_slabs else None
        if piece is None:
            slab = self._free.pop() if self._free and self._free[-1].buffer.numel() >= nbytes else None
            slab = slab or _Slab(max(SLAB_BYTES, nbytes), device)
            self._open_slabs.append(slab)
            piece = slab.take(nbytes)
            assert piece is not None
        return piece

    def check_pending(self, wait: bool = False) -> None:
        """Once per step: close this step's deferred checks and compare, oldest first, every
        batch whose copies are complete (without waiting); with `wait`, wait for all and compare
        them now.
        Raises CollectiveMismatchError for the first mismatch found. Nothing to do for host
        checks (compared at once)."""
        self._num_checks += 1
        if self._open:
            done = []
            for stream in self._streams.values():
                event = torch.cuda.Event()
                event.record(stream)
                done.append(event)
            self._batches.append(_Batch(self._open, self._open_slabs, done, self._num_checks))
            self._open, self._open_slabs, self._streams = [], [], {}
        while self._batches:
            batch = self._batches[0]
            if batch.done and not wait and self._num_checks - batch.check < REPORT_AFTER_CHECKS:
                return  # its check is a later one, the same on every rank (host tensors: now)
            if not all(event.query() for event in batch.done):
                self.blocking_waits += 1  # the device two steps behind the host (or a final check)
                for event in batch.done:
                    event.synchronize()
            self._batches.popleft()
            self._read(batch)

    def _read(self, batch: _Batch) -> None:
        """Compare a batch whose copies are complete; its slabs are free again."""
        error = None
        for check in batch.checks:
            values = row_tags(check.host, check.world_size)
            if error is None and any(v != check.mine for v in values):
                error = mismatch_message(values, check.mine, self.rank, f"{check.what} (compared after its step)")
        for slab in batch.slabs:
            slab.used = 0
            self._free.append(slab)
        if error is not None:
            raise CollectiveMismatchError(error)
