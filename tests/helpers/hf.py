"""Tiny Hugging Face models built from config objects (nothing downloaded), fp32, eager attention.

`tiny_config(family, **sizes)` starts from the family's small shape below and sets what a test
chooses (vocabulary, widths, token ids); `tiny_model(cls, config)` builds the model from the
config after seeding torch, so every rank builds the same parameters.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

# fmt: off
TINY: dict[str, dict[str, Any]] = {
    "llama": {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "tie_word_embeddings": False},
    "gpt2": {"n_layer": 2, "n_head": 4, "n_positions": 32, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
}
"""Per family: the layers, heads, positions and dropout every test's tiny model has."""
# fmt: on
TINY["mixtral"] = {**TINY["llama"], "num_local_experts": 8, "num_experts_per_tok": 2, "router_jitter_noise": 0.0}
CONFIGS = {"llama": "LlamaConfig", "mixtral": "MixtralConfig", "gpt2": "GPT2Config"}


def tiny_config(family: str, **sizes: Any) -> Any:
    """The `transformers` config of `family` ("llama", "mixtral", "gpt2"): `TINY[family]`, `sizes` over it."""
    import transformers

    return getattr(transformers, CONFIGS[family])(**{**TINY[family], **sizes})


def tiny_model(cls: Any, config: Any, seed: int = 0) -> nn.Module:
    """The model class `cls` built from `config` with eager attention (what `AutoModel*.from_config`
    does for its class), after `torch.manual_seed(seed)`."""
    torch.manual_seed(seed)
    return cls._from_config(config, attn_implementation="eager")
