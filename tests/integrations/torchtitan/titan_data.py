"""A tokenizer and a data loader for torchtitan's Trainer that need no files: seeded random token
ids, different on each data-parallel rank, the same in every run, resumable from a checkpoint.
torchtitan's own loaders read a tokenizer and a dataset from disk (its test assets are not part of
the wheel); the model sees the same kind of batches: `({"input": ids}, labels)`, labels the inputs
shifted by one."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer


class SyntheticTokenizer(BaseTokenizer):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 2048

    def __init__(self, config: Config, **_: Any) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        raise NotImplementedError("the synthetic loader makes token ids directly")

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError("the synthetic loader makes token ids directly")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class SyntheticLoader(BaseDataLoader):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        vocab_size: int = 2048

    def __init__(
        self, config: Config, *, dp_world_size: int, dp_rank: int, seq_len: int, local_batch_size: int, **_: Any
    ) -> None:
        self.vocab_size = config.vocab_size
        self.dp_world_size, self.dp_rank = dp_world_size, dp_rank
        self.seq_len, self.batch_size = seq_len, local_batch_size
        self.index = 0  # batches handed out so far

    def batch(self, index: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        generator = torch.Generator().manual_seed(1000 * index + self.dp_rank)
        ids = torch.randint(self.vocab_size, (self.batch_size, self.seq_len + 1), generator=generator)
        return {"input": ids[:, :-1].contiguous()}, ids[:, 1:].contiguous()

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            self.index += 1
            yield self.batch(self.index - 1)

    def state_dict(self) -> dict[str, Any]:
        return {f"dp_rank_{self.dp_rank}": pickle.dumps(self.index), "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self.index = pickle.loads(state_dict[f"dp_rank_{self.dp_rank}"])
