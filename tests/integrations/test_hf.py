"""Hugging Face causal LMs under overlap.wrap: built from configs (no downloaded weights), the
default unit policy finds their decoder layers, training equals DDP bitwise every step (2 ranks,
fp32), and the full state dict round-trips through `save_pretrained` / `from_pretrained`.

Tiny Llama (untied head, RoPE, RMSNorm, GQA) and tiny GPT-2 (LM head tied to the token embedding;
Conv1D weights stored transposed). Dimensions are chosen so that dim 0 of several parameters is odd
(vocab 101 and 97, Llama's MLP width 97), so the last rank's chunks are padded. Eager attention:
one plain matmul/softmax path on CPU, deterministic.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

transformers = pytest.importorskip(
    "transformers", reason="optional extra `hf` (pip install -e '.[hf]'); CI installs it"
)

from helpers.hf import tiny_config, tiny_model
from helpers.models import step_both
from helpers.tolerance import shard_rows

import overlap

# runs in every rank too (they import this module to find the test functions)
transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()

SEQ_LEN = 12
ATTN = "eager"


def tiny_llama(seed: int = 0) -> nn.Module:
    config = tiny_config("llama", vocab_size=101, hidden_size=64, intermediate_size=97, attention_dropout=0.0,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    return tiny_model(transformers.LlamaForCausalLM, config, seed)


def tiny_gpt2(seed: int = 0) -> nn.Module:
    config = tiny_config("gpt2", vocab_size=97, n_embd=48, bos_token_id=1, eos_token_id=2)
    return tiny_model(transformers.GPT2LMHeadModel, config, seed)


MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2}
LAYERS = {"llama": "model.layers", "gpt2": "transformer.h"}
ROOT_PARAMS = {  # lm_head.weight is transformer.wte.weight in GPT-2: named once, by its first owner
    "llama": {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"},
    "gpt2": {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"},
}


def _input_ids(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, model.config.vocab_size, (2, SEQ_LEN), generator=g)


def _compare(what: str, ref: torch.Tensor, ours: torch.Tensor, out: list[str]) -> None:
    if not torch.equal(ref, ours):
        diff = (ref.float() - ours.float()).abs().max().item() if ref.shape == ours.shape else None
        out.append(f"{what}: shapes {tuple(ref.shape)} vs {tuple(ours.shape)}, max |diff| {diff}")


def train_vs_ddp(rank: int, world: int, model: str, config: dict | None = None, steps: int = 3) -> dict:
    """Wrap (default policy unless `config` says otherwise); train `steps` AdamW steps against
    DDP on a deep copy and list every loss, gradient shard and parameter shard that is not
    bitwise DDP's."""
    base = MODELS[model]()
    ref = DDP(copy.deepcopy(base))
    ours = overlap.wrap(base, **(config or {}))
    units = [
        (u.layout.label, u.layout.module_fqns, [slot.fqn for slot in u.layout.slots]) for u in ours._overlap_state.units
    ]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    named_ref = dict(ref.module.named_parameters())
    mismatches: list[str] = []
    for step in range(steps):
        x = _input_ids(base, rank, step)
        ref_loss = ref(input_ids=x, labels=x).loss
        ref_loss.backward()
        loss = ours(input_ids=x, labels=x).loss
        loss.backward()
        _compare(f"step {step} loss", ref_loss.detach(), loss.detach(), mismatches)
        for name, p in ours.named_parameters():
            assert isinstance(p, DTensor) and p.shape == named_ref[name].shape, (rank, name)
            local = p.grad.to_local()
            g_ref = shard_rows(named_ref[name].grad, local, rank, world)
            _compare(f"step {step} grad {name}", g_ref, local, mismatches)
        step_both(ref_opt, opt)
        for name, p in ours.named_parameters():
            local = p.detach().to_local()
            p_ref = shard_rows(named_ref[name].detach(), local, rank, world)
            _compare(f"step {step} param {name}", p_ref, local, mismatches)
    tied = None
    if model == "gpt2":
        tied = ours.lm_head.weight is ours.transformer.wte.weight
    return {"units": units, "mismatches": mismatches, "tied": tied}


