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
- CUDA: the comparison runs on the device (a mismatch count and the last mismatching tags), and
  the count is read once per step a step late through pinned memory, without a sync; the error
  then comes one step late. `check_pending(wait=True)` reads at once, at one sync.

Compressed all-gathers carry the same tag in the last `TAG_BYTES` of each rank's byte row
(`comm.encode_shard` leaves the room, `byte_tags` reads it).

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
where every check is read a step late), but not silent. Ranks that skip the same unit together
(layer drop under one seed) reduce in the same order and raise nothing.

What it cannot catch: collectives of different sizes (gloo aborts the process on the size
mismatch, NCCL may hang until the process group's timeout), and hpZ's backward all-gathers
from the secondary copies, which carry no tag yet.
"""

from __future__ import annotations

import ctypes
import hashlib
from dataclasses import dataclass

import torch

TAG_BYTES = 8
"""The tag's size; a compressed all-gather's byte rows end in it (`byte_tags`)."""

TAG_NUMEL = 16
"""Elements after each rank's shard in a tagged all-gather (the tag is the first 8 bytes). 16, the
chunk alignment (`units.CHUNK_ALIGN_NUMEL`), so that every gathered row stays a multiple of 16
elements and the copy-out keeps its aligned, vectorized kernel at world size >= 2 (review 2,
finding 2: with 4, every copy-out there ran the unaligned variant)."""

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
    def unpack(value: int) -> "Tag":
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
    """Every rank's int64 tag from a tagged compressed all-gather's uint8 output, shape
    (world_size,): each rank's row ends in its tag (`comm.all_gather_encoded`)."""
    rows = received.view(world_size, -1)[:, -TAG_BYTES:].contiguous()
    return rows.view(torch.int64).view(-1)


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


class FingerprintCheck:
    """Compares the gathered tags with this rank's ([Note: collective fingerprints])."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.device = device
        self._on_device = device.type == "cuda"
        self._count: torch.Tensor | None = None  # CUDA: mismatches seen since the last poll
        self._last: torch.Tensor | None = None  # CUDA: the last mismatching tags
        self._expected: torch.Tensor | None = None  # CUDA: the tag this rank sent with them
        self._in_flight: tuple[torch.Tensor, torch.cuda.Event] | None = None

    def check_host(self, tags: HostTags | list[int], mine: int, what: str) -> None:
        """CPU: compare the tags `tags` reads (or holds) with `mine`, now."""
        values = tags.values() if isinstance(tags, HostTags) else tags
        for value in values:
            if value != mine:
                raise CollectiveMismatchError(mismatch_message(values, mine, self.rank, what))

    def check(self, gathered: torch.Tensor, world_size: int, mine: int, what: str) -> None:
        """Compare the tags of a tagged all-gather's output with `mine` (CPU: now; CUDA: on the
        current stream, reported by `check_pending`)."""
        self.check_values(received_tags(gathered, world_size), mine, what)

    def check_values(self, values: torch.Tensor, mine: int, what: str) -> None:
        """As `check`, for the (world_size,) int64 tags already taken out of the output."""
        if not self._on_device:
            host = values.tolist()  # CPU tensors only (this branch never runs on CUDA): no device to wait for
            if any(v != mine for v in host):
                raise CollectiveMismatchError(mismatch_message(host, mine, self.rank, what))
            return
        bad = (values != mine).any()
        if self._count is None:
            self._count = torch.zeros((), dtype=torch.int64, device=self.device)
            self._last = torch.zeros_like(values)
            self._expected = torch.zeros((), dtype=torch.int64, device=self.device)
        assert self._last is not None and self._expected is not None
        self._count.add_(bad.to(torch.int64))
        if self._last.shape != values.shape:
            self._last = torch.zeros_like(values)
        self._last.copy_(torch.where(bad, values, self._last))
        self._expected.copy_(torch.where(bad, torch.full_like(self._expected, mine), self._expected))

    def check_pending(self, wait: bool = False) -> None:
        """CUDA: raise for mismatches the previous call sent to the host (a step late, no sync);
        send this step's. CPU: nothing to do (checked at once)."""
        if self._count is None:
            return
        assert self._last is not None and self._expected is not None
        ready = self._in_flight
        host = torch.empty(self._last.numel() + 2, dtype=torch.int64, pin_memory=True)
        packed = torch.cat([self._count.view(1), self._expected.view(1), self._last])
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._count.zero_()
        self._in_flight = (host, event)
        if wait:
            ready = self._in_flight
        if ready is None:
            return
        values, done = ready
        done.synchronize()  # recorded a step ago: long complete
        if int(values[0]) > 0:
            seen = values[2:].tolist()  # pinned host copy recorded a step ago; only on a mismatch
            raise CollectiveMismatchError(mismatch_message(seen, int(values[1]), self.rank, "all-gather a step ago"))
