"""What the commands train: `step` (W1 and the GPT of `overlap bench step`, `tune` and the
planner's calibration), `gpt` (the byte-level GPT), `data` (the Python stdlib's bytes) and `toy`
(the small models of the overhead and FSDP x TP benchmarks)."""

from overlap.tools.workloads.gpt import GPT, Block, GPTConfig

__all__ = ["GPT", "Block", "GPTConfig"]