def state_dict_round_trip(rank: int, world: int, model: str, path: str) -> dict | None:
    """One training step (so the weights are no fresh init), then the full state dict on rank 0
    → `save_pretrained` of a plain model → `from_pretrained`; its logits must be the wrapped
    model's. Returns rank 0's findings (None elsewhere)."""
    base = MODELS[model]()
    plain_keys = {k: tuple(v.shape) for k, v in base.state_dict().items()}
    ours = overlap.wrap(base)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    x = _input_ids(base, rank, 0)
    ours(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

    probe = _input_ids(base, 0, 99)  # the same on every rank
    with torch.no_grad():
        logits = ours(input_ids=probe).logits  # forward is collective: every rank runs it
    full = overlap.full_state_dict(ours)
    if rank != 0:
        assert full == {}, (rank, sorted(full))
        return None

    keys_match = {k: tuple(v.shape) for k, v in full.items()} == plain_keys
    plain = MODELS[model](seed=1)  # another init, so nothing passes by coincidence
    # save_pretrained empties the dict it is given (transformers 5 frees tensors as it writes)
    plain.save_pretrained(path, state_dict=dict(full))
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, output_loading_info=True, local_files_only=True, attn_implementation=ATTN
    )
    with torch.no_grad():
        loaded_logits = loaded(input_ids=probe).logits
    mismatches: list[str] = []
    _compare("logits", logits, loaded_logits, mismatches)
    for name, value in loaded.state_dict().items():
        _compare(f"loaded {name}", full[name], value, mismatches)
    result = {
        "keys": keys_match,
        "dtypes": sorted({str(v.dtype) for v in full.values()}),
        "missing": list(info["missing_keys"]),
        "unexpected": list(info["unexpected_keys"]),
        "mismatched": list(info["mismatched_keys"]),
        "mismatches": mismatches,
        "tied": None,
    }
    if model == "gpt2":
        result["tied"] = loaded.lm_head.weight is loaded.transformer.wte.weight and torch.equal(
            full["lm_head.weight"], full["transformer.wte.weight"]
        )
    return result


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_hf_trains_like_ddp(world2, model):
    results = world2.run(train_vs_ddp, model=model)
    layers = LAYERS[model]
    for rank, r in enumerate(results):
        labels = [label for label, _, _ in r["units"]]
        fqns = [fqns for _, fqns, _ in r["units"]]
        # embeddings, final norm and head stay in the root unit; each decoder layer is a unit
        assert labels[0] == "root" and fqns[0] == ("",), (rank, r["units"])
        assert fqns[1:] == [(f"{layers}.0",), (f"{layers}.1",)], (rank, r["units"])
        assert set(r["units"][0][2]) == ROOT_PARAMS[model], (rank, r["units"][0])
        assert not r["mismatches"], f"rank {rank}: not bitwise equal to DDP:\n" + "\n".join(r["mismatches"])
        if model == "gpt2":
            assert r["tied"], f"rank {rank}: lm_head.weight is no longer transformer.wte.weight"


def _gpt2_policy(name: str) -> set[type[nn.Module]]:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block, GPT2Model

    return {"transformer": {GPT2Model}, "embeddings": {GPT2Block, nn.Embedding}}[name]


@pytest.mark.parametrize(
    "policy, units",
    [
        # wte's owner is inside unit `transformer`, lm_head's in the root: the tie spans units
        pytest.param("transformer", [("",), ("transformer",)], id="tie-spans-units"),
        # wte's unit holds only the tied weight, which goes to the root: wte's unit is left empty
        # (dropped, or kept without parameters: either is fine here)
        pytest.param(
            "embeddings",
            [("",), ("transformer.wpe",), ("transformer.h.0",), ("transformer.h.1",)],
            id="tie-empties-a-unit",
        ),
    ],
)
def test_gpt2_tie_across_units_trains_like_ddp(world2, policy, units):
    """A parameter shared by modules in different units belongs to their lowest common
    ancestor's unit (here the root), as FSDP does; training stays bitwise DDP's."""
    config = {"unit_policy": _gpt2_policy(policy)}
    results = world2.run(train_vs_ddp, model="gpt2", config=config)
    for rank, r in enumerate(results):
        nonempty = [fqns for _, fqns, params in r["units"] if params]
        assert nonempty == units, (rank, r["units"])
        assert "transformer.wte.weight" in r["units"][0][2], (rank, r["units"][0])
        assert not r["mismatches"], f"rank {rank}: not bitwise equal to DDP:\n" + "\n".join(r["mismatches"])
        assert r["tied"], f"rank {rank}: lm_head.weight is no longer transformer.wte.weight"


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_hf_full_state_dict_loads_with_from_pretrained(world2, model, tmp_path):
    results = world2.run(state_dict_round_trip, model=model, path=str(tmp_path))
    assert results[1] is None
    r = results[0]
    assert r["keys"], "full_state_dict keys/shapes differ from the plain model's state_dict"
    assert r["dtypes"] == ["torch.float32"], r
    assert not (r["missing"] or r["unexpected"] or r["mismatched"]), r
    assert not r["mismatches"], "\n".join(r["mismatches"])
    if model == "gpt2":
        assert r["tied"], "from_pretrained lost the lm_head / wte tie"
