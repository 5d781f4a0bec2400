"""A model's mixture-of-experts layers as its configuration declares them (`MoeShape`): what the
expert-parallel cost model (moe.py), its host pace (moe_host.py) and its kernel counts
(moe_kernels.py) read ([Note: expert parallelism] in moe.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class MoeShape:
    """A model's mixture-of-experts layers, as its configuration declares them."""

    num_experts: int
    """Routed experts per MoE layer (n_routed_experts, num_experts, num_local_experts)."""
    top_k: int
    """Experts each token is routed to (num_experts_per_tok)."""
    expert_ffn_hidden: int
    """Width of one routed expert's SwiGLU (moe_intermediate_size)."""
    shared_ffn_hidden: int = 0
    """Total width of the shared experts every token passes (n_shared_experts x their width)."""
    dense_layers: int = 0
    """Leading layers with the dense MLP (first_k_dense_replace) instead of experts."""
    every: int = 1
    """A MoE layer every this many layers after the dense ones (Llama 4's interleave step)."""
    groups: int = 1
    """Expert groups of the router's group-limited routing (n_group; 1: none)."""
    group_topk: int = 1
    """Groups a token's experts may come from (topk_group) when `groups` > 1."""
    activation_clamp: bool = False
    """The experts' GLU inputs are clamped before the activation (GPT-OSS's swiglu_limit;
    Megatron-Core's activation_func_clamp_value), outside the fused activation kernel ([Note:
    clamped expert activation])."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "expert_ffn_hidden", "every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MoeShape.{name} must be an int >= 1, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoeShape: top_k {self.top_k} > num_experts {self.num_experts}")
        if self.shared_ffn_hidden < 0 or self.dense_layers < 0:
            raise ValueError("MoeShape: shared_ffn_hidden and dense_layers must be >= 0")
        if self.num_experts % self.groups or not 1 <= self.group_topk <= self.groups:
            raise ValueError(f"MoeShape: {self.num_experts} experts in {self.groups} groups, top {self.group_topk}")

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.dense_layers and (index - self.dense_layers) % self.every == self.every - 1

    def num_moe_layers(self, num_layers: int) -> int:
        return sum(self.is_moe_layer(i) for i in range(num_layers))

    def expert_numel(self, hidden: int) -> int:
        """Parameters of one routed expert (gate, up, down)."""
        return 3 * hidden * self.expert_ffn_hidden

    def dense_numel(self, hidden: int) -> int:
        """Parameters of a MoE layer outside its routed experts: the router and shared experts."""
        return hidden * self.num_experts + 3 * hidden * self.shared_ffn_hidden
