"""Offline training text: the Python standard library's own source, as bytes.

Every machine with Python has it, so the demo and tests train on real text without a download.
Files are read in sorted order, so every rank (and every run) builds the same corpus.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MAX_BYTES = 8 * 1024 * 1024
"""Enough text that a demo-sized model does not memorize it in a few hundred steps."""


def stdlib_source_files() -> list[Path]:
    """The stdlib's `*.py` files in a fixed order (site-packages excluded: it varies by machine)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = (p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_stdlib_bytes(max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """The concatenated stdlib sources, cut at `max_bytes`, as a 1-D uint8 tensor."""
    if max_bytes <= 0:
        raise ValueError(f"load_stdlib_bytes: max_bytes must be > 0, got {max_bytes}")
    chunks: list[bytes] = []
    total = 0
    for path in stdlib_source_files():
        try:
            chunk = path.read_bytes()
        except OSError:
            continue  # an unreadable file must not make the corpus differ between ranks' runs
        chunks.append(chunk[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total == 0:
        raise RuntimeError(f"no Python sources found under {sysconfig.get_paths()['stdlib']}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


@dataclass(frozen=True)
class ByteDataset:
    """Train and validation bytes: the first 90% of the corpus trains, the last 10% validates."""

    train: torch.Tensor
    val: torch.Tensor

    @classmethod
    def from_stdlib(cls, max_bytes: int = DEFAULT_MAX_BYTES, val_fraction: float = 0.1) -> ByteDataset:
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"ByteDataset: val_fraction must be in (0, 1), got {val_fraction}")
        data = load_stdlib_bytes(max_bytes)
        cut = int(len(data) * (1.0 - val_fraction))
        return cls(train=data[:cut], val=data[cut:])


def get_batch(
    data: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of `data`: inputs x (B, T) and next-byte targets y (B, T), both int64.

    The caller's generator decides the windows; seed it with the rank so ranks see different data.
    """
    if len(data) <= block_size:
        raise ValueError(f"get_batch: {len(data)} bytes cannot fill a block of {block_size} + 1")
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    offsets = torch.arange(block_size + 1)
    windows = data[starts[:, None] + offsets].long()
    return windows[:, :-1], windows[:, 1:]


def rank_generator(seed: int, rank: int) -> torch.Generator:
    """A batch generator distinct per rank yet reproducible from (seed, rank)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + rank)
