"""Small reference models for demos, tests and benchmarks."""

from overlap.tools.models.gpt import GPT, Block, GPTConfig

__all__ = ["GPT", "Block", "GPTConfig"]
